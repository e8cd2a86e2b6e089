"""A hybrid Clover checkpoint's causal path as llama.cpp's own Qwen3.5 architectures (`clover export --to gguf`).

Block size 1 and exact mode compute only the causal path of a hybrid (Gated DeltaNet + gated attention) model,
and that path is the AR base's network: llama.cpp's `qwen35moe` (sparse MoE feed-forward, Qwen3.5-MoE /
Qwen3.6-MoE, and Qwen3-Next's all-sparse models, whose blocks are the same) or `qwen35` (dense SwiGLU) runs it.
Names, shapes and metadata follow llama.cpp's converter (`convert_hf_to_gguf.py`, `Qwen3_5MoeTextModel` /
`Qwen3_5TextModel`) and its loaders (`src/models/qwen35moe.cpp`, `qwen35.cpp`):

* zero-centred RMSNorm weights `w` are written as `1 + w` (llama.cpp's RMSNorm multiplies by the weight), the
  DeltaNet output norm (already plain) as it is;
* `A_log` is written as `ssm_a = -exp(A_log)`, `dt_bias` as `ssm_dt.bias`, the depthwise conv as `[C, K]`;
* value heads in tiled order: Clover (like transformers) groups the `r = Hv / Hk` value heads of each key head
  together (`j = kh * r + t`); ggml broadcasts q/k heads over value heads by tiling (`n = t * Hk + kh`), so every
  per-value-head row (the v part of `in_proj_qkv` and of the conv, `in_proj_z`, `in_proj_b`, `in_proj_a`, `A_log`,
  `dt_bias`) and the columns of `out_proj` are permuted to that order (`tiled_value_heads`);
* Q/K rows are not permuted (these architectures use NeoX-style rotate-half RoPE, as Clover does); `q_proj`
  keeps its per-head `[query | gate]` rows, which is how llama.cpp splits it;
* RoPE is written as llama.cpp's interleaved M-RoPE with sections covering the rotary dims: a text token's three
  position components are equal, so every rotated pair turns by `p * theta_i`, plain partial RoPE.

What Clover adds for block decoding and the causal path does not use is dropped: `memory_calibration` (the
block-bidirectional read's `lambda(n)`, 1 for a block of one token) and the right-context conv `conv1d_right`,
whose tap 0 acts on a block of one token (the token itself) and is folded into the causal conv's last tap
(`w_causal[:, K-1] += w_right[:, 0]`, exact in the arithmetic); with `deltanet_reading: causal` it is not used at all.
What llama.cpp's architecture cannot express is refused by `check_hybrid_exportable`, naming the setting.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from clover.config import FULL_ATTENTION, LINEAR_ATTENTION, CloverConfig

CONFIG_KEY = "clover.config"  # the checkpoint's whole config.json, which the llama.cpp runner reads back

_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight", "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight", "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight", "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a", "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# causal-path-free Clover parameters (module docstring): dropped (conv1d_right after folding its tap 0)
_DROPPED = ("linear_attn.conv1d_right.weight", "linear_attn.memory_calibration")
# zero-centred norms (y = norm(x) * (1 + w)), written as llama.cpp's plain weight 1 + w
_ZERO_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                 "self_attn.k_norm.weight")
# matrices llama.cpp keeps at f32 whatever the file type: the conv (ggml_ssm_conv takes f32) and the routers
KEEP_F32 = ("ssm_conv1d.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")
EXPERT_TENSORS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")  # the routed experts


def hybrid_arch(config: CloverConfig) -> str:
    """llama.cpp's architecture for a hybrid config: `qwen35moe` (sparse MoE) or `qwen35` (dense SwiGLU)."""
    return "qwen35moe" if config.mlp_type == "moe" else "qwen35"


def full_attention_interval(config: CloverConfig) -> int | None:
    """The `n` of a layer pattern where every `n`-th layer (and only those) is full attention, else None."""
    for n in range(1, config.num_hidden_layers + 1):
        if config.layer_types == [FULL_ATTENTION if (i + 1) % n == 0 else LINEAR_ATTENTION
                                  for i in range(config.num_hidden_layers)]:
            return n
    return None


def check_hybrid_exportable(config: CloverConfig) -> None:
    """Refuse what llama.cpp's `qwen35` / `qwen35moe` cannot compute exactly, naming the first such setting."""
    why = None
    if config.norm_type != "zero_centered" or not config.attn_output_gate or not config.qk_norm:
        why = "its attention is not Qwen3.5's gated attention with zero-centred q/k norms"
    elif config.attention_bias:
        why = "its attention has biases"
    elif config.rope_scaling is not None:
        why = f"it uses RoPE scaling (rope_scaling {config.rope_scaling}), which the export does not write"
    elif full_attention_interval(config) is None:
        why = (f"its layer pattern {config.layer_types} is not 'every n-th layer full attention', the only one "
               "llama.cpp's loader reads")
    elif config.linear_key_head_dim != config.linear_value_head_dim:
        why = (f"its DeltaNet key and value head dims differ ({config.linear_key_head_dim} vs "
               f"{config.linear_value_head_dim}); llama.cpp's qwen35 loaders take one (ssm.state_size)")
    elif config.mlp_type == "moe" and config.mlp_only_layers:
        why = f"layers {config.mlp_only_layers} are dense inside a MoE model; qwen35moe has experts in every layer"
    elif config.mlp_type == "moe" and not config.norm_topk_prob:
        why = "its router does not renormalise the top-k weights (norm_topk_prob false); qwen35moe always does"
    elif config.mlp_type == "moe" and not config.shared_expert_intermediate_size:
        why = "it has no shared expert; qwen35moe's loader requires one"
    elif config.mask_token_id is None:
        why = "it has no mask token (convert it with `clover convert` first)"
    elif not config.token_shift:
        why = "it has no token shift: its causal path has no next-token output (exact mode is undefined)"
    if why:
        raise ValueError(f"cannot export this hybrid checkpoint to GGUF as llama.cpp's {hybrid_arch(config)}: {why}")


