"""Prefill throughput and single-token step latency: Clover vs `transformers` on the same weights.

    python benchmarks/bench_model.py [--threads 2] [--prompt 256] [--steps 32]

For each model: one prefill of `--prompt` tokens (tokens/s) and `--steps` cached single-token steps
(median ms/step), batch 1, fp32, inference mode. The transformers model is built from the same config and its
weights copied into Clover (names are shared), so both compute the same function.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from clover import CloverConfig, CloverForBlockDiffusion


def reference_pair(name: str):
    """(transformers model, Clover model) with identical random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    cfg = CloverConfig.from_preset(name)
    if cfg.mlp_type == "dense":
        ref = LlamaForCausalLM(LlamaConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_word_embeddings,
            max_position_embeddings=cfg.max_position_embeddings))
    else:
        ref = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
            layer_types=cfg.layer_types, num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
            linear_key_head_dim=cfg.linear_key_head_dim, linear_value_head_dim=cfg.linear_value_head_dim,
            linear_num_key_heads=cfg.linear_num_key_heads, linear_num_value_heads=cfg.linear_num_value_heads,
            num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
            rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                             "partial_rotary_factor": cfg.partial_rotary_factor}))
    model = CloverForBlockDiffusion(cfg)
    model.load_state_dict(ref.state_dict(), strict=False)
    return ref.eval(), model.eval()


def time_clover(model, ids, steps):
    cache = model.new_cache(1)
    t0 = time.perf_counter()
    logits = model(ids, cache=cache, logits_to_keep=1).logits
    prefill = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        nxt = logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        logits = model(nxt, cache=cache, logits_to_keep=1).logits
        times.append(time.perf_counter() - t0)
    return prefill, statistics.median(times)


def time_transformers(model, ids, steps):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    t0 = time.perf_counter()
    out = model(ids, cache=cache, use_cache=True, logits_to_keep=1)
    prefill = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        nxt = out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        out = model(nxt, cache=cache, use_cache=True, logits_to_keep=1)
        times.append(time.perf_counter() - t0)
    return prefill, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--models", nargs="+", default=["clover-tiny", "clover-hybrid-small", "clover-smol-135m"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"threads={args.threads} prompt={args.prompt} steps={args.steps} torch={torch.__version__} fp32 batch=1")
    print(f"{'model':22} {'impl':13} {'prefill tok/s':>14} {'step ms':>9}")
    with torch.inference_mode():
        for name in args.models:
            ref, model = reference_pair(name)
            ids = torch.randint(0, model.config.vocab_size - 1, (1, args.prompt))
            for impl, fn, m in (("clover", time_clover, model), ("transformers", time_transformers, ref)):
                fn(m, ids[:, :16], 2)  # warm-up
                prefill, step = fn(m, ids, args.steps)
                print(f"{name:22} {impl:13} {args.prompt / prefill:14.0f} {step * 1e3:9.2f}")


if __name__ == "__main__":
    main()
