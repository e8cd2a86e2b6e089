"""The hybrid DeltaNet MoE's shape at speed: a random 1.28 B twin (354 M active per token) on Clover's torch runner
(fp32 and int4) beside Clover's llama.cpp runner (q4_0), same run, and exact mode's mechanics on it.

    python benchmarks/bench_hybrid.py --threads 2 [--work DIR] [--experts-scale 1] [--prompts 3]
        [--max-new-tokens 96] [--init scaled] [--systems clover/fp32,clover/int4,llama.cpp/q4_0]
        [--exact clover/fp32,clover/int4,llama.cpp/q4_0] [--acceptance 0.9,0.7,0.5,0]
        [--threshold 16:0.9,4:1e-9,16:1e-9]

The twin (`TWIN`: Qwen3.5-MoE's block pattern, 20 layers, 32 experts of which 4 routed plus a shared one, clover-smol's
tokenizer; `--experts-scale 4`: 128 experts, the rest alike, drawn straight into int4 (`draw_int4`: its fp32 form,
17 GB, is never whole in memory), so run with `--systems clover/int4`) is built once under `--work` with random weights
(`--init scaled`, the default: drawn as trained transformers start, `scale_residual_outputs`; `--init random`: every
weight N(0, 0.02)),
quantised once to int4 (`clover.quantize`, saved: the runner loads packed weights, as `clover generate --model
TWIN-int4` does) and exported once to q4_0. Each system runs in its own subprocess (its peak RSS, `VmHWM`, is its
own), after an untimed warm-up, on the same random prompts, greedy:

* block size 1 (the threshold rule at block size 1: one token per forward): tok/s;
* Clover's runner only (the systems in `--exact`): the cost of a verifying step of k rows against one, k = 1..6,
  beside the experts those rows route to and the bytes a forward then reads, and the ceiling of exact mode those
  costs leave (`rows_cost`); then exact mode (`rule="exact"`, block size 16) with drafts taken from the system's own
  block-size-1 answer, each drafted token replaced by another at rate `1 - p` (`p` in `--acceptance`): the runner
  drafts nothing itself (`causal_only`, as a random model's query block would draft noise), each forward verifies
  the drafts its cost table says pay (clover.engine.drafts.cost, measured again in this run on this twin: a kept table
  may have been measured in a busy moment; the cost of k rows against one is reported), and its tokens must equal
  block size 1's at every `p`. tok/s, tokens per forward, and the speedup over block size 1
  timed again beside it, prompt by prompt (a shared machine's slow moments then fall on both), whole requests and
  after the first token (the prefill, the same in both, left out);
* Clover's runner only (the systems in `--exact`): the threshold rule, Clover's own block decoding (the llama.cpp
  runner's DeltaNet is causal: block rules run on Clover's runner alone), at each `BLOCK:THRESHOLD` of
  `--threshold`, timed beside block size 1 prompt by prompt as exact mode is: tok/s and tokens per forward. A random
  twin's confidences are near-flat, so at the default threshold (0.9) a block forward commits one token, what a
  block forward costs where the model is unsure; at a threshold below every confidence (1e-9) it commits the whole
  block, the most a block forward of that size can give on this shape (its tokens are then not block size 1's);
* the llama.cpp runner (when in `--exact`): exact mode with the same oracle drafts, sized by its cost table and at
  fixed counts, each answer timed beside block size 1's on the same prompt (`llamacpp_exact`);
* accuracy: the int4 twin's logits against the fp32 twin's on the fp32 twin's greedy answers (teacher-forced):
  top-1 agreement and KL(fp32 || int4), and at the positions where their argmaxes part fp32's margin (top-1 minus
  top-2 logit) against its median over all positions (`parting_margins`: partings at near ties only, or not); and
  where int4's own greedy answer parts from fp32's, fp32's margin there (its top logit minus its logit of int4's
  token);
* a packed twin's block-size-1 tok/s projected onto the 35B-A3B preset's shape (`projection`: the bytes a token
  reads, measured on the twin's tensors, at the bytes/s the twin reached).

Results: `benchmarks/results/bench_hybrid.json` (`--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TWIN = dict(hidden_size=1024, num_hidden_layers=20, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
            linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16,
            num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512, shared_expert_intermediate_size=512,
            max_position_embeddings=4096)
RESULTS = Path(__file__).parent / "results"
EXACT_BLOCK = 16


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def scale_residual_outputs(model: Any) -> None:
    """The initialisation trained transformers start from (GPT-2, Megatron): every weight N(0, 0.02), and the
    projections that write into the residual stream (attention's `o_proj`, DeltaNet's `out_proj`, the experts' and the
    shared expert's `down_proj`) N(0, 0.02 / sqrt(2 L)), so that the `2 L` branches together add to the stream about
    what one branch adds at N(0, 0.02). (On this twin the embedding, N(0, 0.02) too, is no larger than one branch's
    output, so the stream still changes layer by layer: docs/cpu.md, "Hybrid models".)"""
    import torch

    std = model.config.initializer_range / (2 * model.config.num_hidden_layers) ** 0.5
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")):
                param.normal_(std=std)


def build(work: Path, experts_scale: int, init: str = "scaled") -> dict[str, Path]:
    """The twin (fp32; `init`: "scaled" (`scale_residual_outputs`) or "random", every weight N(0, 0.02)), its int4
    checkpoint and its q4_0 GGUF under `work`, each built once."""
    import torch

    from clover import CloverForBlockDiffusion
    from clover.cli.loading import resolve_model_dir
    from clover.conversion.gguf_export import export_gguf
    from clover.model.quant import quantize
    from clover.runners.llama_api import quantize_rows

    paths = {"fp32": work / "twin", "int4": work / "twin-int4", "q4_0": work / "twin.q4_0.gguf"}
    smol = resolve_model_dir(None)  # clover-smol: its tokenizer (with the mask token)
    if experts_scale > 1:  # its fp32 form does not fit beside other work (17 GB at 4x): drawn straight into int4
        if not (paths["int4"] / "config.json").is_file():
            model = draw_int4(_twin_config(smol, experts_scale), init)
            model.save_pretrained(paths["int4"], tokenizer_dir=smol)
            (work / "init").write_text(init + "\n")
        return {"int4": paths["int4"]}
    marker = work / "init"  # how the twin under `work` was drawn: a twin drawn otherwise is not reused
    if (paths["fp32"] / "config.json").is_file():
        built = marker.read_text().strip() if marker.is_file() else "random"  # twins built before `--init` were
        if built != init:
            raise SystemExit(f"{work} holds a twin drawn with --init {built}, not {init}: pass --init {built} or "
                             "another --work")
    else:
        torch.manual_seed(0)
        model = CloverForBlockDiffusion(_twin_config(smol, experts_scale)).eval()
        if init == "scaled":
            scale_residual_outputs(model)
        model.save_pretrained(paths["fp32"], tokenizer_dir=smol)
        del model
        marker.write_text(init + "\n")
    if not (paths["int4"] / "config.json").is_file():
        model = quantize(CloverForBlockDiffusion.from_pretrained(paths["fp32"]).eval(), "int4")
        model.save_pretrained(paths["int4"], tokenizer_dir=paths["fp32"])
        del model
    if not paths["q4_0"].is_file():
        export_gguf(paths["fp32"], paths["q4_0"], "q4_0", kquant=quantize_rows)
    return paths


def _twin_config(smol: Path, experts_scale: int) -> Any:
    from clover import CloverConfig
    from clover.config import _hybrid_layer_types

    smol_config = CloverConfig.from_file(smol)
    shape = {**TWIN, "num_experts": TWIN["num_experts"] * experts_scale}
    return CloverConfig.from_preset("clover-hybrid-small", **shape, layer_types=_hybrid_layer_types(20),
                                    vocab_size=smol_config.vocab_size, mask_token_id=smol_config.mask_token_id,
                                    eos_token_id=smol_config.eos_token_id)


def draw_int4(config: Any, init: str) -> Any:
    """The twin drawn as `build` draws it, packed to int4 without its fp32 form ever whole in memory: the routed
    experts are left on the meta device while the model is drawn, then each MoE layer's are drawn, packed and freed
    in turn (the same distributions; other draws than the fp32 twin's), the rest quantised as `quantize` does."""
    from types import SimpleNamespace
    from unittest import mock

    import torch
    from torch import nn

    from clover import CloverForBlockDiffusion
    from clover.model.moe import Experts, SparseMoE
    from clover.model.quant import PackedExperts, default_activations, quantize

    def on_meta(self: Experts, cfg: Any) -> None:
        nn.Module.__init__(self)
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h, device="meta"))
        self.down_proj = nn.Parameter(torch.empty(e, h, i, device="meta"))

    torch.manual_seed(0)
    with mock.patch.object(Experts, "__init__", on_meta):
        model = CloverForBlockDiffusion(config).eval()
    if init == "scaled":
        scale_residual_outputs(model)
    std = config.initializer_range
    down_std = std / (2 * config.num_hidden_layers) ** 0.5 if init == "scaled" else std
    e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
    for name, module in model.named_modules():
        if isinstance(module, SparseMoE):
            drawn = SimpleNamespace(gate_up_proj=torch.empty(e, 2 * i, h).normal_(std=std),
                                    down_proj=torch.empty(e, h, i).normal_(std=down_std))
            module.experts = PackedExperts.from_experts(drawn, "int4", name=f"{name}.experts",
                                                        activations=default_activations("int4"))
            del drawn
    return quantize(model, "int4")


