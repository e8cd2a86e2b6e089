"""`clover export --to gguf`: a dense Clover checkpoint -> llama GGUF -> `clover convert --from gguf` round trip.

At f32 the round trip is exact (weights, config, tokenizer, chat template, Clover's decoding defaults); quantised
exports come back within their format's error. A hybrid checkpoint exports as llama.cpp's qwen35moe (its runner's
tests: tests/runners/test_llamacpp_hybrid.py); what that architecture cannot compute is refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from server_helpers import build_checkpoint

from clover import CloverForBlockDiffusion
from clover.cli.main import main
from clover.conversion import convert
from clover.conversion.gguf_export import export_gguf
from clover.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, chat_tokenizer) -> Path:
    # threshold 0.7 / block 8: not the defaults, so the round trip must carry them
    return build_checkpoint(tmp_path_factory.mktemp("export") / "model", chat_tokenizer, threshold=0.7, block_size=8)


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_f32_export_round_trips_exactly(checkpoint: Path, tmp_path: Path) -> None:
    gguf_path = export_gguf(checkpoint, tmp_path / "model.gguf", "f32")
    back = convert("gguf", gguf_path, tmp_path / "back")
    original, restored = _weights(checkpoint), _weights(back)
    assert set(original) == set(restored)
    for name in original:
        assert torch.equal(original[name], restored[name]), name
    a, b = (json.loads((d / "config.json").read_text()) for d in (checkpoint, back))
    differing = {k for k in a if a[k] != b.get(k)}
    assert differing <= {"rms_norm_eps"}  # GGUF stores it as float32
    assert b["threshold"] == 0.7 and b["block_size"] == 8 and b["mask_token_id"] == a["mask_token_id"]
    ta, tb = load_tokenizer(checkpoint), load_tokenizer(back)
    text = "<|im_start|>user\nWhat is the weather in Paris? def add(x, y): 21<|im_end|><|mask|>"
    assert ta(text).input_ids == tb(text).input_ids
    assert tb.mask_token_id == ta.mask_token_id and tb.chat_template == ta.chat_template


@pytest.mark.parametrize("quant, rel_error", [("f16", 1e-3), ("q8_0", 1e-2), ("q4_0", 0.2)])
def test_quantised_export_is_within_its_formats_error(checkpoint: Path, tmp_path: Path, quant: str,
                                                      rel_error: float) -> None:
    back = convert("gguf", export_gguf(checkpoint, tmp_path / f"{quant}.gguf", quant), tmp_path / "back")
    original, restored = _weights(checkpoint), _weights(back)
    for name, w in original.items():
        error = (restored[name] - w).norm() / w.norm()
        assert error <= rel_error, f"{name}: relative error {error:.2e} > {rel_error}"
        if w.dim() == 1:  # norms stay fp32
            assert torch.equal(restored[name], w), name


def test_cli_exports_and_refuses_to_overwrite(checkpoint: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "m.gguf"
    assert main(["export", "--to", "gguf", str(checkpoint), str(out), "--quant", "q8_0"]) == 0
    assert out.is_file() and not list(tmp_path.glob(".m.gguf.tmp-*"))
    assert main(["export", str(checkpoint), str(out)]) == 2
    assert "already exists" in capsys.readouterr().err


@pytest.mark.parametrize("overrides, reason", [
    ({"linear_value_head_dim": 32}, "key and value head dims differ"),
    ({"norm_topk_prob": False}, "norm_topk_prob false"),
    ({"mlp_only_layers": [1], "intermediate_size": 64}, r"layers \[1\] are dense inside a MoE model"),
    ({"shared_expert_intermediate_size": 0}, "no shared expert"),
    ({"layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"]},
     "layer pattern"),
])
def test_what_llama_cpps_qwen35moe_cannot_compute_is_refused_by_name(tmp_path: Path, chat_tokenizer, overrides,
                                                                     reason) -> None:
    """A hybrid exports as llama.cpp's qwen35moe (tests/runners/test_llamacpp_hybrid.py); a setting that
    architecture cannot compute exactly is refused, naming it, and nothing is written."""
    hybrid = build_checkpoint(tmp_path / "hybrid", chat_tokenizer, preset="clover-tiny", **overrides)
    with pytest.raises(ValueError, match=f"llama.cpp's qwen35moe: .*{reason}"):
        export_gguf(hybrid, tmp_path / "h.gguf")
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".h.gguf*"))


def test_unknown_quantisation_is_refused(checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown quantisation 'q3'"):
        export_gguf(checkpoint, tmp_path / "m.gguf", "q3")


def test_unrecognised_pre_tokenizer_asks_for_a_name(checkpoint: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(checkpoint, copy)
    spec = json.loads((copy / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Whitespace"}
    (copy / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="--tokenizer-pre"):
        export_gguf(copy, tmp_path / "m.gguf")
    assert export_gguf(copy, tmp_path / "m.gguf", tokenizer_pre="gpt-2").is_file()


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_a_stored_adapter_is_merged_or_refused_when_gated(checkpoint: Path, tmp_path: Path, gated: bool) -> None:
    """A GGUF holds merged weights: a plain adapter saved beside the weights is merged into them; a gated one
    (query positions only) cannot be, and is refused by name, or with `drop_gated_adapter` left out: the file is
    the base, the gated model's causal path."""
    from clover import CloverForBlockDiffusion
    from clover.model.lora import LoraConfig, apply_lora, merge_and_unload

    model = CloverForBlockDiffusion.from_pretrained(checkpoint)
    apply_lora(model, LoraConfig(rank=2, gated=gated, extra_trainable=[]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2)
    model.save_pretrained(tmp_path / "adapted", tokenizer_dir=checkpoint)
    if gated:
        with pytest.raises(ValueError, match="adapter is gated"):
            export_gguf(tmp_path / "adapted", tmp_path / "m.gguf", "f32")
        assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".m.gguf*"))
        causal = export_gguf(tmp_path / "adapted", tmp_path / "m.gguf", "f32", drop_gated_adapter=True)
        restored, base = _weights(convert("gguf", causal, tmp_path / "back")), _weights(checkpoint)
        assert restored.keys() == base.keys() and all(torch.equal(restored[k], base[k]) for k in base)
        return
    back = convert("gguf", export_gguf(tmp_path / "adapted", tmp_path / "m.gguf", "f32"), tmp_path / "back")
    merged = merge_and_unload(model).state_dict()
    restored = _weights(back)
    assert all(torch.equal(restored[k], merged[k]) for k in restored)
    assert any(not torch.equal(restored[k], v) for k, v in _weights(checkpoint).items())  # the adapter is in


