"""Chat rendering: Clover's chat template (ChatML turns, Hermes/Qwen tool calls, an optional `<think>` block) and
the checkpoint's own.

One module for every part that speaks chat — training data, engine, server, CLI: Clover's template (the Jinja asset
`clover/assets/chat_template.jinja`), message normalisation, rendering and training loss masks (parsing the model's
output back: `clover.assistant_output`). Inference renders with the checkpoint's own template (`checkpoint_template`:
the one its tokenizer carries, Clover's when it has none; clover-smol carries its base's, SmolLM2's), tools given in
the Hermes format below to a template that renders none (`hermes_messages`); training renders with
Clover's, the format below, whose renderings extend their prefixes' (the loss masks need that). Rendering goes through
`clover.tokenizer`'s renderer, which renders a template as `transformers` does (the one that renders it from a saved
checkpoint elsewhere), so both agree byte for byte.

Format (every line break shown is a literal ``\\n``)::

    <|im_start|>system
    {system message, if any, followed by a blank line}# Tools

    You may call one or more functions to assist with the user query.

    You are provided with function signatures within <tools></tools> XML tags:
    <tools>
    {"type": "function", "function": {"name": "get_weather", ...}}
    </tools>

    For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
    <tool_call>
    {"name": <function-name>, "arguments": <args-json-object>}
    </tool_call><|im_end|>
    <|im_start|>user
    Weather in Paris?<|im_end|>
    <|im_start|>assistant
    <think>
    {reasoning_content; nothing at all when the message has none}
    </think>

    {content}
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call><|im_end|>
    <|im_start|>user
    <tool_response>
    {"temp_c": 21}
    </tool_response><|im_end|>
    <|im_start|>assistant
    <think>

    </think>

    It is 21 °C in Paris.<|im_end|>

- The tools section exists only when `tools` is given; without tools a leading system message is a plain
  system turn. There is no default system prompt.
- Every assistant turn carries a think block, empty when it has no `reasoning_content` (Qwen3 convention), so
  a turn without reasoning looks exactly like what follows the no-thinking generation prompt. Reasoning is
  rendered wherever it is given (earlier turns too): the template is *prefix-stable* — rendering a prefix of
  a conversation yields a prefix of the full rendering — and callers that want to drop old reasoning remove
  it from the messages.
- Assistant content and reasoning are trimmed. Tool calls follow the content, one ``<tool_call>`` block each,
  separated by a line break (also from non-empty content); arguments are JSON objects (`tojson`, non-ASCII kept).
- Consecutive `tool` messages share one user turn, one ``<tool_response>`` block each.
- Generation prompt: ``<|im_start|>assistant\\n<think>\\n``, followed by ``\\n</think>\\n\\n`` unless
  `enable_thinking` (default False), so that the model answers directly.

Training masks (`tokenize_chat_for_training`): the trained tokens of an assistant turn are exactly what the
model generates after the matching generation prompt — everything up to and including its ``<|im_end|>``,
but after ``<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n`` when the turn has no reasoning, and after
``<|im_start|>assistant\\n<think>\\n`` when it has some. The conversation is tokenized piece by piece (prompt
pieces and trained pieces separately), so every prompt piece is tokenized exactly as a generation prompt is
at inference time; BPE merges never cross a prompt/answer boundary.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any


IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ROLES = ("system", "user", "assistant", "tool")
_REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")  # names other APIs use for the same field

TEMPLATE_PATH = resources.files("clover") / "assets" / "chat_template.jinja"
CLOVER_CHAT_TEMPLATE = TEMPLATE_PATH.read_text(encoding="utf-8")  # the Jinja source; checkpoints carry it too


# -- inputs ---------------------------------------------------------------------------------------------------------
def _text(content: Any) -> str:
    """OpenAI message content (None, a string, a list of parts, or a JSON value for tool results) as text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and "type" in p for p in content):
        return "".join(p.get("text", "") for p in content if p["type"] == "text")
    return json.dumps(content, ensure_ascii=False)