def oracle_drafts(references: dict[tuple[int, ...], list[int]], p: float) -> Any:
    """A stand-in for exact mode's copied drafts (`clover.engine.loops.exact.copied_drafts`): the reference answer's
    next tokens after the request's context, each replaced by another token with probability `1 - p` (drawn from a
    generator keyed by the position, so every run drafts the same). The drafted answers are drawn once, here: a
    call only slices one, so the stand-in adds next to nothing to the step it times (drawing 15 tokens a call cost
    ~0.2 ms a step, ~0.5 % of the twin's block-size-1 token, in exact mode's time and not in block size 1's)."""
    drafted = {}
    for prompt, answer in references.items():
        row = []
        for i, token in enumerate(answer):
            rng = random.Random(hash((prompt[:4], i, p)))
            row.append(token if rng.random() < p else (token + 1 + rng.randrange(1000)) % 49152)
        drafted[prompt] = row

    def drafts(index: Any, memory: Any, most: int) -> tuple[list[int], None, int]:
        context = index.tokens
        for prompt, answer in drafted.items():
            if len(context) >= len(prompt) and tuple(context[: len(prompt)]) == prompt:
                done = len(context) - len(prompt)
                return answer[done : done + most], None, 0  # no memory draft; no context match (the shallowest
                # depth's estimate)
        return [], None, 0

    return drafts


