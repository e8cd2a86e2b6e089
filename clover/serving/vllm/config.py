"""A Clover checkpoint's causal path as a vLLM model: which of vLLM's own architectures computes it, its
transformers config, and what is refused (with the reason).

A Clover checkpoint's `block_size=1` forward is its AR base exactly (docs/design.md §2), so vLLM's model of that
base, fed the checkpoint's weights (`clover.serving.vllm.weights`), serves the tokens of Clover's block size 1 and
exact mode:

* dense, Llama-shaped (plain RMSNorm, full RoPE, SwiGLU, no q/k norm or output gate; clover-smol) -> vLLM's
  `LlamaForCausalLM`;
* hybrid (Gated DeltaNet + gated attention, zero-centred norms: the Qwen3.5-MoE / Qwen3-Next presets) -> vLLM's
  `Qwen3NextForCausalLM`, the same blocks as its Qwen3.5 model (whose module imports a vision stack that needs
  torchvision, which has no build for a CPU torch here); dense feed-forward layers (`mlp_only_layers`, or a dense
  hybrid) included.

Refused: a family without the token shift (SDAR, dllm's BD3LM, arcLM: a masked position is predicted at its own
position, so no output at a committed token predicts the next one and there is no causal path to serve), a
quantised Clover build (vLLM quantises its own way: `--quantization`), an adapter stored unmerged that is not
gated (it changes the causal path: merge it first), and shapes no vLLM architecture here has.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from clover.config import CloverConfig

# the architectures the plugin registers (their classes: clover.serving.vllm.models)
ARCHITECTURES = ("CloverLlamaForCausalLM", "CloverQwen3NextForCausalLM")


class NotServable(ValueError):
    """A Clover checkpoint vLLM cannot serve here, and why."""


def architecture(config: CloverConfig) -> str:
    """The registered architecture that computes `config`'s causal path, or NotServable naming what is not."""
    if not config.token_shift:
        raise NotServable(
            f"a {config.family} checkpoint predicts a masked position at its own position (token_shift false): no "
            "output at a committed token predicts the next one, so it has no causal (autoregressive) path for vLLM "
            "to serve; serve it with `clover serve`")
    if config.has_linear_attention:
        why = ("its norms are plain (vLLM's Qwen3-Next layers are zero-centred)" if config.norm_type != "zero_centered"
               else "its attention has no output gate or no q/k norm"
               if not (config.attn_output_gate and config.qk_norm)
               else "it has q/k/v biases" if config.attention_bias else None)
        if why:
            raise NotServable(f"a hybrid checkpoint maps onto vLLM's Qwen3-Next model, but {why}")
        return "CloverQwen3NextForCausalLM"
    why = ("its norms are zero-centred" if config.norm_type != "plain"
           else "its attention has an output gate, q/k norms or biases"
           if config.attn_output_gate or config.qk_norm or config.attention_bias
           else "it uses partial RoPE" if config.partial_rotary_factor != 1.0
           else "its feed-forward is a sparse MoE" if config.mlp_type != "dense" else None)
    if why:
        raise NotServable(f"a dense checkpoint maps onto vLLM's LlamaForCausalLM, but {why}")
    return "CloverLlamaForCausalLM"


def check_checkpoint(directory: str | Path) -> CloverConfig:
    """The config of the Clover checkpoint at `directory` if vLLM can serve it, else NotServable."""
    # deferred: torch (the modules that name these files), only when a checkpoint is checked
    from clover.model.lora import ADAPTER_CONFIG, read_adapter_config
    from clover.model.quant import QUANT_CONFIG

    directory = Path(directory)
    config = CloverConfig.from_file(directory)
    architecture(config)
    if (directory / QUANT_CONFIG).is_file():
        raise NotServable(f"{directory} is a quantised Clover build ({QUANT_CONFIG}): serve its unquantised "
                          "checkpoint (`--quant none`) and let vLLM quantise (`--quantization`)")
    if (directory / ADAPTER_CONFIG).is_file() and not read_adapter_config(directory)[0].gated:
        raise NotServable(f"{directory} stores an ungated adapter beside its weights: it changes the causal path, "
                          "and vLLM loads the weights as they are; merge it first (clover.model.lora.merge_and_unload, "
                          "then save_pretrained)")
    return config


def transformers_config(config: CloverConfig, **kwargs: Any) -> Any:
    """The transformers config of the vLLM architecture that computes `config`'s causal path (`kwargs`: what
    `PretrainedConfig.from_dict` takes). It carries Clover's own config as `clover_config` (the weight mapping
    reads it) and names the architecture the plugin registered."""
    from transformers import LlamaConfig, Qwen3NextConfig  # deferred: transformers

    arch = architecture(config)
    rope = {**(config.rope_scaling or {"rope_type": "default"}), "rope_theta": config.rope_theta}
    common = dict(
        architectures=[arch], vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim, hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings, bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, attention_bias=False,
        intermediate_size=config.intermediate_size, clover_config=config.to_dict())
    if arch == "CloverLlamaForCausalLM":
        return LlamaConfig.from_dict({**common, "mlp_bias": False, "rope_parameters": rope}, **kwargs)
    moe = config.mlp_type == "moe"
    return Qwen3NextConfig.from_dict({
        **common, "layer_types": list(config.layer_types), "linear_conv_kernel_dim": config.linear_conv_kernel_dim,
        "linear_key_head_dim": config.linear_key_head_dim, "linear_value_head_dim": config.linear_value_head_dim,
        "linear_num_key_heads": config.linear_num_key_heads, "linear_num_value_heads": config.linear_num_value_heads,
        "rope_parameters": {**rope, "partial_rotary_factor": config.partial_rotary_factor},
        # a dense hybrid: no experts, every layer's feed-forward the dense SwiGLU
        "num_experts": config.num_experts if moe else 0, "num_experts_per_tok": config.num_experts_per_tok,
        "moe_intermediate_size": config.moe_intermediate_size, "norm_topk_prob": config.norm_topk_prob,
        "shared_expert_intermediate_size": config.shared_expert_intermediate_size if moe else 0,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(config.mlp_only_layers) if moe else list(range(config.num_hidden_layers))}, **kwargs)


def clover_config_from_dict(data: dict[str, Any]) -> CloverConfig:
    """A CloverConfig from a config.json's dict as transformers hands it over (its own `_`-prefixed and
    version keys left out)."""
    return CloverConfig.from_dict({k: v for k, v in data.items()
                                   if not k.startswith("_") and k != "transformers_version"})


def register_transformers_config() -> None:
    """Teach transformers' AutoConfig `model_type: clover`: reading a Clover config.json gives the transformers
    config of the vLLM architecture that serves it (what vLLM's config loader and its tokenizer loading read)."""
    from transformers import AutoConfig, PretrainedConfig  # deferred: transformers, in vLLM's processes

    class CloverCheckpointConfig(PretrainedConfig):
        model_type = "clover"

        @classmethod
        def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
            return transformers_config(clover_config_from_dict(config_dict), **kwargs)

    AutoConfig.register("clover", CloverCheckpointConfig, exist_ok=True)
