"""`clover convert` on config.json files shaped as the published checkpoints' are.

Each case below is the key set of a published checkpoint's config.json (written from what those files hold: they
cannot be downloaded here), with sizes shrunk so that a random model builds in milliseconds. Sizes keep the
relations the published files rely on: `head_dim` absent where the file has none (so it is `hidden_size / heads`),
and different from `hidden_size / heads` where the file sets it (Qwen3, Qwen3-MoE, Qwen3-Next, Qwen3.5: 128 or 256
against 64 or 128); `layer_types` absent where the file derives them from `full_attention_interval`; sliding-window
fields present but off; RoPE in the legacy top-level fields or in `rope_parameters` (with Qwen3.5's M-RoPE
sections), as published.

transformers builds the reference from that same config.json (`CONFIG_MAPPING[model_type].from_dict`, the class
its `architectures` names: the multimodal release with its vision tower for Qwen3.5 / 3.6); the random weights are
saved with `save_pretrained`, the config.json is then replaced by the published-shape one, and the checkpoint is
converted through the command line. The converted model's `block_size=1` logits must be the reference's.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from clover import CloverForBlockDiffusion
from clover.cli.main import main
from clover.conversion import convert

ATOL = 1e-4
VOCAB = 160

# Qwen/Qwen2.5-0.5B-Instruct: no head_dim, tied, sliding window configured but off (use_sliding_window false)
QWEN2_5_0_5B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 150, "eos_token_id": 151,
    "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96,
    "max_position_embeddings": 32768, "max_window_layers": 1, "model_type": "qwen2", "num_attention_heads": 4,
    "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, "vocab_size": VOCAB,
}
# Qwen/Qwen2.5-7B-Instruct: as 0.5B, untied, max_window_layers = num_hidden_layers, rope_scaling null
QWEN2_5_7B = {**QWEN2_5_0_5B, "max_window_layers": 2, "sliding_window": 131072, "tie_word_embeddings": False,
              "rope_scaling": None, "max_position_embeddings": 32768}

# Qwen/Qwen3-0.6B: head_dim 128 with hidden 1024 / 16 heads (64): head_dim is not hidden_size / heads
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 150, "eos_token_id": 151, "head_dim": 32, "hidden_act": "silu", "hidden_size": 64,
    "initializer_range": 0.02, "intermediate_size": 96, "max_position_embeddings": 40960, "max_window_layers": 2,
    "model_type": "qwen3", "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": VOCAB,
}

# Qwen/Qwen3-30B-A3B: head_dim 128 with hidden 2048 / 32 heads (64); every layer sparse; no shared expert
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 150, "decoder_sparse_step": 1, "eos_token_id": 151, "head_dim": 32, "hidden_act": "silu",
    "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96, "max_position_embeddings": 40960,
    "max_window_layers": 2, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 24,
    "norm_topk_prob": True, "num_attention_heads": 4, "num_experts": 6, "num_experts_per_tok": 2,
    "num_hidden_layers": 2, "num_key_value_heads": 2, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": VOCAB,
}

# Qwen/Qwen3-Next-80B-A3B-Instruct: no layer_types (full_attention_interval 4), RoPE and partial_rotary_factor as
# top-level fields, head_dim 256 with hidden 2048 / 16 heads (128)
QWEN3_NEXT_80B_A3B = {
    "architectures": ["Qwen3NextForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 150, "decoder_sparse_step": 1, "eos_token_id": 151, "full_attention_interval": 4,
    "head_dim": 32, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 80,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_value_head_dim": 8, "max_position_embeddings": 262144, "mlp_only_layers": [], "model_type": "qwen3_next",
    "moe_intermediate_size": 24, "norm_topk_prob": True, "num_attention_heads": 4, "num_experts": 6,
    "num_experts_per_tok": 2, "num_hidden_layers": 4, "num_key_value_heads": 2, "output_router_logits": False,
    "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000000,
    "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 24, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.57.0.dev0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": VOCAB,
}

# Qwen/Qwen3-Coder-Next: as Qwen3-Next-80B-A3B, with layer_types written out beside full_attention_interval
QWEN3_CODER_NEXT = {
    key: value for key, value in QWEN3_NEXT_80B_A3B.items()
    if key not in ("attention_bias", "attention_dropout", "output_router_logits", "router_aux_loss_coef",
                   "torch_dtype", "transformers_version", "use_cache", "use_sliding_window")
} | {"layer_types": ["linear_attention"] * 3 + ["full_attention"], "rope_theta": 5000000}

# The Qwen3.5 / 3.6 releases are multimodal: the text tower's config is nested under text_config, with layer_types
# written out, RoPE in rope_parameters (interleaved M-RoPE sections; plain RoPE for text), and an MTP head.
_QWEN3_5_ROPE = {"mrope_interleaved": True, "mrope_section": [2, 1, 1], "rope_type": "default", "rope_theta": 10000000,
                 "partial_rotary_factor": 0.25}
_QWEN3_5_TEXT = {
    "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "dtype": "bfloat16",
    "eos_token_id": 152, "full_attention_interval": 4, "head_dim": 32, "hidden_act": "silu", "hidden_size": 64,
    "initializer_range": 0.02, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_value_head_dim": 8, "mamba_ssm_dtype": "float32", "max_position_embeddings": 262144,
    "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "num_attention_heads": 4,
    "num_hidden_layers": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "use_cache": True, "vocab_size": VOCAB,
    "rope_parameters": _QWEN3_5_ROPE,
}
_QWEN3_5_VISION = {
    "deepstack_visual_indexes": [], "depth": 1, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 16,
    "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 32, "num_heads": 2,
    "num_position_embeddings": 16, "out_hidden_size": 64, "patch_size": 4, "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
_QWEN3_5_RELEASE = {"image_token_id": 153, "transformers_version": "4.57.0.dev0", "video_token_id": 154,
                    "vision_end_token_id": 155, "vision_start_token_id": 156}
# Qwen/Qwen3.6-35B-A3B (as Qwen/Qwen3.5-35B-A3B): every layer sparse, shared expert, untied
QWEN3_6_35B_A3B = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
    "text_config": {**_QWEN3_5_TEXT, "mlp_only_layers": [], "model_type": "qwen3_5_moe_text",
                    "moe_intermediate_size": 24, "num_experts": 6, "num_experts_per_tok": 2,
                    "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 24},
    "tie_word_embeddings": False, "vision_config": {**_QWEN3_5_VISION, "model_type": "qwen3_5_moe"},
    **_QWEN3_5_RELEASE,
}
# Qwen/Qwen3.5-0.8B: dense SwiGLU, embeddings tied by the release's top-level field (text_config has none)
QWEN3_5_0_8B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
    "text_config": {**_QWEN3_5_TEXT, "intermediate_size": 96, "model_type": "qwen3_5_text"},
    "tie_word_embeddings": True, "vision_config": {**_QWEN3_5_VISION, "model_type": "qwen3_5"},
    **_QWEN3_5_RELEASE,
}

# meta-llama/Llama-3.2-1B-Instruct: head_dim set (64 = 2048 / 32), tied, three EOS ids, llama3 RoPE scaling
LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 150,
    "eos_token_id": [151, 152, 153], "head_dim": 16, "hidden_act": "silu", "hidden_size": 64,
    "initializer_range": 0.02, "intermediate_size": 96, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": VOCAB,
}
# HuggingFaceTB/SmolLM2-135M-Instruct: no head_dim, rope_scaling null
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 48, "initializer_range": 0.041666666666666664,
    "intermediate_size": 96, "is_llama_config": True, "max_position_embeddings": 8192, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 3, "num_hidden_layers": 2, "num_key_value_heads": 1,
    "pad_token_id": 2, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_interleaved": False, "rope_scaling": None,
    "rope_theta": 100000, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers.js_config": {},
    "transformers_version": "4.42.3", "use_cache": True, "vocab_size": VOCAB,
}

# checkpoint it is shaped after -> (--from, published config)
CASES = {
    "Qwen2.5-0.5B-Instruct": ("qwen2", QWEN2_5_0_5B),
    "Qwen2.5-7B-Instruct": ("qwen2", QWEN2_5_7B),
    "Qwen3-0.6B": ("qwen3", QWEN3_0_6B),
    "Qwen3-30B-A3B": ("qwen3_moe", QWEN3_30B_A3B),
    "Qwen3-Next-80B-A3B-Instruct": ("qwen3_next", QWEN3_NEXT_80B_A3B),
    "Qwen3-Coder-Next": ("qwen3_next", QWEN3_CODER_NEXT),
    "Qwen3.6-35B-A3B": ("qwen3_5_moe", QWEN3_6_35B_A3B),
    "Qwen3.5-0.8B": ("qwen3_5", QWEN3_5_0_8B),
    "Llama-3.2-1B-Instruct": ("llama", LLAMA_3_2_1B),
    "SmolLM2-135M-Instruct": ("llama", SMOLLM2_135M),
}


def reference_model(published: dict[str, Any]) -> torch.nn.Module:
    """The model transformers builds from `published`: its config class, the class `architectures` names."""
    import transformers
    from transformers import CONFIG_MAPPING

    config = CONFIG_MAPPING[published["model_type"]].from_dict(copy.deepcopy(published))
    torch.manual_seed(0)
    model = getattr(transformers, published["architectures"][0])(config).float()  # the file's dtype is bf16
    with torch.no_grad():  # random norms, biases, A_log, dt_bias: initial zeros / ones would hide mapping slips
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


def published_checkpoint(directory: Path, published: dict[str, Any]) -> torch.nn.Module:
    """Save a random reference model at `directory` with exactly the published config.json keys."""
    reference = reference_model(published)
    reference.save_pretrained(directory)
    (directory / "config.json").write_text(json.dumps(published, indent=2))
    return reference


def convert_published(tmp_path: Path, source_format: str, published: dict[str, Any]) -> CloverForBlockDiffusion:
    """Convert (through the command line) a random checkpoint of `published` and check its `block_size=1` logits
    against transformers' model of that config.json; returns the converted model."""
    reference = published_checkpoint(tmp_path / "hf", published)
    assert main(["convert", "--from", source_format, str(tmp_path / "hf"), str(tmp_path / "clover")]) == 0
    model = CloverForBlockDiffusion.from_pretrained(tmp_path / "clover")
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        got = model(ids, block_size=1).logits[..., : expected.shape[-1]]
    diff = (got - expected).abs().max().item()
    assert diff < ATOL, f"max |logits - reference| = {diff}"
    text = reference.config.get_text_config()
    assert model.config.head_dim == (getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    assert model.config.tie_word_embeddings == bool(reference.config.tie_word_embeddings)
    return model


@pytest.mark.parametrize("name", list(CASES))
def test_published_config_converts_to_the_reference(tmp_path: Path, name: str) -> None:
    source_format, published = CASES[name]
    convert_published(tmp_path, source_format, published)


def test_llama3_rope_scaling_is_transformers_at_long_positions() -> None:
    """At the few positions a logits test reaches, Llama 3's scaling changes nothing measurable (its scaled
    frequencies are the slow ones): compare the rotation itself out to 100k positions."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from clover.conversion.common import rope_settings
    from clover.model.rope import RotaryEmbedding

    hf = LlamaConfig.from_dict({**copy.deepcopy(LLAMA_3_2_1B), "head_dim": 64})
    rope = rope_settings(hf)
    assert rope["rope_scaling"] == {"rope_type": "llama3", **{k: v for k, v in LLAMA_3_2_1B["rope_scaling"].items()
                                                               if k != "rope_type"}}
    positions = torch.tensor([[0, 7, 4096, 8191, 50_000, 100_000]])
    cos, signed_sin = RotaryEmbedding(64, rope["rope_theta"], rope["rope_scaling"])(positions, torch.float32)
    want_cos, want_sin = LlamaRotaryEmbedding(hf)(torch.zeros(1), positions)
    torch.testing.assert_close(cos[:, 0], want_cos, atol=1e-5, rtol=0)
    sin = torch.cat((-signed_sin[..., :32], signed_sin[..., 32:]), dim=-1)  # Clover keeps [-sin | sin]
    torch.testing.assert_close(sin[:, 0], want_sin, atol=1e-5, rtol=0)
    plain_cos, _ = RotaryEmbedding(64, rope["rope_theta"])(positions, torch.float32)
    assert (plain_cos - cos).abs().max() > 0.1  # the scaling is there to be checked


@pytest.mark.parametrize("fields", [
    {"use_sliding_window": True, "max_window_layers": 2},  # every layer below max_window_layers: none slides
    {"use_sliding_window": False, "max_window_layers": 0},
], ids=["window_layers_cover_all", "window_off"])
def test_qwen2_sliding_window_that_slides_no_layer_converts(tmp_path: Path, fields: dict) -> None:
    convert_published(tmp_path, "qwen2", {**QWEN2_5_0_5B, **fields})


@pytest.mark.parametrize("source_format, published, message", [
    ("qwen2", {**QWEN2_5_0_5B, "use_sliding_window": True, "max_window_layers": 1},
     r"sliding-window attention on layers \[1\] \(sliding_window 32768"),
    ("qwen3", {**QWEN3_0_6B, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0},
     r"sliding-window attention on layers \[0, 1\] \(sliding_window 8"),
    ("qwen3_moe", {**QWEN3_30B_A3B, "use_sliding_window": True, "sliding_window": 8},
     r"use_sliding_window true, sliding_window 8"),
    ("qwen3", {**QWEN3_0_6B, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 32768}},
     r"unsupported RoPE scaling: rope_type 'yarn'"),
], ids=["qwen2_window", "qwen3_window", "qwen3_moe_window", "qwen3_yarn"])
def test_fields_clover_cannot_compute_are_refused_by_name(tmp_path: Path, source_format: str,
                                                          published: dict, message: str) -> None:
    published_checkpoint(tmp_path / "hf", published)
    with pytest.raises(ValueError, match=message):
        convert(source_format, tmp_path / "hf", tmp_path / "clover")
    assert not (tmp_path / "clover").exists()


def test_qwen3_moe_config_without_sparse_layers_is_a_dense_model(tmp_path: Path) -> None:
    model = convert_published(tmp_path, "qwen3_moe", {**QWEN3_30B_A3B, "mlp_only_layers": [0, 1]})
    assert (model.config.mlp_type, model.config.mlp_only_layers) == ("dense", [])


def test_multimodal_release_ties_by_its_top_level_field(tmp_path: Path) -> None:
    """Qwen3_5ForConditionalGeneration (the release's `architectures`) ties by the top-level field, whatever
    text_config says."""
    published = copy.deepcopy(QWEN3_5_0_8B)
    published["text_config"]["tie_word_embeddings"] = False
    assert convert_published(tmp_path, "qwen3_5", published).config.tie_word_embeddings is True