@contextmanager
def oracle_drafting(references: dict[tuple[int, ...], list[int]], p: float, most: int | None = None) -> Iterator[None]:
    """Exact mode's copied drafts are `oracle_drafts(references, p)` (at most `most` a forward, when given) inside
    the `with` block, exact mode's own again after it."""
    from clover.engine.loops import exact

    oracle = oracle_drafts(references, p)
    original = exact.copied_drafts
    exact.copied_drafts = oracle if most is None else lambda index, memory, n: oracle(index, memory, min(n, most))
    try:
        yield
    finally:
        exact.copied_drafts = original


def worker(kind: str, path: str, job: dict) -> dict:
    import torch

    from clover.engine import generate

    torch.set_num_threads(job["threads"])
    if kind == "clover":
        from clover import CloverForBlockDiffusion
        from clover.engine.runner import as_runner

        model: Any = as_runner(CloverForBlockDiffusion.from_pretrained(path).eval())
    else:
        from clover.runners.llamacpp_hybrid import HybridLlamaCppRunner

        model = HybridLlamaCppRunner(path, threads=job["threads"], max_rows=1)
    prompts = job["prompts"]
    generate(model, prompts[:1], max_new_tokens=4, block_size=1, rule="threshold")  # warm-up, untimed
    tokens, seconds, sequences = 0, 0.0, []
    for prompt in prompts:
        start = time.perf_counter()
        out = generate(model, [prompt], max_new_tokens=job["max_new_tokens"], block_size=1, rule="threshold")
        seconds += time.perf_counter() - start
        tokens += len(out.sequences[0])
        sequences.append(out.sequences[0])
    result: dict[str, Any] = {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
                              "sequences": sequences}
    if kind != "clover" and job["exact"]:
        result.update(llamacpp_exact(model, prompts, sequences, job))
    if kind == "clover" and getattr(model.model, "quantization", None):
        result["projection_35b"] = projection(model.model, result["tok_s"])
    if kind == "clover" and job["exact"]:
        result["rows_cost"] = rows_cost(model)
        result["threshold"] = threshold_rule(model, prompts, job)  # before exact mode, which runs the causal path only
        result.update(exact_mode(model, prompts, sequences, job))
        # fp32 reads its own answers; int4 reads fp32's
        result["teacher_forced"] = teacher_forced(model, prompts, job.get("reference_sequences") or sequences,
                                                  job["logits_out"])
    result["peak_rss_mib"] = peak_rss_mib()
    return result


def exact_mode(runner: Any, prompts: list[list[int]], sequences: list[list[int]], job: dict) -> dict:
    """Exact mode with oracle drafts at each acceptance `p` (module docstring), and the runner's cost table."""
    from clover.engine import generate
    from clover.engine.drafts.cost import cost_table

    runner.causal_only = True  # drafts come from `oracle_drafts` alone
    table = cost_table(runner, recalibrate=True)  # measured in this run (a kept table may be a busy moment's)
    out: dict[str, Any] = {"cost_ms": {r: round(1000 * s, 2) for r, s in zip(table.rows, table.seconds)},
                           "exact": {}}
    references = {tuple(p): s for p, s in zip(prompts, sequences)}
    for p in job["acceptance"]:
        with oracle_drafting(references, p):
            generate(runner, prompts[:1], max_new_tokens=4, block_size=EXACT_BLOCK, rule="exact")  # warm-up
            tokens, forwards, equal = 0, 0, True
            seconds = {"other": 0.0, "block1": 0.0}  # whole requests: exact mode's, block size 1's
            decode = {"other": 0.0, "block1": 0.0}  # after the first token (the same prefill in both)
            for i, (prompt, reference) in enumerate(zip(prompts, sequences)):
                for name, (res, took) in timed_beside(runner, prompt, i, job["max_new_tokens"], block_size=EXACT_BLOCK,
                                                      rule="exact").items():
                    seconds[name] += took
                    decode[name] += took - res.stats[0]["time_to_first_token_s"]
                    if name == "other":
                        tokens += len(res.sequences[0])
                        forwards += res.stats[0]["forward_passes"]
                        equal &= res.sequences[0] == reference
            out["exact"][str(p)] = {"tok_s": tokens / seconds["other"], "tokens": tokens, "forwards": forwards,
                                    "tokens_per_forward": tokens / max(forwards, 1), "equal_to_block_size_1": equal,
                                    "block_size_1_tok_s_beside": tokens / seconds["block1"],
                                    "speedup": seconds["block1"] / seconds["other"],
                                    "decode_speedup": decode["block1"] / decode["other"]}
    return out


def threshold_rule(runner: Any, prompts: list[list[int]], job: dict) -> dict[str, Any]:
    """The threshold rule at each `(block size, threshold)` of `job["threshold"]` (module docstring), each request
    timed beside block size 1's on the same prompt, which runs first alternating by prompt."""
    from clover.engine import generate

    out: dict[str, Any] = {}
    for block_size, threshold in job["threshold"]:
        generate(runner, prompts[:1], max_new_tokens=4, block_size=block_size, threshold=threshold,
                 rule="threshold")  # warm-up
        tokens, forwards, seconds = 0, 0, {"other": 0.0, "block1": 0.0}
        for i, prompt in enumerate(prompts):
            for name, (res, took) in timed_beside(runner, prompt, i, job["max_new_tokens"], block_size=block_size,
                                                  threshold=threshold, rule="threshold").items():
                seconds[name] += took
                if name == "other":
                    tokens += len(res.sequences[0])
                    forwards += res.stats[0]["forward_passes"]
        out[f"{block_size}:{threshold:g}"] = {
            "block_size": block_size, "threshold": threshold, "tok_s": tokens / seconds["other"], "tokens": tokens,
            "forwards": forwards, "tokens_per_forward": tokens / max(forwards, 1),
            "block_size_1_tok_s_beside": tokens / seconds["block1"], "speedup": seconds["block1"] / seconds["other"]}
    return out


