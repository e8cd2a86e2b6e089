"""A minimal tool-calling agent on the official `openai` client, pointed at `clover serve`.

    clover serve                                   # in another terminal: 127.0.0.1:8000, the default model
    python examples/agent/agent.py "Make a folder notes and a file todo.txt in it, then list the folder."
    python examples/agent/agent.py --base-url http://127.0.0.1:8000/v1 --model clover-smol "..."

The loop every agent framework runs: send the conversation and the tools; if the answer calls tools, run them
and append each result as a `tool` message with the call's id; ask again; stop when the answer has no call (or
after `--max-steps` requests). The tools here are a toy in-memory file system; swap in your own.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Callable

from openai import OpenAI

FILES: dict[str, str] = {}  # path -> content; a folder is a path ending in "/"


def mkdir(path: str) -> str:
    FILES[path.rstrip("/") + "/"] = ""
    return f"created {path}"


def write_file(path: str, content: str) -> str:
    FILES[path] = content
    return f"wrote {len(content)} characters to {path}"


def list_dir(path: str) -> str:
    prefix = path.rstrip("/") + "/"
    return json.dumps(sorted(p[len(prefix):] for p in FILES if p.startswith(prefix) and p != prefix))


def schema(name: str, description: str, **params: str) -> dict[str, Any]:
    """An OpenAI tool with string parameters, all required."""
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {p: {"type": "string", "description": d} for p, d in params.items()},
        "required": list(params)}}}


TOOLS = [schema("mkdir", "Create a folder.", path="the folder's path"),
         schema("write_file", "Write a text file.", path="the file's path", content="its text"),
         schema("list_dir", "List a folder.", path="the folder's path")]
IMPLEMENTATIONS: dict[str, Callable[..., str]] = {"mkdir": mkdir, "write_file": write_file, "list_dir": list_dir}


def run_tool(name: str, arguments: str) -> str:
    """A tool's result, or the error as text: the model reads it and can correct itself."""
    try:
        return IMPLEMENTATIONS[name](**json.loads(arguments))
    except KeyError:
        return f"error: no tool named {name}"
    except (TypeError, ValueError) as exc:
        return f"error: bad arguments for {name}: {exc}"


def agent(client: OpenAI, model: str, task: str, max_steps: int) -> str:
    messages: list[dict[str, Any]] = [{"role": "user", "content": task}]
    for _ in range(max_steps):
        message = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                                 temperature=0.0, max_tokens=256).choices[0].message
        messages.append(message.model_dump(exclude_none=True))  # the call goes back as the model wrote it
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            result = run_tool(call.function.name, call.function.arguments)
            print(f"  {call.function.name}({call.function.arguments}) -> {result}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return f"(stopped after {max_steps} requests)"


def main() -> None:
    p = argparse.ArgumentParser(description="A minimal tool-calling agent against an OpenAI-compatible server.")
    p.add_argument("task")
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", default="none", help="the server's --api-key, if it has one")
    p.add_argument("--model", default="clover-smol")
    p.add_argument("--max-steps", type=int, default=8)
    args = p.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    print(agent(client, args.model, args.task, args.max_steps))


if __name__ == "__main__":
    main()
