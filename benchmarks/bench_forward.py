"""clover-smol's forward on a CPU per weight format: bytes read, time per block step, ratio to the bounds, and
what each format does to decoding speed and quality.

    python benchmarks/bench_forward.py [--variants float32/none,bfloat16/none,float32/fp32,float32/bf16,...]
        [--rows 1,4,8,16,32] [--context 200] [--repeats 7] [--threads 2] [--limit 4] [--max-new-tokens 64]
        [--gguf clover-smol-q4_0.gguf] [--out benchmarks/results/bench_forward.json]

A variant is `dtype/quant[/activations][/modules]`: the dtype the model is loaded in (activations, embeddings,
norms), the weight format of its linear layers (`clover.model.quant`: `none` is torch's own path; `fp32`/`bf16` the
packed kernel with unquantised weights; `int8`/`int4` group-wise weight-only quantisation; clover-smol's int8 /
int4 are its quantised builds, `clover.smol.build_quantized`: the base quantised unmerged, the adapter kept beside
it), for int8 / int4 how the kernel rounds their input (`int8`: one int8 pass, `int8x2`: two; default: the
checkpoint's own), e.g. `float32/int4/int8,float32/int4/int8x2`. Packed fp32 models run each decoder layer as one
C++ call (clover.model.fused); `/modules` runs the same weights through torch's modules layer by layer instead.

* Machine: the read bandwidth (the fastest of several sums over a 512 MiB fp32 tensor) and the fp32 FMA
  rate (a 1024^3 matmul), measured in the same run before every round of steps: a shared VM's bandwidth moves
  by tens of percent within minutes, so the bounds use the fastest of these measurements (the strictest).
* Block step: a query block of R tokens against `--context` cached tokens, batch 1 (ms, fastest of
  `--repeats` rounds in which every variant and R takes its turn: a burst of the neighbours' load, or a slow
  minute of a shared VM, hits every variant alike; all variants are loaded at once for it). `bound` is the weight
  bytes over the measured bandwidth; `x bound` the step over it. `flop floor` is 2 x R x linear-layer
  parameters over the measured FMA rate: past the R where it exceeds the bandwidth bound, no kernel can stay
  flat in rows on this machine.
* Decoding (`--limit` > 0): held-out chat, code and structured prompts and BFCL tool calls (benchmarks/bench_smol.py's
  sets), greedy, the model's default block size, threshold and rule. Per variant: tokens per forward, decoding
  tokens/s (after the first block), tool-call exact match, and agreement of the first 64 tokens with the first
  variant's output (the unquantised reference).
* `--gguf`: llama.cpp's one-token and 16-token decode of a GGUF of the same model (`clover export --to gguf
  clover-smol X.gguf --quant q4_0`) with the same thread count and context, taking its turns in the same rounds.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_smol import agreement, prompt_ids, run_mode, text_sets, tool_sets

from clover.assistant_output import parse_assistant_output
from clover.cli.loading import DTYPES
from clover.model import QUANTIZATIONS, CloverForBlockDiffusion, quantize
from clover.model.quant import packed_bytes
from clover.ops.woq import ACTIVATIONS
from clover.smol import clover_smol_dir
from clover.tokenizer import load_tokenizer
from clover.training.bfcl import tool_call_matches

RESULTS = Path(__file__).resolve().parent / "results"


def fastest(fn: Any, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def machine(repeats: int) -> dict[str, float]:
    big = torch.ones(128 * 2**20)  # 512 MiB: far past the last-level cache
    read = big.numel() * 4 / fastest(lambda: big.sum(), repeats)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    flops = 2 * 1024**3 / fastest(lambda: a @ b, repeats)
    return {"read_GBps": read / 1e9, "fp32_GFLOPs": flops / 1e9}


def weight_bytes(model: CloverForBlockDiffusion) -> tuple[int, int]:
    """(bytes, parameters) of the linear layers and the LM head: what a forward streams."""
    dense = [m.weight for m in model.modules() if type(m) is torch.nn.Linear]
    params = sum(w.numel() for w in dense) + sum(m.in_features * m.out_features for m in model.modules()
                                                  if hasattr(m, "weight_bytes"))
    return sum(w.numel() * w.element_size() for w in dense) + packed_bytes(model), params


def clover_steps(model: CloverForBlockDiffusion, rows: list[int], context: int) -> dict[int, Callable[[], Any]]:
    """Per R, a block step of R query tokens against `context` cached tokens (the cache is not advanced)."""
    gen = torch.Generator().manual_seed(0)
    tokens = lambda n: torch.randint(0, model.config.vocab_size - 1, (1, n), generator=gen)  # noqa: E731
    cache = model.new_cache(1)
    model(tokens(context), cache=cache, logits_to_keep=0)
    return {r: functools.partial(model, None, r, cache=cache, query_ids=tokens(r)) for r in rows}


def llamacpp_steps(llm: Any, context: int) -> dict[int, Callable[[], Any]]:
    """llama.cpp's decode of 1 and 16 tokens after `context` tokens, the same place every time."""
    llm.prefill(list(range(100, 100 + context)))

    def step(rows: int) -> None:
        llm.truncate(context)
        llm.decode(list(range(200, 200 + rows)), context)
    return {r: functools.partial(step, r) for r in (1, 16)}