def timed_beside(runner: Any, prompt: list[int], i: int, max_new_tokens: int,
                 announce: Callable[[str | None], None] | None = None,
                 **options: Any) -> dict[str, tuple[Any, float]]:
    """`prompt` decoded at block size 1 (`"block1"`) and with `options` (`"other"`), each with its seconds: block
    size 1 timed again beside every run it is compared with, so a shared machine's slow moments fall on both, and
    which runs first alternating with the prompt's index `i`, so an effect of the order falls on both too.
    `announce`: told each request's name as it starts, and None after the last (to count work by system)."""
    from clover.engine import generate

    order = [("block1", {"block_size": 1, "rule": "threshold"}), ("other", options)]
    out = {}
    for name, kwargs in order if i % 2 == 0 else order[::-1]:
        if announce is not None:
            announce(name)
        start = time.perf_counter()
        res = generate(runner, [prompt], max_new_tokens=max_new_tokens, **kwargs)
        out[name] = (res, time.perf_counter() - start)
    if announce is not None:
        announce(None)
    return out


def rows_cost(runner: Any, most: int = 6, repeats: int = 9, context: int = 64) -> dict[str, Any]:
    """What verifying costs on this shape: a step of `k` causal rows after a cached context (`k - 1` drafts), timed
    whole as exact mode pays it (`mark`, the forward with logits at every row, the `rewind` of a rejection at the
    first draft), the counts taking turns, the median of `repeats` rounds; beside it the experts those rows route to
    (the union over the rows, the mean over MoE layers, from the router) and the bytes a forward then reads (the
    packed dense weights and LM head once, each routed expert once: a memory-bound forward's cost ratio). The
    ceiling at `p`: the most exact mode can gain with these costs (`measured`; `bytes`: were a forward to cost the
    bytes it reads), `max_k E_p(k - 1) / c(k)`,
    `E_p(j) = 1 + p + ... + p^j` tokens a step (each draft kept with probability `p` while the ones before were).
    Each step keeps its first token, so the context grows by one a step (64 to 124 tokens over the rounds)."""
    import statistics

    import torch

    from clover.model.moe import SparseMoE
    from clover.model.quant import PackedExperts

    model = runner.model
    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    union: list[int] = []
    hooks = [m.register_forward_pre_hook(
        lambda m, args: union.append(int(m.gate(args[0].reshape(-1, args[0].shape[-1]))[1].unique().numel())))
        for m in moes]
    gen = torch.Generator().manual_seed(0)
    vocab = min(runner.config.vocab_size, 1000)
    times: dict[int, list[float]] = {k: [] for k in range(1, most + 1)}
    unions: dict[int, list[int]] = {k: [] for k in range(1, most + 1)}
    cache = runner.new_cache(1)
    with torch.inference_mode():
        runner.forward(torch.randint(0, vocab, (1, context), generator=gen), 1, cache=cache, prefix_len=context,
                       logits_to_keep=0)
        for round_ in range(repeats + 1):  # the first round warms each shape up, not counted
            for k in range(1, most + 1):
                ids = torch.randint(0, vocab, (1, k), generator=gen)
                at = torch.ones(1, k, dtype=torch.bool)
                union.clear()
                start = time.perf_counter()
                cache.mark()
                runner.forward(ids, 1, cache=cache, prefix_len=k, logits_at=at)
                cache.rewind(torch.ones(1, dtype=torch.long))  # the decided token kept, the drafts rejected
                took = time.perf_counter() - start
                if round_:
                    times[k].append(took)
                    unions[k].append(statistics.mean(union))
    for hook in hooks:
        hook.remove()
    experts = [m.experts for m in moes]
    expert_bytes = sum(sum(b.numel() * b.element_size() for b in e.buffers()) if isinstance(e, PackedExperts) else
                       sum(p.numel() * p.element_size() for p in e.parameters()) for e in experts)
    embed = model.model.embed_tokens.weight
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    dense = total - expert_bytes - embed.numel() * embed.element_size()  # one embedding row is read, not the table
    num_experts = runner.config.num_experts
    median = {k: statistics.median(v) for k, v in times.items()}
    routed = {k: statistics.mean(v) for k, v in unions.items()}
    read = {k: dense + expert_bytes * routed[k] / num_experts for k in routed}
    cost = {k: median[k] / median[1] for k in median}
    ceiling: dict[str, Any] = {}
    for p in (0.9, 0.7, 0.5):
        for name, ratio in (("measured", cost), ("bytes", {k: read[k] / read[1] for k in read})):
            gains = {k: sum(p ** i for i in range(k)) / ratio[k] for k in ratio}
            best = max(gains, key=gains.get)
            ceiling.setdefault(str(p), {})[name] = {"speedup": round(gains[best], 3), "rows": best,
                                                    "tokens_per_forward": round(sum(p ** i for i in range(best)), 3)}
    return {"ms": {k: round(1000 * v, 2) for k, v in median.items()},
            "cost_vs_one_row": {k: round(v, 3) for k, v in cost.items()},
            "experts_routed": {k: round(v, 2) for k, v in routed.items()}, "experts": num_experts,
            "top_k": runner.config.num_experts_per_tok,
            "bytes_read_mb": {k: round(v / 1e6, 1) for k, v in read.items()},
            "bytes_vs_one_row": {k: round(v / read[1], 3) for k, v in read.items()},
            "dense_mb": round(dense / 1e6, 1), "experts_mb": round(expert_bytes / 1e6, 1), "ceiling": ceiling}