def test_q4_k_is_refused_for_a_model_without_experts(checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="q4_k quantises a MoE model's routed experts: this checkpoint has none"):
        export_gguf(checkpoint, tmp_path / "m.gguf", "q4_k")
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".m.gguf*"))


# Llama 3's scaling with a short original context, so that it changes the rotation at a test's few positions
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def test_llama3_rope_scaling_is_exported_as_rope_freqs_and_read_back(tmp_path: Path, chat_tokenizer) -> None:
    import gguf

    from clover.model.rope import rope_freq_factors

    checkpoint = build_checkpoint(tmp_path / "model", chat_tokenizer, rope_scaling=LLAMA3_ROPE)
    gguf_path = export_gguf(checkpoint, tmp_path / "model.gguf", "f32")
    freqs = next(t for t in gguf.GGUFReader(str(gguf_path)).tensors if t.name == "rope_freqs.weight")
    factors = rope_freq_factors(16, 10000.0, LLAMA3_ROPE)
    # the highest frequency kept, two interpolated, the low ones divided by `factor`
    assert factors[0] == 1.0 and 1.0 < factors[1] < factors[2] < 4.0 and (factors[3:] == 4.0).all()
    torch.testing.assert_close(torch.from_numpy(freqs.data.copy()), factors, rtol=0, atol=0)
    back = convert("gguf", gguf_path, tmp_path / "back")
    assert json.loads((back / "config.json").read_text())["rope_scaling"] == LLAMA3_ROPE
    ids = torch.randint(0, 200, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = CloverForBlockDiffusion.from_pretrained(checkpoint)(ids, block_size=1).logits
        got = CloverForBlockDiffusion.from_pretrained(back)(ids, block_size=1).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
