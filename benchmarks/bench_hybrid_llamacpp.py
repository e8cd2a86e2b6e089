"""A mid-size random hybrid MoE twin (>= 1 B parameters) on llama.cpp (q4_0 / q4_k export) against Clover's torch
runner: tokens/s and peak memory at block size 1, the cost of exact mode's rewind, and a projection of the 35B
preset's memory and tokens/s on a CPU with 32 / 64 GB from the bytes read per token.

    python benchmarks/bench_hybrid_llamacpp.py --threads 2 --quants q4_0,q4_k --max-new-tokens 32

The twin (`TWIN`: Qwen3.5-MoE's block pattern, 20 layers, 32 experts of which 4 routed plus a shared one, clover-smol's
tokenizer) is built once under `--work` with random weights and exported at each quantisation. Each system runs in
its own subprocess (its peak RSS is its own: `VmHWM`), after an untimed warm-up, on the same random prompts
(greedy, block size 1). Bytes read per token are the GGUF's: every non-expert tensor (one row of the token
embedding), the routed experts times top-k / experts. The projection divides the 35B preset's bytes per token
(the same export rules applied to its shapes) by the bandwidth the twin achieved (its bytes per token times its
tokens/s): a projection, not a measurement; it assumes the 35B model streams its weights as the twin did.
Results: `benchmarks/results/bench_hybrid_llamacpp.{json,md}`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TWIN = dict(hidden_size=1024, num_hidden_layers=20, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
            linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16,
            num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512, shared_expert_intermediate_size=512,
            max_position_embeddings=4096)
RESULTS = Path(__file__).parent / "results"


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def build_twin(work: Path) -> Path:
    import torch

    from clover import CloverConfig, CloverForBlockDiffusion
    from clover.cli.loading import resolve_model_dir
    from clover.config import _hybrid_layer_types

    out = work / "twin"
    if (out / "config.json").is_file():
        return out
    smol = resolve_model_dir(None)  # clover-smol: its tokenizer (with the mask token)
    smol_config = CloverConfig.from_file(smol)
    config = CloverConfig.from_preset("clover-hybrid-small", **TWIN, layer_types=_hybrid_layer_types(20),
                                      vocab_size=smol_config.vocab_size, mask_token_id=smol_config.mask_token_id,
                                      eos_token_id=smol_config.eos_token_id)
    torch.manual_seed(0)
    model = CloverForBlockDiffusion(config).eval()
    model.save_pretrained(out, tokenizer_dir=smol)
    return out


def worker(kind: str, path: str, job: dict) -> dict:
    import torch

    from clover.engine import generate

    torch.set_num_threads(job["threads"])
    if kind == "torch":
        from clover import CloverForBlockDiffusion

        model: Any = CloverForBlockDiffusion.from_pretrained(path).eval()
    else:
        from clover.runners.llamacpp_hybrid import HybridLlamaCppRunner

        model = HybridLlamaCppRunner(path, threads=job["threads"], max_rows=1)
    prompts = job["prompts"]
    # block size 1 with the threshold rule: one-token causal decoding on both (the hybrid runner's default rule is
    # exact mode, whose cost calibration this figure leaves out)
    generate(model, prompts[:1], max_new_tokens=4, block_size=1, rule="threshold")  # warm-up, untimed
    tokens, seconds, sequences = 0, 0.0, []
    for prompt in prompts:
        start = time.perf_counter()
        out = generate(model, [prompt], max_new_tokens=job["max_new_tokens"], block_size=1, rule="threshold")
        seconds += time.perf_counter() - start
        tokens += len(out.sequences[0])
        sequences.append(out.sequences[0])
    result = {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "peak_rss_mib": peak_rss_mib(),
              "sequences": sequences}
    if kind != "torch":
        result["rewind"] = rewind_cost(model, prompts[0])
    return result


def rewind_cost(runner: Any, prompt: list[int], repeats: int = 5) -> dict[str, float]:
    """ms of exact mode's verification forward of 1 + 4 tokens with its rewind keeping all 5, 2 (3 drafts
    rejected) and 1 (the first rejected); and of a one-token forward (a step with nothing to verify: no mark)."""
    import torch

    cache = runner.new_cache(1)
    runner.forward(torch.tensor([prompt]), 1, cache=cache, prefix_len=len(prompt), logits_to_keep=0)
    five = torch.tensor([[11, 12, 13, 14, 15]])
    at = torch.ones(1, 5, dtype=torch.bool)
    best: dict[str, float] = {}

    def timed(name: str, fn: Any) -> None:
        took = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            took.append(time.perf_counter() - start)
        best[name] = round(1000 * min(took), 2)

    def verify(keep: int) -> None:  # the context grows by `keep` tokens a call: a few, against the prompt's
        cache.mark()
        runner.forward(five, 1, cache=cache, prefix_len=5, logits_at=at)
        cache.rewind(torch.tensor([keep]))

    one = torch.tensor([[7]])
    at1 = torch.ones(1, 1, dtype=torch.bool)
    timed("one_token_forward_ms", lambda: runner.forward(one, 1, cache=cache, prefix_len=1, logits_at=at1))
    timed("verify_5_keep_5_ms", lambda: verify(5))
    timed("verify_5_keep_2_ms", lambda: verify(2))
    timed("verify_5_keep_1_ms", lambda: verify(1))
    cache.release()
    best["keep_2_over_keep_5"] = round(best["verify_5_keep_2_ms"] / best["verify_5_keep_5_ms"], 3)
    return best


def rewind_worker(path: str, job: dict) -> dict:
    """The rewind's cost on one GGUF, through llama.cpp's rollback snapshots and through backup and re-decode (a
    runner made with rollback=0), alternating (`rounds`) so that both see the same machine; and block size 1's
    tokens/s on each context (the snapshots are written at every decode)."""
    import torch

    from clover.engine import generate
    from clover.runners.llamacpp_hybrid import ROLLBACK, HybridLlamaCppRunner

    torch.set_num_threads(job["threads"])
    prompts = job["prompts"]
    runners = {"rollback": HybridLlamaCppRunner(path, threads=job["threads"], max_rows=1, rollback=ROLLBACK),
               "backup": HybridLlamaCppRunner(path, threads=job["threads"], max_rows=1, rollback=0)}
    assert runners["rollback"].rollback == ROLLBACK and runners["backup"].rollback == 0
    out: dict[str, Any] = {name: {"rewind": [], "tok_s": []} for name in runners}
    for name, runner in runners.items():  # warm-up, untimed
        generate(runner, prompts[:1], max_new_tokens=4, block_size=1, rule="threshold")
    for _ in range(job["rounds"]):
        for name, runner in runners.items():
            out[name]["rewind"].append(rewind_cost(runner, prompts[0]))
            start = time.perf_counter()
            result = generate(runner, prompts[:1], max_new_tokens=job["max_new_tokens"], block_size=1,
                              rule="threshold")
            out[name]["tok_s"].append(round(len(result.sequences[0]) / (time.perf_counter() - start), 2))
            out[name]["sequence"] = result.sequences[0]
    out["same_tokens"] = out["rollback"].pop("sequence") == out["backup"].pop("sequence")
    return out


def bytes_per_token(names_bytes: list[tuple[str, int, int]], top_k: int, experts: int) -> dict[str, float]:
    """(name, bytes, rows of the first dim) -> bytes read per decoded token, and the file's total."""
    total = sum(b for _, b, _ in names_bytes)
    read = 0.0
    for name, size, rows in names_bytes:
        if name == "token_embd.weight":
            read += size / rows  # one row
        elif "_exps." in name:
            read += size * top_k / experts
        else:
            read += size
    return {"file_bytes": total, "bytes_per_token": read}