PROJECTED = "clover-35b-a3b"  # the shape whose decode speed `projection` projects (the seeds' flagship)


def module_sizes(model: Any) -> dict[str, float]:
    """The model's tensors (parameters and buffers) by part, summed over layers: bytes as stored when `model` holds
    real tensors, else (the meta device) parameter counts. A part is a layer's mixer (`linear_attn`, `self_attn`),
    norm, router (`mlp.gate`), routed experts, shared expert or its gate, or a top-level module (embedding, final
    norm, head): what quantising keeps apart, whichever projections it fuses inside a part (q|k|v, gate|up)."""
    sizes: dict[str, float] = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        parts = name.split(".")[:-1]  # the module's path
        if "layers" in parts:
            at = parts.index("layers")
            parts = [*parts[:at], "layers", "*", *parts[at + 2 : at + (4 if parts[at + 2] == "mlp" else 3)]]
        key = ".".join(parts)
        sizes[key] = sizes.get(key, 0.0) + tensor.numel() * (1 if tensor.is_meta else tensor.element_size())
    return sizes


def bytes_per_token(stored: dict[str, float], config: Any) -> float:
    """What one decoded token reads (`stored`: bytes by module, `module_sizes`): every weight once, except the
    embedding table (one row of it) and the routed experts (`top_k` of `E`), plus each DeltaNet layer's fp32
    recurrent state `[Hv, dk, dv]` read and written once."""
    per = dict(stored)
    per["model.embed_tokens"] = stored["model.embed_tokens"] / config.vocab_size
    experts = "model.layers.*.mlp.experts"
    per[experts] = stored[experts] * config.num_experts_per_tok / config.num_experts
    deltanet = sum(t == "linear_attention" for t in config.layer_types)
    state = deltanet * config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
    return sum(per.values()) + 2 * state


def projection(model: Any, tok_s: float, preset: str = PROJECTED) -> dict[str, Any]:
    """`preset`'s decode tok/s on this machine at block size 1, projected from the twin's: the twin's measured
    tok/s times the bytes it reads a token (`bytes_per_token`) is the bytes/s this machine's run reached; the
    preset's bytes a token are its parameters module by module (a model on the meta device) times the bytes per
    parameter the twin's packed weights store in the same module (int4 projections and experts, fp32 norms and
    router, the head as the twin's), and it reads them at that rate. A forward that cost only its bytes would
    scale so; the twin's rate also carries its fixed costs per forward (kernel calls, the recurrence), which
    weigh less beside a larger model's bytes."""
    import torch

    from clover import CloverConfig, CloverForBlockDiffusion

    config = model.config
    with torch.device("meta"):
        twin_params = module_sizes(CloverForBlockDiffusion(CloverConfig.from_dict(config.to_dict())))
        target_config = CloverConfig.from_preset(preset)
        target_params = module_sizes(CloverForBlockDiffusion(target_config))
    twin_bytes = module_sizes(model)
    missing = sorted(set(target_params) - set(twin_bytes))
    if missing:
        raise ValueError(f"the twin has no module {missing[0]} that {preset} has: no bytes per parameter to take")
    per_param = {key: twin_bytes[key] / twin_params[key] for key in twin_params}
    target = {key: n * per_param[key] for key, n in target_params.items()}
    twin_read, target_read = bytes_per_token(twin_bytes, config), bytes_per_token(target, target_config)
    rate = twin_read * tok_s
    return {"preset": preset, "twin_mb_per_token": twin_read / 1e6, "twin_tok_s": tok_s, "gb_per_s": rate / 1e9,
            "mb_per_token": target_read / 1e6, "tok_s": rate / target_read, "resident_gb": sum(target.values()) / 1e9,
            "memory_gb": _memory_bytes() / 1e9}


def _memory_bytes() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return float("nan")