def normalize_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tools in OpenAI form ``{"type": "function", "function": {...}}``; bare function schemas get wrapped."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ValueError(f"tools[{i}] must be an object, got {type(tool).__name__}")
        if "function" not in tool:
            if "name" not in tool:
                raise ValueError(f"tools[{i}] has neither 'function' nor 'name': {tool!r}")
            tool = {"type": "function", "function": tool}
        out.append(tool)
    return out


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Check roles and bring messages to the canonical form the template renders.

    Content becomes a string (text parts joined, JSON values dumped), `reasoning_content` a string (also read
    from `reasoning` or `thinking`), and tool call arguments given as JSON strings (OpenAI style) become
    objects, so that rendering is canonical. Other keys (`tool_call_id`, `name`, ...) are not rendered.
    """
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list, got {type(messages).__name__}")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in ROLES:
            raise ValueError(f"messages[{i}] must be an object with a role in {list(ROLES)}, got {msg!r:.200}")
        norm = {"role": msg["role"], "content": _text(msg.get("content"))}
        if msg["role"] == "assistant":
            reasoning = next((msg[k] for k in _REASONING_KEYS if msg.get(k) is not None), None)
            norm["reasoning_content"] = _text(reasoning)
            calls = []
            for j, call in enumerate(msg.get("tool_calls") or []):
                fn = call.get("function", call) if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ValueError(f"messages[{i}].tool_calls[{j}] needs a function name, got {call!r:.200}")
                args = fn.get("arguments") or {}
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except json.JSONDecodeError:
                        pass  # rendered verbatim
                calls.append({"type": "function", "function": {"name": fn["name"], "arguments": args}})
            if calls:
                norm["tool_calls"] = calls
        out.append(norm)
    return out


# -- rendering ------------------------------------------------------------------------------------------------------
def checkpoint_template(tokenizer: Any) -> str:
    """The template a checkpoint's chats are rendered with: its own (the one its tokenizer carries, kept from the
    source by conversion), or Clover's for a tokenizer without one."""
    return getattr(tokenizer, "chat_template", None) or CLOVER_CHAT_TEMPLATE


def render_chat(tokenizer: Any, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = False,
                enable_thinking: bool | None = None, template: str | None = None, **template_kwargs: Any) -> str:
    """The conversation as text in `template` (default: the checkpoint's own, `checkpoint_template`); tokenize it
    with ``add_special_tokens=False`` — templates write their special tokens themselves. `enable_thinking` None:
    the template's own default (Clover's: off; Qwen3.5's: on); `template_kwargs`: further variables the template
    reads (a request's `chat_template_kwargs`). A template that renders no tools (SmolLM2's) gets them, the calls
    and the results in Hermes form as plain messages (`hermes_messages`); a chat without any renders as it would."""
    if enable_thinking is not None:
        template_kwargs["enable_thinking"] = enable_thinking
    template = template or checkpoint_template(tokenizer)
    messages, tools = normalize_messages(messages), normalize_tools(tools)
    if not renders_tools(tokenizer, template):
        messages, tools = hermes_messages(messages, tools), None
    return tokenizer.apply_chat_template(messages, tools=tools, chat_template=template,
                                         add_generation_prompt=add_generation_prompt, tokenize=False,
                                         **template_kwargs)


# -- tools for a template without them ------------------------------------------------------------------------------
# vLLM and llama.cpp serve a template that ignores `tools` by writing the tools into the system turn themselves;
# Clover does so in the Hermes format (the one Clover's template and Qwen's use, which the `hermes` parser reads)
TOOLS_PROBE = "clover_tools_probe"
_RENDERS_TOOLS: dict[str, bool] = {}


def renders_tools(tokenizer: Any, template: str) -> bool:
    """Whether `template` writes the tools it is given (a probe tool's name shows up in a rendering; llama.cpp
    finds a template's capabilities the same way). A template that fails on the probe is left to render tools
    itself, as it did before this check. Memoised per template."""
    if template not in _RENDERS_TOOLS:
        probe = [{"type": "function", "function": {
            "name": TOOLS_PROBE, "description": "probe",
            "parameters": {"type": "object", "properties": {"x": {"type": "string", "description": "x"}},
                           "required": ["x"]}}}]
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "?"}], tools=probe,
                                                 chat_template=template, tokenize=False)
        except Exception:  # noqa: BLE001 - any error of the template's own
            text = TOOLS_PROBE
        _RENDERS_TOOLS[template] = TOOLS_PROBE in text
    return _RENDERS_TOOLS[template]