def gguf_bytes(path: Path) -> list[tuple[str, int, int]]:
    import gguf

    return [(t.name, int(t.n_bytes), int(t.shape[-1])) for t in gguf.GGUFReader(str(path)).tensors]


def preset_bytes(preset: str, quant: str) -> list[tuple[str, int, int]]:
    """The tensors `clover export --quant` would write for a preset's shapes, without any weights (meta device)."""
    import gguf
    import torch

    from clover import CloverConfig, CloverForBlockDiffusion
    from clover.conversion.gguf_export import _ggml_type
    from clover.conversion.gguf_hybrid import hybrid_tensors

    config = CloverConfig.from_preset(preset)
    with torch.device("meta"):
        model = CloverForBlockDiffusion(config)
    out = []
    for name, tensor in hybrid_tensors(model.state_dict(), config):
        block, size = gguf.GGML_QUANT_SIZES[_ggml_type(quant, name, tensor)]
        out.append((name, tensor.numel() // block * size, int(tensor.shape[0]) if tensor.dim() else 1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "clover" / "bench_hybrid_llamacpp")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quants", default="q4_0,q4_k")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_hybrid_llamacpp")
    parser.add_argument("--rewind-only", action="store_true",
                        help="only exact mode's rewind on llama.cpp, rollback snapshots against backup and re-decode "
                             "(results: <out>_rewind.{json,md})")
    parser.add_argument("--rounds", type=int, default=3, help="--rewind-only: alternating rounds of both")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, path, job_path = args.worker
        job = json.loads(Path(job_path).read_text())
        result = rewind_worker(path, job) if kind == "rewind" else worker(kind, path, job)
        Path(job["result"]).write_text(json.dumps(result))
        return

    import random

    from clover import CloverConfig
    from clover.conversion.gguf_export import export_gguf
    from clover.runners.llama_api import quantize_rows

    args.work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    twin = build_twin(args.work)
    config = CloverConfig.from_file(twin)
    rng = random.Random(0)
    prompts = [[rng.randrange(config.vocab_size - 1) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    systems: dict[str, dict[str, Any]] = {}
    exports = {}
    for quant in args.quants.split(","):
        path = args.work / f"twin.{quant}.gguf"
        if not path.is_file():
            start = time.perf_counter()
            export_gguf(twin, path, quant, kquant=quantize_rows)
            exports[quant] = round(time.perf_counter() - start, 1)
        systems[f"llama.cpp/{quant}"] = {"path": str(path), "kind": "llamacpp"}
    if args.rewind_only:
        rewind_only(args, systems, prompts, started)
        return
    systems["clover-torch/fp32"] = {"path": str(twin), "kind": "torch"}
    for name, system in systems.items():
        job = {"threads": args.threads, "prompts": prompts, "max_new_tokens": args.max_new_tokens,
               "result": str(args.work / f"{name.replace('/', '_')}.json")}
        job_path = args.work / "job.json"
        job_path.write_text(json.dumps(job))
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        proc = subprocess.run([sys.executable, __file__, "--worker", system["kind"], system["path"], str(job_path)],
                              env=env, capture_output=True, text=True)
        if proc.returncode:
            system["error"] = proc.stderr[-2000:]
            continue
        system.update(json.loads(Path(job["result"]).read_text()))
        print(f"{name}: {system['tok_s']:.2f} tok/s, peak RSS {system['peak_rss_mib']:.0f} MiB", flush=True)

    reference = systems["clover-torch/fp32"].get("sequences")
    for name, system in systems.items():
        if name.startswith("llama.cpp") and "sequences" in system:
            size = bytes_per_token(gguf_bytes(Path(system["path"])), config.num_experts_per_tok, config.num_experts)
            system.update(size)
            system["bandwidth_gb_s"] = size["bytes_per_token"] * system["tok_s"] / 1e9
            if reference:
                system["first_tokens_equal_torch"] = [
                    next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
                    for x, y in zip(system["sequences"], reference)]
            big = CloverConfig.from_preset("clover-35b-a3b")
            quant = name.split("/")[1]
            projected = bytes_per_token(preset_bytes("clover-35b-a3b", quant), big.num_experts_per_tok,
                                        big.num_experts)
            system["projection_35b"] = {
                "file_gib": projected["file_bytes"] / 2**30,
                "bytes_per_token_gib": projected["bytes_per_token"] / 2**30,
                "tok_s_at_twin_bandwidth": system["bandwidth_gb_s"] * 1e9 / projected["bytes_per_token"],
                "fits_32_gb": projected["file_bytes"] < 32e9 * 0.85, "fits_64_gb": projected["file_bytes"] < 64e9 * 0.85}
    for system in systems.values():
        system.pop("sequences", None)
    machine = {"cpu": next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                            if line.startswith("model name")), ""), "cores": os.cpu_count(),
               "load_average_at_start": os.getloadavg(), "threads": args.threads}
    report = {"command": " ".join(sys.argv), "machine": machine, "twin": TWIN,
              "twin_parameters": _parameters(config), "exports_s": exports, "systems": systems,
              "minutes": round((time.time() - started) / 60, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    args.out.with_suffix(".md").write_text(_markdown(report))
    print(_markdown(report))


def rewind_only(args: argparse.Namespace, systems: dict[str, dict[str, Any]], prompts: list[list[int]],
                started: float) -> None:
    """`--rewind-only`: each export's rewind costs both ways (`rewind_worker`), the median round reported."""
    import statistics

    for name, system in systems.items():
        job = {"threads": args.threads, "prompts": prompts, "max_new_tokens": args.max_new_tokens,
               "rounds": args.rounds, "result": str(args.work / f"{name.replace('/', '_')}_rewind.json")}
        job_path = args.work / "job.json"
        job_path.write_text(json.dumps(job))
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        proc = subprocess.run([sys.executable, __file__, "--worker", "rewind", system["path"], str(job_path)],
                              env=env, capture_output=True, text=True)
        if proc.returncode:
            system["error"] = proc.stderr[-2000:]
            continue
        system.update(json.loads(Path(job["result"]).read_text()))
        for mode in ("rollback", "backup"):
            rounds = system[mode]["rewind"]
            system[mode]["median"] = {k: round(statistics.median(r[k] for r in rounds), 3) for k in rounds[0]}
            system[mode]["tok_s_median"] = statistics.median(system[mode]["tok_s"])
    machine = {"cpu": next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                            if line.startswith("model name")), ""), "cores": os.cpu_count(),
               "load_average_at_start": os.getloadavg(), "threads": args.threads}
    report = {"command": " ".join(sys.argv), "machine": machine, "twin": TWIN, "systems": systems,
              "minutes": round((time.time() - started) / 60, 1)}
    m = machine
    lines = [f"Machine: {m['cpu']} ({m['cores']} cores), {m['threads']} threads, load average at start "
             f"{m['load_average_at_start'][0]:.1f}. Exact mode's verification on llama.cpp, ms (best of 5, median of "
             f"{args.rounds} alternating rounds): rollback = llama.cpp's recurrent snapshots (n_rs_seq), backup = "
             "backup copy and re-decode of the kept tokens.", "",
             "| export | rewind | 1 token | verify 5, keep 5 | keep 2 | keep 1 | keep 2 / keep 5 | block size 1 tok/s |",
             "|---|---|---|---|---|---|---|---|"]
    for name, s in systems.items():
        if "error" in s:
            lines.append(f"| {name} | failed | | | | | | |")
            continue
        for mode in ("rollback", "backup"):
            r = s[mode]["median"]
            lines.append(f"| {name} | {mode} | {r['one_token_forward_ms']} | {r['verify_5_keep_5_ms']} | "
                         f"{r['verify_5_keep_2_ms']} | {r['verify_5_keep_1_ms']} | {r['keep_2_over_keep_5']} | "
                         f"{s[mode]['tok_s_median']} |")
        lines.append(f"\nBlock size 1's tokens equal on both contexts: {s['same_tokens']}.")
    out = args.out.with_name(args.out.name + "_rewind")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _parameters(config: Any) -> dict[str, int]:
    import torch

    from clover import CloverForBlockDiffusion

    with torch.device("meta"):
        model = CloverForBlockDiffusion(config)
    return {"total": model.num_parameters(), "active_per_token": model.num_active_parameters()}


def _markdown(report: dict) -> str:
    m = report["machine"]
    lines = [f"Machine: {m['cpu']} ({m['cores']} cores), {m['threads']} threads, load average at start "
             f"{m['load_average_at_start'][0]:.1f}. Twin: {report['twin_parameters']['total'] / 1e9:.2f} B parameters "
             f"({report['twin_parameters']['active_per_token'] / 1e6:.0f} M active per token). Greedy, block size 1.",
             "", "| system | tok/s | peak RSS MiB | file GiB | bytes read / token MiB | GB/s |",
             "|---|---|---|---|---|---|"]
    for name, s in report["systems"].items():
        if "error" in s:
            lines.append(f"| {name} | failed | | | | |")
            continue
        file_gib = f"{s['file_bytes'] / 2**30:.2f}" if "file_bytes" in s else ""
        per_token = f"{s['bytes_per_token'] / 2**20:.0f}" if "bytes_per_token" in s else ""
        bandwidth = f"{s['bandwidth_gb_s']:.1f}" if "bandwidth_gb_s" in s else ""
        lines.append(f"| {name} | {s['tok_s']:.2f} | {s['peak_rss_mib']:.0f} | {file_gib} | {per_token} | {bandwidth} |")
    lines += ["", "Exact mode's verification on llama.cpp (ms, best of 5; the runner's default rewind, llama.cpp's "
              "rollback snapshots): one-token forward; 1 + 4 tokens verified with all kept, 2 kept, 1 kept.", "",
              "| system | 1 token | verify 5, keep 5 | keep 2 | keep 1 |", "|---|---|---|---|---|"]
    for name, s in report["systems"].items():
        if "rewind" in s:
            r = s["rewind"]
            lines.append(f"| {name} | {r['one_token_forward_ms']} | {r['verify_5_keep_5_ms']} | "
                         f"{r['verify_5_keep_2_ms']} | {r['verify_5_keep_1_ms']} |")
    lines += ["", "Projection (not measured) of the 35B preset (clover-35b-a3b) at the twin's measured bandwidth:", "",
              "| export | file GiB | read / token GiB | projected tok/s | fits 32 GB | fits 64 GB |",
              "|---|---|---|---|---|---|"]
    for name, s in report["systems"].items():
        if "projection_35b" in s:
            p = s["projection_35b"]
            lines.append(f"| {name} | {p['file_gib']:.1f} | {p['bytes_per_token_gib']:.2f} | "
                         f"{p['tok_s_at_twin_bandwidth']:.1f} | {p['fits_32_gb']} | {p['fits_64_gb']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