def llamacpp_exact(runner: Any, prompts: list[list[int]], sequences: list[list[int]], job: dict) -> dict:
    """The llama.cpp runner's exact mode (its part of this benchmark): its cost of `k` rows against one (the cost
    table, measured on this twin and kept), then at each acceptance `p` oracle drafts (`oracle_drafts`) verified
    as the cost table sizes them (`adaptive`) and, for comparison, a fixed number of them every forward (`fixed_k`:
    the best constant choice, and whether the sizing finds it). Each exact-mode answer is timed right after block
    size 1's on the same prompt (`vs_block_size_1`: their time ratio over the prompts, so a busy moment of a shared
    machine falls on both) and compared with it token for token (`first_divergence` per prompt: the index of the
    first differing token, None where equal; a quantised file's batch of k rows may round a near tie otherwise than
    one row does, and a random twin's logits are full of near ties). `ceiling`: the most exact mode can gain at `p`
    by the table alone, max over `k` of `E(k) / (t(k + 1) / t(1))`, `E(k) = (1 - p^(k + 1)) / (1 - p)`."""
    from clover.engine import generate
    from clover.engine.drafts.cost import cost_table

    table = cost_table(runner)
    rel = {r: table(r) / table(1) for r in range(1, EXACT_BLOCK + 1)}
    out: dict[str, Any] = {"cost_ms": {r: round(1000 * s, 2) for r, s in zip(table.rows, table.seconds)},
                           "exact": {}}
    references = {tuple(p): s for p, s in zip(prompts, sequences)}
    for p in job["acceptance"]:
        expected = {k: (k + 1 if p == 1 else (1 - p ** (k + 1)) / (1 - p)) for k in range(EXACT_BLOCK)}
        runs: dict[str, Any] = {}
        for fixed in [None, *job.get("fixed_k", (1, 2))]:
            with oracle_drafting(references, p, EXACT_BLOCK - 1 if fixed is None else fixed):
                options = {"adaptive": fixed is None}
                generate(runner, prompts[:1], max_new_tokens=4, block_size=EXACT_BLOCK, rule="exact",
                         rule_options=options)  # warm-up
                tokens, seconds, base, forwards, divergence = 0, 0.0, 0.0, 0, []
                for prompt, reference in zip(prompts, sequences):
                    start = time.perf_counter()
                    generate(runner, [prompt], max_new_tokens=job["max_new_tokens"], block_size=1, rule="threshold")
                    base += time.perf_counter() - start
                    start = time.perf_counter()
                    res = generate(runner, [prompt], max_new_tokens=job["max_new_tokens"], block_size=EXACT_BLOCK,
                                   rule="exact", rule_options=options)
                    seconds += time.perf_counter() - start
                    got = res.sequences[0]
                    tokens += len(got)
                    forwards += res.stats[0]["forward_passes"]
                    divergence.append(next((i for i, (a, b) in enumerate(zip(got, reference)) if a != b),
                                           None if len(got) == len(reference) else min(len(got), len(reference))))
                runs["adaptive" if fixed is None else f"fixed_k={fixed}"] = {
                    "tok_s": tokens / seconds, "vs_block_size_1": base / seconds, "tokens": tokens,
                    "forwards": forwards, "tokens_per_forward": tokens / max(forwards, 1),
                    "first_divergence": divergence, "equal_to_block_size_1": all(d is None for d in divergence)}
        out["exact"][str(p)] = {**runs["adaptive"], "runs": runs,
                                "ceiling": round(max(expected[k] / rel[k + 1] for k in expected), 3)}
    return out


def teacher_forced(runner: Any, prompts: list[list[int]], answers: list[list[int]], logits_out: str) -> dict:
    """This system's logits over each prompt + reference answer, at the answer's positions (saved for the parent)."""
    import torch
    from safetensors.torch import save_file

    tensors = {}
    with torch.inference_mode():
        for i, (prompt, answer) in enumerate(zip(prompts, answers)):
            ids = torch.tensor([prompt + answer])
            at = torch.zeros_like(ids, dtype=torch.bool)
            at[0, len(prompt) - 1 : len(prompt) + len(answer) - 1] = True  # the logits that predict each answer token
            cache = runner.new_cache(1)
            logits = runner.forward(ids, 1, cache=cache, prefix_len=ids.shape[1], logits_at=at)
            tensors[str(i)] = logits.reshape(-1, logits.shape[-1]).float().contiguous()
    save_file(tensors, logits_out)
    return {"positions": sum(len(a) for a in answers)}


def agreement(fp32_logits: str, int4_logits: str, fp32_seqs: list[list[int]], int4_seqs: list[list[int]]) -> dict:
    """Top-1 agreement and KL(fp32 || int4) teacher-forced on fp32's answers, with fp32's margins where the two part
    (`parting_margins`); free-running, where int4's greedy answer parts from fp32's and fp32's logit margin there."""
    import torch
    from safetensors.torch import load_file

    want, got = load_file(fp32_logits), load_file(int4_logits)
    agree = total = 0
    kl = 0.0
    partings = []
    keys = sorted(want, key=int)
    for key in keys:
        a, b = want[key], got[key]
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += a.shape[0]
        log_a, log_b = a.log_softmax(-1), b.log_softmax(-1)
        kl += float((log_a.exp() * (log_a - log_b)).sum())
        x, y = fp32_seqs[int(key)], int4_seqs[int(key)]
        at = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None)
        if at is not None:
            partings.append({"prompt": int(key), "position": at, "fp32_margin": float(a[at].max() - a[at, y[at]]),
                             "fp32_logit_scale": float(a[at].std())})
    same = sum(next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
               for x, y in zip(fp32_seqs, int4_seqs))
    return {"top1_agreement": agree / total, "kl_mean": kl / total, "positions": total,
            "teacher_forced_partings": parting_margins(torch.cat([want[k] for k in keys]),
                                                       torch.cat([got[k] for k in keys])),
            "free_running_equal_positions": same / sum(len(x) for x in fp32_seqs), "partings": partings}


NEAR_TIE_RANK = 0.25  # partings "at near ties only": each where fp32's margin is in the lowest quarter of its margins