def hermes_tools_prompt(tools: list[dict[str, Any]]) -> str:
    """The tools section of a system turn, in Clover's template's words (its module docstring shows it)."""
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
            + "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
            + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
              '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
              "<args-json-object>}\n</tool_call>")


def _hermes_call(function: dict[str, Any]) -> str:
    """One call as Clover's template writes it (arguments that are not JSON verbatim)."""
    args = function["arguments"]
    args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    name = json.dumps(function["name"], ensure_ascii=False)
    return '<tool_call>\n{"name": ' + name + ', "arguments": ' + args + "}\n</tool_call>"


def hermes_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Normalised `messages` with tools, calls and results as text, for a template that renders none of them:
    the tools section after the system message (a system turn of its own when there is none), each call a
    `<tool_call>` block after the assistant's content, consecutive results one user turn of `<tool_response>`
    blocks. Identity on a chat without tools, calls or results."""
    out: list[dict[str, Any]] = []
    if tools:
        system = messages[0]["content"] + "\n\n" if messages and messages[0]["role"] == "system" else ""
        out.append({"role": "system", "content": system + hermes_tools_prompt(tools)})
        messages = messages[1:] if system else messages
    for message in messages:
        if message["role"] == "assistant" and message.get("tool_calls"):
            content = message["content"].strip()
            calls = [_hermes_call(call["function"]) for call in message["tool_calls"]]
            message = {**{k: v for k, v in message.items() if k != "tool_calls"},
                       "content": "\n".join([content, *calls] if content else calls)}
        elif message["role"] == "tool":
            block = "<tool_response>\n" + message["content"] + "\n</tool_response>"
            if out and out[-1].get("tool_results"):  # consecutive results share one user turn
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + block}
                continue
            message = {"role": "user", "content": block, "tool_results": True}
        out.append(message)
    return [{k: v for k, v in m.items() if k != "tool_results"} for m in out]


def opens_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt ends inside a `<think>` block (the model's answer starts as reasoning)."""
    return prompt.rfind("<think>") > prompt.rfind("</think>")


def tokenize_chat_for_training(tokenizer: Any, messages: list[dict[str, Any]],
                               tools: list[dict[str, Any]] | None = None) -> tuple[list[int], list[int]]:
    """Token ids of the rendered chat and a loss mask (1 = trained) over the assistant turns.

    Each assistant turn is trained on what the model generates after the generation prompt (see the module
    docstring), up to and including its ``<|im_end|>``. Boundaries come from rendering the conversation
    prefix by prefix; the pieces between boundaries are tokenized separately and concatenated.
    """
    msgs, tools = normalize_messages(messages), normalize_tools(tools)
    full = render_chat(tokenizer, msgs, tools, template=CLOVER_CHAT_TEMPLATE)
    cuts = [0]
    for i, msg in enumerate(msgs):
        if msg["role"] != "assistant":
            continue
        if i == 0:
            raise ValueError("messages[0] is an assistant turn; a training chat starts with a system or user message")
        thinking = bool(msg["reasoning_content"].strip())
        before = render_chat(tokenizer, msgs[:i], tools, add_generation_prompt=True, enable_thinking=thinking,
                             template=CLOVER_CHAT_TEMPLATE)
        through = render_chat(tokenizer, msgs[: i + 1], tools, template=CLOVER_CHAT_TEMPLATE)
        if not (through.startswith(before) and through.endswith(IM_END + "\n") and full.startswith(through)
                and len(before) >= cuts[-1]):
            raise ValueError(f"chat template is not prefix-stable at messages[{i}]; cannot place the loss mask")
        cuts += [len(before), len(through) - 1]  # the turn's text up to and including <|im_end|>
    cuts.append(len(full))
    pieces = [full[a:b] for a, b in zip(cuts, cuts[1:])]
    input_ids: list[int] = []
    loss_mask: list[int] = []
    for k, ids in enumerate(tokenizer(pieces, add_special_tokens=False)["input_ids"]):
        input_ids += ids
        loss_mask += [k % 2] * len(ids)  # odd pieces are assistant answers
    return input_ids, loss_mask
