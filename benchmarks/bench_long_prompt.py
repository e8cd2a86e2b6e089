"""An agent's long first prompt: time to first token of every build of clover-smol and of llama.cpp, same run.

    python benchmarks/bench_long_prompt.py [--classes GorillaFileSystem,MessageAPI] [--new-tokens 16]
        [--threads 2] [--systems fp32,int4,clover-llamacpp,llama.cpp] [--out F]

The prompt is what an agent sends first: BFCL's tool descriptions of the given classes (bfcl-eval's
multi-turn function docs, as OpenAI tools) and the first request of the first `multi_turn_base` task that uses
all of them, in Clover's chat template (about 5 200 tokens for the file system and messaging tools). Systems,
loaded one after another, each decoding the same token ids greedily, `--new-tokens` new tokens, no prefix reuse:

  * `fp32`             clover-smol in fp32 torch at block size 1
  * `int4`             the default: the int4 build in exact mode
  * `clover-llamacpp`  Clover's engine on the llama.cpp runner (the q8_0 GGUF export), exact mode
  * `llama.cpp`        llama.cpp's own AR generation (`clover.runners.llamacpp_ar`) on the same q8_0 GGUF (n_batch 512)

Per system: time to first token (prefill and the first decision), total time, and whether the new tokens equal
`fp32`'s (other roundings may part at a near-tie).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_agent import load_tasks, openai_tools  # noqa: E402  (benchmarks/, next to this script)
from bench_exact import Decode, engine_system, llama_system  # noqa: E402
from bench_smol import prompt_ids  # noqa: E402

from clover.model import CloverForBlockDiffusion  # noqa: E402
from clover.runners.registry import RunnerOptions  # noqa: E402
from clover.runners.registry import runner_entry  # noqa: E402
from clover.smol import clover_smol_dir, clover_smol_gguf  # noqa: E402
from clover.tokenizer import eos_token_ids, load_tokenizer  # noqa: E402

SYSTEMS = ("fp32", "int4", "clover-llamacpp", "llama.cpp")


def long_prompt(classes: list[str]) -> dict[str, Any]:
    """The chat: the classes' tools and the first request of the first base task that uses all of them."""
    from bfcl_eval.constants.executable_backend_config import MULTI_TURN_FUNC_DOC_FILE_MAPPING

    from clover.training.bfcl import bfcl_data_dir

    unknown = sorted(set(classes) - set(MULTI_TURN_FUNC_DOC_FILE_MAPPING))
    if unknown:
        raise SystemExit(f"unknown classes {unknown}; choose from {sorted(MULTI_TURN_FUNC_DOC_FILE_MAPPING)}")
    task = next((t for t in load_tasks("multi_turn_base", 200) if set(classes) <= set(t.involved_classes)), None)
    if task is None:
        raise SystemExit(f"no multi_turn_base task uses all of {classes}")
    docs = [json.loads(line) for cls in classes for line in
            (bfcl_data_dir() / "multi_turn_func_doc" / MULTI_TURN_FUNC_DOC_FILE_MAPPING[cls]).read_text().splitlines()
            if line.strip()]
    return {"messages": task.turns[0].messages, "tools": openai_tools(docs), "task": task.id}


def load(system: str, tokenizer: Any, threads: int, ctx: int, eos: list[int]) -> Decode:
    """`system`'s decode: (prompt ids, new tokens) -> (new ids, stats with `time_to_first_token_s`)."""
    if system == "llama.cpp":
        return llama_system("q8_0", threads, eos, n_ctx=ctx)
    if system == "clover-llamacpp":
        gguf = clover_smol_gguf("q8_0")
        runner = runner_entry("llamacpp").load().open(gguf, RunnerOptions(threads=threads, ctx=ctx))
        return engine_system(runner, tokenizer, rule="exact")[0]
    quant = "none" if system == "fp32" else "int4"
    options: dict[str, Any] = {"block_size": 1, "rule": "threshold"} if system == "fp32" else {}
    return engine_system(CloverForBlockDiffusion.from_pretrained(clover_smol_dir(quant)), tokenizer, **options)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--classes", default="GorillaFileSystem,MessageAPI", help="BFCL back-end classes")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    systems = args.systems.split(",")
    if unknown := sorted(set(systems) - set(SYSTEMS)):
        parser.error(f"unknown systems {unknown}")
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(clover_smol_dir())
    chat = long_prompt(args.classes.split(","))
    ids = prompt_ids(tokenizer, chat)
    ctx = len(ids) + args.new_tokens + 64
    eos = eos_token_ids(CloverForBlockDiffusion.from_pretrained(clover_smol_dir(), device="meta").config, tokenizer)
    print(f"machine: {platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__};"
          f" prompt of {len(ids)} tokens ({args.classes}, task {chat['task']}), {args.new_tokens} new tokens")
    report: dict[str, Any] = {"prompt_tokens": len(ids), "classes": args.classes, "systems": {}}
    reference = None
    for system in systems:
        decode = load(system, tokenizer, args.threads, ctx, eos)
        decode(ids[:32], 2)  # kernels built, caches sized: not timed
        start = time.perf_counter()
        out, stats = decode(ids, args.new_tokens)
        total, ttft = time.perf_counter() - start, stats["time_to_first_token_s"]
        reference = out if system == "fp32" else reference
        same = "" if reference is None or system == "fp32" else ("same tokens as fp32" if out == reference
                                                                   else "other tokens than fp32")
        report["systems"][system] = {"ttft_s": ttft, "total_s": total, "tokens": len(out), "same_as_fp32": same}
        print(f"{system:16} time to first token {ttft:7.2f} s   total {total:7.2f} s   {same}", flush=True)
        del decode
    if "fp32" in report["systems"]:
        base = report["systems"]["fp32"]["ttft_s"]
        for figures in report["systems"].values():
            figures["ttft_vs_fp32"] = figures["ttft_s"] / base
        print("time to first token against fp32: " + ", ".join(
            f"{s} {f['ttft_vs_fp32']:.2f}x" for s, f in report["systems"].items()))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