def parting_margins(fp32: Any, int4: Any) -> dict[str, Any]:
    """Whether int4 parts from fp32 only where fp32 nearly ties: over teacher-forced logits `[P, V]` (both read the
    same tokens), fp32's margin (its top logit minus its second) at the positions where the two argmaxes differ,
    against its median margin over all positions. `rank`: the share of all positions whose margin is below a
    parting's (0: the nearest tie of all; a parting at random positions has ranks spread over 0..1, median ~0.5).
    `near_ties_only`: every parting's rank below `NEAR_TIE_RANK`."""
    import torch

    top2 = fp32.float().topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    parted = fp32.argmax(-1) != int4.argmax(-1)
    at = margin[parted]
    rank = (margin[None, :] < at[:, None]).float().mean(1)  # [partings]
    out: dict[str, Any] = {"positions": int(margin.numel()), "partings": int(parted.sum()),
                           "fp32_margin_median": round(float(margin.median()), 4)}
    if at.numel():
        out.update({"fp32_margin_median_at_partings": round(float(at.median()), 4),
                    "fp32_margin_max_at_partings": round(float(at.max()), 4),
                    "rank_median_at_partings": round(float(rank.median()), 3),
                    "near_ties_only": bool((rank < NEAR_TIE_RANK).all())})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=None, help="where the twin is built (default: "
                        "$CLOVER_CACHE/bench_hybrid[-x4])")
    parser.add_argument("--experts-scale", type=int, default=1)
    parser.add_argument("--init", choices=("scaled", "random"), default="scaled",
                        help="the twin's weights: scaled (residual outputs / sqrt(2 L), as trained nets "
                        "start) or random")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--acceptance", default="0.9,0.7,0.5,0")
    parser.add_argument("--threshold", default="16:0.9,4:1e-9,16:1e-9",
                        help="BLOCK:THRESHOLD pairs of the threshold rule measured on the systems in --exact "
                        "(Clover's runner only; none: empty)")
    parser.add_argument("--systems", default="clover/fp32,clover/int4,llama.cpp/q4_0")
    parser.add_argument("--exact", default="clover/fp32,clover/int4,llama.cpp/q4_0",
                        help="the systems whose exact mode is measured, and for Clover's the cost of k rows (the "
                        "others: block size 1)")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_hybrid.json")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, path, job_path = args.worker
        job = json.loads(Path(job_path).read_text())
        Path(job["result"]).write_text(json.dumps(worker(kind, path, job)))
        return

    from clover import CloverConfig
    from clover.paths import cache_root

    work = args.work or cache_root() / ("bench_hybrid" + (f"-x{args.experts_scale}" if args.experts_scale > 1 else ""))
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    paths = build(work, args.experts_scale, args.init)
    config = CloverConfig.from_file(paths["int4"])
    missing = [name for name in args.systems.split(",") if name.split("/")[1] not in paths]
    if missing:
        raise SystemExit(f"--experts-scale {args.experts_scale} builds the int4 twin only (its fp32 form does not fit "
                         f"in memory beside other work): drop {','.join(missing)} from --systems")
    prompts = twin_prompts(config.vocab_size, args.prompts, args.prompt_len)
    systems: dict[str, dict[str, Any]] = {}
    for name in args.systems.split(","):
        runner, form = name.split("/")
        kind = "clover" if runner == "clover" else "llamacpp"
        job = {"threads": args.threads, "prompts": prompts, "max_new_tokens": args.max_new_tokens,
               "acceptance": [float(p) for p in args.acceptance.split(",")], "exact": name in args.exact.split(","),
               "threshold": threshold_pairs(args.threshold),
               "result": str(work / f"{name.replace('/', '_')}.json"),
               "logits_out": str(work / f"{name.replace('/', '_')}.logits.safetensors")}
        job["reference_sequences"] = systems.get("clover/fp32", {}).get("sequences")
        job_path = work / "job.json"
        job_path.write_text(json.dumps(job))
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        proc = subprocess.run([sys.executable, __file__, "--worker", kind, str(paths[form]), str(job_path)],
                              env=env, capture_output=True, text=True)
        if proc.returncode:
            systems[name] = {"error": proc.stderr[-3000:]}
            print(f"{name}: failed\n{proc.stderr[-3000:]}", flush=True)
            continue
        systems[name] = json.loads(Path(job["result"]).read_text())
        s = systems[name]
        print(f"{name}: {s['tok_s']:.2f} tok/s at block size 1, peak RSS {s['peak_rss_mib']:.0f} MiB", flush=True)
        if "projection_35b" in s:
            j = s["projection_35b"]
            print(f"  {j['preset']} projected: {j['tok_s']:.2f} tok/s ({j['mb_per_token']:.0f} MB a token at the "
                  f"{j['gb_per_s']:.1f} GB/s the twin's {j['twin_mb_per_token']:.0f} MB a token reached; "
                  f"{j['resident_gb']:.1f} GB resident, this machine has {j['memory_gb']:.1f} GB)", flush=True)
        if "rows_cost" in s:
            c = s["rows_cost"]
            print(f"  cost of k rows / 1: {c['cost_vs_one_row']}, experts routed {c['experts_routed']}, "
                  f"bytes / 1 row {c['bytes_vs_one_row']}, ceiling {c['ceiling']}", flush=True)
        for p, e in s.get("exact", {}).items():
            after = f", {e['decode_speedup']:.2f}x after the first token" if "decode_speedup" in e else ""
            print(f"  exact p={p}: {e['tok_s']:.2f} tok/s ({exact_speedup(e):.2f}x block size 1 timed beside it"
                  f"{after}), {e['tokens_per_forward']:.2f} tokens/forward, equal to block size 1: "
                  f"{e['equal_to_block_size_1']}", flush=True)
        for key, e in s.get("threshold", {}).items():
            print(f"  threshold rule, block:threshold {key}: {e['tok_s']:.2f} tok/s ({e['speedup']:.2f}x block size 1 "
                  f"timed beside it), {e['tokens_per_forward']:.2f} tokens/forward", flush=True)
    report = summarise(systems, work, args)
    report.update({"command": " ".join(sys.argv), "machine": machine(args.threads), "twin": {
        **TWIN, "num_experts": config.num_experts, "init": args.init}, "twin_parameters": _parameters(config),
        "minutes": round((time.time() - started) / 60, 1)})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k in ("ratios", "accuracy")}, indent=1))
    if "accuracy" in report:
        a, t = report["accuracy"], report["accuracy"]["teacher_forced_partings"]
        parted = (f"fp32's margin where they part {t['fp32_margin_median_at_partings']:.3g} (median; max "
                  f"{t['fp32_margin_max_at_partings']:.3g}) against {t['fp32_margin_median']:.3g} over all positions, "
                  f"the partings' median rank {t['rank_median_at_partings']:.2f}: near ties only: "
                  f"{t['near_ties_only']}") if t["partings"] else "no parting"
        print(f"int4 against fp32, teacher-forced: top-1 agreement {a['top1_agreement']:.3f} ({t['partings']} of "
              f"{t['positions']} positions part); {parted}")


