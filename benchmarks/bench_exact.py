"""Is the default lossless and never slower? clover-smol's default against block size 1 and llama.cpp, same run.

    python benchmarks/bench_exact.py [--limit 8] [--max-new-tokens 128] [--threads 2] [--systems ...] [--out F]
        [--warmup N]
    python benchmarks/bench_exact.py --prior        # exact mode's per-position acceptance on training prompts

Held-out sets (chat, code, structured from recipes/clover_smol/heldout.jsonl; tool calls from our BFCL eval split
and BFCL's `live_simple`), batch 1, greedy. Systems, all loaded at once and taking turns prompt by prompt (so a
slow minute of a shared machine hits them alike):

  * `default`     what `clover generate` runs: the int4 build, exact mode, drafts sized by the measured cost
  * `int4-b1`     the int4 build at block size 1 (one token a forward: the speed reference)
  * `int4-full`   the int4 build, exact mode drafting the whole block every forward (not adaptive)
  * `no-lookup`   the default without drafts copied from the context after a rejection (clover.engine.drafts.lookup),
                  nor from the drafting memory
  * `no-memory`   the default without the drafting memory (clover.engine.drafts.draft_memory: drafts from the answers
                  the engine gave before, which `default` keeps over the whole run, as a server would)
  * `fp32-exact`, `fp32-b1`   the same two in fp32 torch (`--systems` adds them; slow)
  * `llama-q4_0`, `llama-q8_0`   llama.cpp's own AR generation (`clover.runners.llamacpp_ar`: one causal sequence,
                  greedy) of the same model exported to GGUF (`clover export`), on the same token ids
  * `llama-server`, `llama-server-ngram`   llama.cpp's own server (benchmarks/llama_server.py, one slot, a
                  subprocess for the run) on the q4_0 GGUF, plain and with its draft-free n-gram speculation
                  (`--spec-type ngram-mod`, the build's defaults; its pool fills from every prompt and answer the
                  server has seen); each prompt sent as token ids to its native `/completion` endpoint, greedy,
                  `cache_prompt` off (each prompt prefilled whole, as the other systems do), timed end to end over
                  HTTP; forwards are the tokens less the drafted tokens accepted, and `draft_acceptance` the
                  accepted share of the drafted tokens (the server's `timings`)
  * `clover-llamacpp-q4_0`, `clover-llamacpp-q8_0`   Clover's engine on its llama.cpp runner
                  (`clover.runners.llamacpp`, as `clover generate --runner llamacpp` opens it) over the same GGUF
                  exports: exact mode, drafts sized by that runner's own measured cost
  * `llamacpp-b1-q4_0`, `llamacpp-b1-q8_0`   the same runner at block size 1 (its speed and answer reference)
  * `candidate`, `candidate-b1`   `default` and `int4-b1` of another clover-smol adapter (`--candidate DIR`: a
                  directory `recipes/clover_smol/package.py` wrote), to compare a new adapter with the shipped one

`--warmup N`: before a set is timed, every system answers N other prompts of that set, untimed, as a server would
have seen them before (what the drafting memory of `default` and any server-side cache learn from).

Per set and system: tokens/s end to end (prefill included), tokens per forward, the ratio to `int4-b1`, the
seconds to each answer's first token (its prefill) summed over the prompts, tokens/s after it, and how
many answers are token for token the reference's (`default` and `int4-full` against `int4-b1`, `fp32-exact`
against `fp32-b1`, `clover-llamacpp-<q>` against `llamacpp-b1-<q>`, llama.cpp's own systems against `int4-b1`: a
different quantisation, so agreement, not identity: the q4_0 export rounds the int4 build's Q4_1 weights again,
and parts from it within the first tokens, docs/gguf.md) and, per prompt, where it first parts from it
(`first_divergence`: the index of the first differing token, None when equal); the JSON
also keeps each prompt's tokens, seconds, prefill and forwards (`by_prompt`: where one slow moment went). With any
llama.cpp system, `_llama_cpp_build` records the xllamacpp version and the llama.cpp release it carries.
`--prior` prints the acceptance by draft position of `int4-full` on training prompts (what clover-smol's manifest
records as `draft_acceptance`, exact mode's prior; with `--candidate`, the candidate's).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_server  # noqa: E402  (benchmarks/, next to this script)
from bench_smol import prompt_ids, text_sets, tool_sets  # noqa: E402
from server_process import ServerProcess  # noqa: E402

from clover.engine import Engine, SamplingParams  # noqa: E402
from clover.engine.drafts.cost import cost_table  # noqa: E402
from clover.engine.runner import as_runner  # noqa: E402
from clover.model import CloverForBlockDiffusion  # noqa: E402
from clover.smol import build_quantized, clover_smol_dir, clover_smol_gguf  # noqa: E402
from clover.tokenizer import eos_token_ids, load_tokenizer  # noqa: E402
from clover.training.bfcl import bfcl_to_chats  # noqa: E402

SERVERS = {"llama-server": "none", "llama-server-ngram": "ngram-mod"}  # system -> llama-server --spec-type
RUNNER_QUANTS = ("q4_0", "q8_0")  # the GGUF exports the llama.cpp runner's systems read
SYSTEMS = ("default", "int4-b1", "int4-full", "no-lookup", "no-memory", "llama-q4_0", "llama-q8_0", *SERVERS,
           *(f"clover-llamacpp-{q}" for q in RUNNER_QUANTS), *(f"llamacpp-b1-{q}" for q in RUNNER_QUANTS))
EXTRA = ("fp32-exact", "fp32-b1", "candidate", "candidate-b1")
REFERENCE = {"default": "int4-b1", "int4-full": "int4-b1", "no-lookup": "int4-b1", "no-memory": "int4-b1",
             "fp32-exact": "fp32-b1", "llama-q4_0": "int4-b1", "llama-q8_0": "int4-b1", "candidate": "candidate-b1",
             **{name: "int4-b1" for name in SERVERS},
             **{f"clover-llamacpp-{q}": f"llamacpp-b1-{q}" for q in RUNNER_QUANTS},
             **{f"llamacpp-b1-{q}": "int4-b1" for q in RUNNER_QUANTS}}

Decode = Callable[[list[int], int], tuple[list[int], dict[str, Any]]]  # (prompt ids, max new) -> (new ids, stats)


def engine_system(model: Any, tokenizer: Any, **options: Any) -> tuple[Decode, Engine]:
    engine = Engine(model, vocab_limit=len(tokenizer), eos_token_ids=eos_token_ids(model.config, tokenizer),
                    **options)

    def decode(ids: list[int], max_new: int) -> tuple[list[int], dict[str, Any]]:
        out, stats = [], {}
        for piece in engine.run([ids], max_new, SamplingParams()):
            out += piece.token_ids
            stats = piece.stats or stats
        return out, stats

    return decode, engine


def llama_system(quant: str, threads: int, eos: list[int], n_ctx: int = 4096) -> Decode:
    from clover.runners.llamacpp_ar import LlamaCppAR

    llm = LlamaCppAR(clover_smol_gguf(quant), threads=threads, n_ctx=n_ctx, n_batch=512)

    def decode(ids: list[int], max_new: int) -> tuple[list[int], dict[str, Any]]:
        out, start, first = [], time.perf_counter(), None
        for token in llm.generate(ids, max_new, eos):  # the KV cache cleared first: each system prefills each prompt
            first = first if first is not None else time.perf_counter() - start
            out.append(token)
        return out, {"forward_passes": len(out), "time_to_first_token_s": first}

    return decode


def server_system(name: str, threads: int, stack: ExitStack, n_ctx: int = 4096) -> Decode:
    """llama.cpp's own server on the q4_0 GGUF, started for the run (stopped when `stack` closes), one prompt a
    request to `/completion`."""
    gguf = clover_smol_gguf("q4_0")
    log = Path(tempfile.gettempdir()) / f"bench_exact-{name}-{os.getpid()}.log"
    server = stack.enter_context(ServerProcess(
        name, lambda port: llama_server.command(gguf, port, alias="bench", ctx=n_ctx, threads=threads,
                                                spec_type=SERVERS[name]), log, threads=threads))
    client = stack.enter_context(httpx.Client(base_url=server.url, timeout=600))

    def decode(ids: list[int], max_new: int) -> tuple[list[int], dict[str, Any]]:
        response = client.post("/completion", json=llama_server.completion_request(ids, max_new))
        response.raise_for_status()
        return llama_server.completion_result(response.json())

    return decode


def runner_system(system: str, threads: int, recalibrate: bool) -> tuple[Decode, Engine]:
    """Clover's engine on its llama.cpp runner over clover-smol's GGUF export, as `clover generate --runner
    llamacpp` opens it (one row, the default model's own tokenizer): exact mode as configured
    (`clover-llamacpp-<quant>`, its forward cost measured or read first) or block size 1 (`llamacpp-b1-<quant>`)."""
    from clover.runners.registry import RunnerOptions
    from clover.runners.registry import RUNNERS

    quant = system.rsplit("-", 1)[1]
    runner = RUNNERS["llamacpp"].load().open(clover_smol_gguf(quant), RunnerOptions(threads=threads, max_rows=1))
    tokenizer = load_tokenizer(clover_smol_dir())
    if system.startswith("llamacpp-b1"):
        return engine_system(runner, tokenizer, block_size=1, rule="threshold")
    cost_table(runner, recalibrate=recalibrate)
    return engine_system(runner, tokenizer, rule="exact")


def load(system: str, threads: int, recalibrate: bool, candidate: Path | None = None) -> tuple[Decode, Engine | None]:
    if "llamacpp-" in system:
        return runner_system(system, threads, recalibrate)
    quant = "none" if system.startswith("fp32") else "int4"
    if system.startswith("candidate"):
        if candidate is None:
            raise SystemExit(f"system {system} needs --candidate DIR (an adapter package)")
        directory = build_quantized(quant, asset_dir=candidate)
    else:
        directory = clover_smol_dir(quant)
    tokenizer = load_tokenizer(directory)
    if system.startswith("llama"):
        return llama_system(system.split("-")[1], threads, eos_token_ids(CloverForBlockDiffusion.from_pretrained(
            directory, device="meta").config, tokenizer)), None
    model = CloverForBlockDiffusion.from_pretrained(directory)
    options: dict[str, Any] = {"block_size": 1, "rule": "threshold"} if system.endswith("b1") else {}
    if system == "int4-full":
        options = {"rule": "exact", "rule_options": {"adaptive": False}}
    if system in ("default", "no-lookup", "no-memory", "fp32-exact", "candidate"):  # as `clover generate` runs:
        cost_table(as_runner(model), recalibrate=recalibrate)  # cached costs
        options = {"rule": "exact",
                   "rule_options": {"lookup": system != "no-lookup", "memory": system != "no-memory"}}
    return engine_system(model, tokenizer, **options)


def run(systems: list[str], sets: dict[str, list[list[int]]], max_new: int, threads: int,
        recalibrate: bool, candidate: Path | None = None,
        warmup: dict[str, list[list[int]]] | None = None) -> dict[str, Any]:
    with ExitStack() as servers:
        loaded = {s: (server_system(s, threads, servers), None) if s in SERVERS else
                  load(s, threads, recalibrate, candidate) for s in systems}
        report = compare(loaded, sets, max_new, warmup or {})
    if any(s.startswith("llama") for s in systems):
        report["_llama_cpp_build"] = llama_server.llama_cpp_build()
    return report


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The index of the first token where two answers differ (one ending before the other counts), None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(loaded: dict[str, tuple[Decode, Engine | None]], sets: dict[str, list[list[int]]],
            max_new: int, warmup: dict[str, list[list[int]]] | None = None) -> dict[str, Any]:
    """The systems taking turns prompt by prompt over each set, after the set's `warmup` prompts (untimed); the
    figures per set and system (module docstring)."""
    systems = list(loaded)
    for decode, _ in loaded.values():  # first calls build kernels and caches: not timed
        decode([1, 2, 3], 4)
    report: dict[str, Any] = {}
    for name, prompts in sets.items():
        rows: dict[str, list[tuple[list[int], int, float, float, dict[str, Any]]]] = {s: [] for s in systems}
        for ids in (warmup or {}).get(name, []):  # untimed: what a server saw before
            for s in systems:
                loaded[s][0](ids, max_new)
        for ids in prompts:
            for s in systems:
                start = time.perf_counter()
                out, stats = loaded[s][0](ids, max_new)
                rows[s].append((out, stats["forward_passes"], time.perf_counter() - start,
                                stats["time_to_first_token_s"], stats))
        report[name] = {}
        for s in systems:
            tokens = sum(len(r[0]) for r in rows[s])
            seconds = sum(r[2] for r in rows[s])
            first = sum(r[3] for r in rows[s])  # the prefills (and each first token)
            figures = {"tokens_per_second": tokens / seconds, "tokens": tokens,
                       "tokens_per_forward": tokens / max(sum(r[1] for r in rows[s]), 1), "prefill_s": first,
                       "decode_tokens_per_second": (tokens - len(rows[s])) / max(seconds - first, 1e-9),
                       "by_prompt": [{"tokens": len(r[0]), "seconds": r[2], "prefill_s": r[3], "forwards": r[1]}
                                     for r in rows[s]]}
            drafted = sum(r[4].get("draft_tokens", 0) for r in rows[s])  # llama.cpp's server reports its drafts
            if drafted:
                figures["draft_acceptance"] = sum(r[4]["draft_tokens_accepted"] for r in rows[s]) / drafted
            ref = REFERENCE.get(s)
            if ref in rows:
                figures["same_as_" + ref] = sum(a[0] == b[0] for a, b in zip(rows[s], rows[ref]))
                figures["first_divergence"] = [first_divergence(a[0], b[0]) for a, b in zip(rows[s], rows[ref])]
            report[name][s] = figures
            report.setdefault("_answers", {}).setdefault(name, {})[s] = [r[0] for r in rows[s]]
        base = report[name].get("int4-b1", {}).get("tokens_per_second")
        for s in systems:
            if base:
                report[name][s]["vs_int4_b1"] = report[name][s]["tokens_per_second"] / base
            f = report[name][s]
            same = next((f"{v}/{len(prompts)} same as {k[8:]}" for k, v in f.items() if k.startswith("same_as")), "")
            parted = [d for d in f.get("first_divergence", []) if d is not None]
            if parted:
                same += f" (parting at token {min(parted)} at the earliest)"
            print(f"{name:18} {s:18} {f['tokens_per_second']:7.1f} tok/s  x{f.get('vs_int4_b1', 0):.2f}  "
                  f"TPF {f['tokens_per_forward']:.2f}  prefill {f['prefill_s']:5.2f} s  decoding "
                  f"{f['decode_tokens_per_second']:6.1f} tok/s  {same}", flush=True)
    report["_engines"] = {s: e.settings() for s, (_, e) in loaded.items() if e is not None}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=8, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=0, help="other prompts per set answered, untimed, before it")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"comma-separated, of {', '.join(SYSTEMS + EXTRA)}")
    parser.add_argument("--sets", default=None, help="comma-separated subset of chat,code,structured,tools_heldout,"
                        "tools_live_simple (default: all)")
    parser.add_argument("--recalibrate", action="store_true", help="measure the forward cost again first")
    parser.add_argument("--prior", action="store_true", help="measure exact mode's prior on training prompts")
    parser.add_argument("--candidate", type=Path, default=None,
                        help="another adapter package (package.py's output) for the candidate systems")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    parser.add_argument("--record", type=Path, default=None,
                        help="write the first system's prompts and answers here, one JSON line each, as "
                             "benchmarks/replay_drafts.py reads them")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # as an exception: the servers are stopped
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(clover_smol_dir())
    if args.prior:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes" / "clover_smol"))
        from prompts import build_prompts

        train, _ = build_prompts()
        chats = [{"messages": p.row()["messages"], "tools": None} for p in train[: 6 * args.limit]]
        chats += [{"messages": c["messages"][:-1], "tools": c["tools"]}
                  for c in bfcl_to_chats("train")[: 2 * args.limit]]
        if args.candidate is not None:  # the candidate's own drafts, drafting the whole block
            model = CloverForBlockDiffusion.from_pretrained(build_quantized("int4", asset_dir=args.candidate))
            decode, engine = engine_system(model, tokenizer, rule="exact", rule_options={"adaptive": False})
        else:
            decode, engine = load("int4-full", args.threads, False)
        for chat in chats:
            decode(prompt_ids(tokenizer, chat), args.max_new_tokens)
        measured = (f"benchmarks/bench_exact.py --prior --limit {args.limit} --max-new-tokens {args.max_new_tokens}: "
                    f"int4 build, exact mode drafting the whole block, {len(chats)} training prompts and BFCL train "
                    "chats")
        print(json.dumps({"draft_acceptance": engine.settings()["acceptance_by_position"],
                          "draft_acceptance_measured": measured, "prompts": len(chats)}))
        return
    systems = args.systems.split(",")
    unknown = set(systems) - set(SYSTEMS) - set(EXTRA)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}")
    sets = {**text_sets(args.limit + args.warmup), **tool_sets(args.limit + args.warmup)}
    if args.sets:
        unknown_sets = set(args.sets.split(",")) - set(sets)
        if unknown_sets:
            parser.error(f"unknown sets {sorted(unknown_sets)}: choose from {sorted(sets)}")
        sets = {name: sets[name] for name in args.sets.split(",")}
    prompts = {name: [prompt_ids(tokenizer, chat) for chat, _ in chats[:args.limit]] for name, chats in sets.items()}
    warmup = {name: [prompt_ids(tokenizer, chat) for chat, _ in chats[args.limit:]] for name, chats in sets.items()}
    print(f"machine: {platform.processor() or platform.machine()}, {args.threads} threads, torch "
          f"{torch.__version__}; {args.limit} prompts per set (after {args.warmup} untimed), {args.max_new_tokens} "
          "new tokens")
    report = run(systems, prompts, args.max_new_tokens, args.threads, args.recalibrate, args.candidate, warmup)
    answers = report.pop("_answers")
    if args.record:
        args.record.write_text("".join(json.dumps({"set": name, "prompt": ids, "answer": answer, "stats": {}}) + "\n"
                                       for name in prompts
                                       for ids, answer in zip(prompts[name], answers[name][systems[0]])))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