def step_times(steps: dict[str, dict[int, Callable[[], Any]]], repeats: int,
               samples: list[dict[str, float]]) -> dict[str, dict[int, float]]:
    """ms per step, the fastest of `repeats` rounds in which every variant and row count takes its turn (the
    first round warms up); the machine is measured into `samples` before each round."""
    times = {name: {r: float("inf") for r in fns} for name, fns in steps.items()}
    for round_ in range(repeats + 1):
        if round_:
            samples.append(machine(repeats))
        for name, fns in steps.items():
            for r, fn in fns.items():
                start = time.perf_counter()
                fn()
                if round_:
                    times[name][r] = min(times[name][r], 1e3 * (time.perf_counter() - start))
    return times


def decoding(model: CloverForBlockDiffusion, tokenizer: Any, sets: dict, max_new_tokens: int,
             reference: dict[str, list[list[int]]] | None) -> tuple[dict[str, dict], dict[str, list[list[int]]]]:
    block, threshold = model.config.block_size, model.config.threshold
    report, outputs = {}, {}
    for name, chats in sets.items():
        prompts = [prompt_ids(tokenizer, chat) for chat, _ in chats]
        results = run_mode(model, prompts, block, threshold, max_new_tokens, vocab_limit=len(tokenizer))
        outputs[name] = [r[0] for r in results]
        tokens = sum(len(r[0]) for r in results)
        after_first = sum(len(r[0]) - min(block, len(r[0])) for r in results)
        decode_s = sum(r[1]["wall_time_s"] - r[1]["time_to_first_token_s"] for r in results)
        figures: dict[str, Any] = {
            "tokens_per_forward": tokens / max(sum(r[1]["forward_passes"] for r in results), 1),
            "decode_tokens_per_second": after_first / decode_s if decode_s > 0 else None}
        if reference is not None:
            figures["agree_reference"] = statistics.mean(agreement(a, b) for a, b in zip(outputs[name], reference[name]))
            figures["same_as_reference"] = sum(a == b for a, b in zip(outputs[name], reference[name]))
        if name.startswith("tools"):
            calls = [parse_assistant_output(tokenizer.decode(o, skip_special_tokens=True))[2] for o in outputs[name]]
            figures["tool_call_exact"] = sum(tool_call_matches(c, ans) for c, (_, ans) in zip(calls, chats))
        report[name] = figures
    return report, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint dir (default: clover-smol)")
    parser.add_argument("--variants", default="float32/none,bfloat16/none,float32/fp32,float32/bf16,float32/int8,"
                        "float32/int4", help="comma-separated dtype/quant[/activations]; the first is the quality "
                        "reference")
    parser.add_argument("--rows", default="1,4,8,16,32")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--limit", type=int, default=4, help="prompts per quality set (0: no decoding runs)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gguf", default=None, help="a GGUF of the same model for llama.cpp's figures")
    parser.add_argument("--out", default=str(RESULTS / "bench_forward.json"))
    args = parser.parse_args()
    variants = [tuple(v.split("/")) for v in args.variants.split(",")]
    for v in variants:
        extra = v[2:]
        activations = [x for x in extra if x != "modules"]
        if len(v) < 2 or v[0] not in DTYPES or v[1] not in QUANTIZATIONS or extra.count("modules") > 1 or len(
                activations) > 1 or (activations and (v[1] not in ("int8", "int4") or activations[0] not in ACTIVATIONS)):
            parser.error(f"a variant is dtype/quant[/activations][/modules] with dtype in {sorted(DTYPES)}, quant in "
                         f"{list(QUANTIZATIONS)} and activations (int8 / int4 only) in {list(ACTIVATIONS)}, got "
                         f"{'/'.join(v)!r}")
    rows = [int(r) for r in args.rows.split(",")]
    torch.set_num_threads(args.threads)
    def model_dir(quant: str) -> Path:  # clover-smol at int8 / int4: its quantised build, adapter kept unmerged
        return Path(args.model) if args.model else clover_smol_dir(quant)

    tokenizer = load_tokenizer(model_dir("none"))
    sets = {**text_sets(args.limit), **tool_sets(args.limit)} if args.limit else {}

    with torch.inference_mode():
        samples: list[dict[str, float]] = []  # the machine, measured before each round of steps
        report: dict[str, Any] = {"threads": args.threads, "context": args.context, "variants": {}}
        models = {}
        for dtype, quant, *extra in variants:
            activations = [x for x in extra if x != "modules"]
            model = quantize(CloverForBlockDiffusion.from_pretrained(model_dir(quant), dtype=getattr(torch, dtype)), quant,
                             activations=activations[0] if activations else None)
            for layer in model.model.layers:
                layer.fused = layer.fused and "modules" not in extra
            models["/".join([dtype, quant, *extra])] = model
        fns = {name: clover_steps(model, rows, args.context) for name, model in models.items()}
        if args.gguf:
            from clover.runners.llamacpp_ar import LlamaCppAR

            llm = LlamaCppAR(args.gguf, threads=args.threads, n_ctx=args.context + 64, n_batch=512)
            fns["llama.cpp"] = llamacpp_steps(llm, args.context)
        steps = step_times(fns, args.repeats, samples)
        del fns
        reference = None
        for name in list(models):
            model = models.pop(name)  # one at a time from here: decoding runs alone
            nbytes, params = weight_bytes(model)
            entry: dict[str, Any] = {"weight_MB": nbytes / 1e6, "params": params, "step_ms": steps[name]}
            print(f"{name:16} {nbytes / 1e6:6.0f} MB  " + "  ".join(
                f"R={r}: {t:6.1f} ms" for r, t in steps[name].items()), flush=True)
            if sets:
                entry["decoding"], outputs = decoding(model, tokenizer, sets, args.max_new_tokens, reference)
                reference = reference or outputs
                for set_name, fig in entry["decoding"].items():
                    print(f"    {set_name:18} " + "  ".join(
                        f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in fig.items()), flush=True)
            report["variants"][name] = entry
            del model
        if args.gguf:
            lc = report["llamacpp"] = {"file": Path(args.gguf).name, "bytes": Path(args.gguf).stat().st_size,
                                       **{f"ms_{r}": t for r, t in steps["llama.cpp"].items()}}
            print(f"llama.cpp {lc['file']}: {lc['bytes'] / 1e6:.0f} MB, 1 token {lc['ms_1']:.1f} ms, "
                  f"16 tokens {lc['ms_16']:.1f} ms")
        hw = {key: max(sample[key] for sample in samples) for key in samples[0]}
        report["machine"] = {**hw, "samples": samples}
        print(f"{platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__} "
              f"({torch.backends.cpu.get_cpu_capability()}): read {hw['read_GBps']:.1f} GB/s, fp32 matmul "
              f"{hw['fp32_GFLOPs']:.0f} GFLOP/s (the fastest of {len(samples)} measurements in the run: read "
              f"{min(x['read_GBps'] for x in samples):.1f}-{hw['read_GBps']:.1f} GB/s)")
        for name, entry in report["variants"].items():
            bound = entry["bound_ms"] = 1e3 * entry["weight_MB"] * 1e6 / (hw["read_GBps"] * 1e9)
            entry["x_bound"] = {r: t / bound for r, t in entry["step_ms"].items()}
            entry["flop_floor_ms"] = {r: 1e3 * 2 * r * entry["params"] / (hw["fp32_GFLOPs"] * 1e9)
                                      for r in entry["step_ms"]}
            print(f"{name:16} bound {bound:5.1f} ms  " + "  ".join(
                f"R={r}: {t:.1f}x" for r, t in entry["x_bound"].items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