def rope_sections(rotary_dim: int) -> list[int]:
    """M-RoPE sections covering `rotary_dim / 2` rotated pairs: pair `i` takes section `i mod 3` (interleaved), so
    section `s` must hold the pairs `i < n` with `i mod 3 == s`; the fourth section is unused by text."""
    n = rotary_dim // 2
    return [(n - s + 2) // 3 for s in range(3)] + [0]


def write_hybrid_metadata(writer: Any, config: CloverConfig) -> None:
    """The architecture's hyper-parameters, as llama.cpp's converter writes them."""
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_rope_dimension_count(config.rotary_dim)
    writer.add_rope_dimension_sections(rope_sections(config.rotary_dim))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
    writer.add_ssm_state_size(config.linear_key_head_dim)
    writer.add_ssm_group_count(config.linear_num_key_heads)
    writer.add_ssm_time_step_rank(config.linear_num_value_heads)
    writer.add_ssm_inner_size(config.linear_value_head_dim * config.linear_num_value_heads)
    writer.add_full_attention_interval(full_attention_interval(config))
    if config.mlp_type == "moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    else:
        writer.add_feed_forward_length(config.intermediate_size)


def tiled_value_heads(x: torch.Tensor, dim: int, num_k_heads: int, num_v_heads: int, head_dim: int) -> torch.Tensor:
    """Value heads along `dim` (each `head_dim` wide) from grouped order `kh * r + t` to tiled order `t * Hk + kh`."""
    r = num_v_heads // num_k_heads
    shape = list(x.shape)
    grouped = x.reshape(*shape[:dim], num_k_heads, r, head_dim, *shape[dim + 1:])
    return grouped.transpose(dim, dim + 1).reshape(shape)


def hybrid_tensors(state: dict[str, torch.Tensor], config: CloverConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(GGUF name, tensor) for every tensor of the causal path, in the state dict's order (module docstring)."""
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    dv, key_dim = config.linear_value_head_dim, config.linear_num_key_heads * config.linear_key_head_dim

    def tiled(x: torch.Tensor, dim: int = 0, head_dim: int = dv) -> torch.Tensor:
        return tiled_value_heads(x, dim, hk, hv, head_dim)

    for name, tensor in state.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name in _GLOBAL:
            yield _GLOBAL[name], tensor + 1 if name == "model.norm.weight" else tensor
            continue
        prefix, _, rest = name.partition(".layers.")
        layer, _, leaf = rest.partition(".")
        if prefix != "model" or not layer.isdigit():
            raise ValueError(f"Clover tensor {name!r} has no counterpart in llama.cpp's {hybrid_arch(config)}")
        blk = f"blk.{layer}."
        if leaf in _DROPPED:
            continue
        if leaf == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows, then up
            gate, up = tensor.chunk(2, dim=1)
            yield blk + "ffn_gate_exps.weight", gate
            yield blk + "ffn_up_exps.weight", up
            continue
        if leaf not in _LAYER:
            raise ValueError(f"Clover tensor {name!r} has no counterpart in llama.cpp's {hybrid_arch(config)}")
        if leaf in _ZERO_CENTRED:
            tensor = tensor + 1
        elif leaf == "linear_attn.in_proj_qkv.weight":
            tensor = torch.cat([tensor[: 2 * key_dim], tiled(tensor[2 * key_dim:])])
        elif leaf == "linear_attn.conv1d.weight":  # [C, 1, K] -> [C, K], the right conv's tap 0 folded in
            tensor = tensor[:, 0].clone()
            if config.deltanet_reading != "causal":
                tensor[:, -1] += state[f"model.layers.{layer}.linear_attn.conv1d_right.weight"][:, 0, 0]
            tensor = torch.cat([tensor[: 2 * key_dim], tiled(tensor[2 * key_dim:])])
        elif leaf in ("linear_attn.in_proj_z.weight",):
            tensor = tiled(tensor)
        elif leaf in ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight", "linear_attn.dt_bias"):
            tensor = tiled(tensor, head_dim=1)
        elif leaf == "linear_attn.A_log":
            tensor = tiled(-tensor.float().exp(), head_dim=1)
        elif leaf == "linear_attn.out_proj.weight":
            tensor = tiled(tensor, dim=1)
        elif leaf == "mlp.shared_expert_gate.weight":  # [1, H] -> llama.cpp's [H]
            tensor = tensor.reshape(-1)
        yield blk + _LAYER[leaf], tensor
