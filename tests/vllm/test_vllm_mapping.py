"""The mapping of a Clover checkpoint onto vLLM's own models, checked without vLLM: the translated config and
mapped tensors, loaded into transformers' model of the same architecture, give Clover's block-size-1 logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from model_helpers import base_and_gated, tiny_model

from clover.conversion.qwen3_next import split_ba, split_qkvz
from clover.serving.vllm.config import NotServable, architecture, check_checkpoint, transformers_config
from clover.serving.vllm.weights import causal_path_tensors, join_ba, join_qkvz

IDS = torch.tensor([[5, 17, 3, 99, 42, 7, 11, 8, 120, 64, 1, 2]])


def _hf_logits(model, hf_class) -> torch.Tensor:
    config = transformers_config(model.config)
    hf = hf_class(config).eval()
    state = dict(causal_path_tensors(model.state_dict().items(), model.config))
    if hasattr(hf.model.layers[0].mlp, "experts"):  # transformers keeps routed experts fused: stack them back
        for i, layer in enumerate(hf.model.layers):
            prefix, e = f"model.layers.{i}.mlp.experts.", model.config.num_experts
            if not hasattr(layer.mlp, "experts"):
                continue
            state[prefix + "gate_up_proj"] = torch.stack([torch.cat([state.pop(f"{prefix}{j}.gate_proj.weight"),
                                                                     state.pop(f"{prefix}{j}.up_proj.weight")])
                                                          for j in range(e)])
            state[prefix + "down_proj"] = torch.stack([state.pop(f"{prefix}{j}.down_proj.weight") for j in range(e)])
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if config.tie_word_embeddings:
        hf.tie_weights()
    with torch.no_grad():
        return hf(IDS).logits


@pytest.mark.parametrize("rope_scaling", [None, {
    "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8}], ids=["plain_rope", "llama3_rope"])  # short context: it shows at 12 tokens
def test_dense_causal_path_is_transformers_llama(rope_scaling) -> None:
    from transformers import LlamaForCausalLM

    model = tiny_model("clover-tiny-dense", head_dim=32, rope_scaling=rope_scaling)
    assert architecture(model.config) == "CloverLlamaForCausalLM"
    with torch.no_grad():
        want = model(IDS, block_size=1).logits
    torch.testing.assert_close(_hf_logits(model, LlamaForCausalLM), want, rtol=1e-4, atol=1e-4)


def test_gated_adapter_is_dropped_and_causal_path_kept() -> None:
    from transformers import LlamaForCausalLM

    base, gated = base_and_gated()
    names = dict(causal_path_tensors(gated.state_dict().items(), gated.config))
    assert not [n for n in names if n.endswith(("lora_A", "lora_B", "row_delta"))]
    with torch.no_grad():
        want = base(IDS, block_size=1).logits
    torch.testing.assert_close(_hf_logits(gated, LlamaForCausalLM), want, rtol=1e-4, atol=1e-4)


def test_hybrid_causal_path_is_transformers_qwen3_next() -> None:
    """Right conv (randomised, so its fold matters), memory calibration and fused experts, on Qwen3-Next."""
    from transformers import Qwen3NextForCausalLM

    model = tiny_model("clover-tiny")
    assert architecture(model.config) == "CloverQwen3NextForCausalLM"
    with torch.no_grad():
        want = model(IDS, block_size=1).logits
    torch.testing.assert_close(_hf_logits(model, Qwen3NextForCausalLM), want, rtol=1e-4, atol=1e-4)


def test_join_inverts_the_converters_split() -> None:
    hk, dk, hv, dv, hidden = 2, 3, 4, 5, 7
    qkvz, ba = torch.randn(2 * hk * dk + 2 * hv * dv, hidden), torch.randn(2 * hv, hidden)
    assert torch.equal(join_qkvz(*split_qkvz(qkvz, hk, dk, hv, dv), hk, dk), qkvz)
    assert torch.equal(join_ba(*split_ba(ba, hk, hv), hk), ba)


def test_a_family_without_token_shift_is_refused() -> None:
    config = dataclasses.replace(tiny_model("clover-tiny-dense").config, token_shift=False, family="sdar")
    with pytest.raises(NotServable, match="no causal"):
        architecture(config)


def test_quantised_build_and_ungated_adapter_are_refused(tmp_path) -> None:
    from clover.model.lora import apply_lora
    from clover.model.quant import quantize
    from clover.training.config import LoraConfig

    quantized = quantize(tiny_model("clover-tiny-dense", head_dim=32), "int8")
    quantized.save_pretrained(tmp_path / "q")
    with pytest.raises(NotServable, match="quantised"):
        check_checkpoint(tmp_path / "q")
    model = tiny_model("clover-tiny-dense", head_dim=32)
    apply_lora(model, LoraConfig(rank=2, extra_trainable=[]))
    model.save_pretrained(tmp_path / "a")
    with pytest.raises(NotServable, match="ungated adapter"):
        check_checkpoint(tmp_path / "a")