def twin_prompts(vocab_size: int, n: int, length: int) -> list[list[int]]:
    """The benchmark's `n` random prompts of `length` token ids (seeded: every script that times the twin reads the
    same ones)."""
    rng = random.Random(0)
    return [[rng.randrange(vocab_size - 1) for _ in range(length)] for _ in range(n)]


def threshold_pairs(text: str) -> list[tuple[int, float]]:
    """`--threshold`'s `BLOCK:THRESHOLD` pairs, e.g. "16:0.9,4:1e-9"."""
    pairs = []
    for item in filter(None, text.split(",")):
        try:
            block, threshold = item.split(":")
            pairs.append((int(block), float(threshold)))
        except ValueError:
            raise SystemExit(f"--threshold takes BLOCK:THRESHOLD pairs (e.g. 16:0.9,4:1e-9), got {item!r}") from None
        if pairs[-1][0] < 2 or not 0 < pairs[-1][1] <= 1:
            raise SystemExit(f"--threshold {item!r}: a block of at least 2 tokens and a threshold in (0, 1]")
    return pairs


def exact_speedup(result: dict[str, Any]) -> float:
    """Exact mode's tok/s over block size 1's timed beside it: Clover's runner names it `speedup`, the llama.cpp
    runner's (`llamacpp_exact`) `vs_block_size_1`."""
    return result["speedup"] if "speedup" in result else result["vs_block_size_1"]


def summarise(systems: dict[str, dict[str, Any]], work: Path, args: argparse.Namespace) -> dict[str, Any]:
    ratios: dict[str, Any] = {}
    llama = systems.get("llama.cpp/q4_0", {})
    for name, s in systems.items():
        if "tok_s" not in s:
            continue
        if "tok_s" in llama and name != "llama.cpp/q4_0":
            ratios[f"{name} / llama.cpp/q4_0 tok/s"] = s["tok_s"] / llama["tok_s"]
            ratios[f"{name} / llama.cpp/q4_0 peak RSS"] = s["peak_rss_mib"] / llama["peak_rss_mib"]
        for p, e in s.get("exact", {}).items():
            ratios[f"{name} exact p={p} / block size 1"] = exact_speedup(e)
            if "decode_speedup" in e:
                ratios[f"{name} exact p={p} / block size 1, after the first token"] = e["decode_speedup"]
        for key, e in s.get("threshold", {}).items():
            ratios[f"{name} threshold rule {key} / block size 1"] = e["speedup"]
            ratios[f"{name} threshold rule {key} tokens per forward"] = e["tokens_per_forward"]
        if "cost_ms" in s:
            one = s["cost_ms"]["1"]
            ratios[f"{name} cost of k rows / 1 row (cost table)"] = {k: round(v / one, 2)
                                                                     for k, v in s["cost_ms"].items()}
        if "rows_cost" in s:
            c = s["rows_cost"]
            ratios[f"{name} verifying step of k rows / 1 row"] = c["cost_vs_one_row"]
            ratios[f"{name} experts routed by k rows"] = c["experts_routed"]
            ratios[f"{name} ceiling of exact mode by these costs"] = c["ceiling"]
    report: dict[str, Any] = {"systems": systems, "ratios": ratios}
    fp32, int4 = systems.get("clover/fp32", {}), systems.get("clover/int4", {})
    if "sequences" in fp32 and "sequences" in int4 and "teacher_forced" in int4:
        report["accuracy"] = agreement(str(work / "clover_fp32.logits.safetensors"),
                                       str(work / "clover_int4.logits.safetensors"), fp32["sequences"],
                                       int4["sequences"])
    for s in systems.values():
        s.pop("sequences", None)
    return report


def machine(threads: int) -> dict[str, Any]:
    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    return {"cpu": next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("model name")), ""), "cores": os.cpu_count(), "threads": threads,
            "flags": [f for f in flags if f.startswith(("avx", "amx", "fma"))],
            "load_average_at_start": os.getloadavg()}


def _parameters(config: Any) -> dict[str, int]:
    import torch

    from clover import CloverForBlockDiffusion

    with torch.device("meta"):
        model = CloverForBlockDiffusion(config)
    return {"total": model.num_parameters(), "active_per_token": model.num_active_parameters()}


if __name__ == "__main__":
    main()
