"""Gated adapters: LoRA and the [MASK] row act at query positions only, so the clean stream (the causal path) is
exactly the base model; saving keeps them unmerged; training reads the clean stream causally and frozen."""

from __future__ import annotations

import copy

import pytest
import torch

from clover import CloverConfig, CloverForBlockDiffusion
from clover.model.layout import BlockLayout
from clover.training.config import LoraConfig, NoiseConfig
from clover.model.lora import (adapters_disabled, apply_lora, is_gated, merge_and_unload, merge_lora,
                                  save_adapter, load_adapter)
from clover.training.batches import collate
from clover.training.objective import bd3_loss, reference_block_loss, sample_noise
from clover.smol import adapted_model, weights_checksum

from model_helpers import base_and_gated

MASK = 255


def ids(n: int = 2, t: int = 11, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 250, (n, t), generator=torch.Generator().manual_seed(seed))


def test_causal_context_reading_layout_reads_clean_tokens_causally():
    layout = BlockLayout(clean_len=6, block_size=2, prefix_len=2, query_blocks=2, query_start=2, causal_clean=True)
    mask, _ = layout.attention_mask(None, None, 1, torch.device("cpu"))
    clean = mask[0, 0, :6, :6]
    assert torch.equal(clean, torch.ones(6, 6, dtype=torch.bool).tril())  # no look-ahead inside a clean block
    assert torch.equal(mask[0, 0, 8, :6], torch.tensor([1, 1, 1, 1, 0, 0], dtype=torch.bool))  # query block 1
    assert layout.attention_mask(None, None, 1, torch.device("cpu")) is not None
    assert BlockLayout(6, 2, 2, causal_clean=True).attention_mask(None, None, 1, torch.device("cpu")) == (None, True)


@pytest.mark.parametrize("preset", ["clover-tiny-dense", "clover-tiny"])
def test_gated_model_clean_stream_is_exactly_the_base(preset):
    base, model = base_and_gated(preset)
    assert is_gated(model) and model.config.context_reading == "causal"
    x = ids()
    with torch.no_grad():
        want = base(x, block_size=1).logits
        assert torch.equal(model(x, block_size=1).logits, want)
        # a block size does not change how a causal-reading model reads committed context
        assert torch.equal(model(x, block_size=4, prefix_len=3).logits, want)
        # clean tokens + a query block after them (a decoding step): the clean logits are the base's
        query = torch.full((2, 4), MASK)
        out = model(x, block_size=4, prefix_len=3, query_ids=query)
        assert torch.allclose(out.logits, want, atol=1e-5, rtol=0)
        with adapters_disabled(model):
            plain = model(x, block_size=4, prefix_len=3, query_ids=query).query_logits
        assert (out.query_logits - plain).abs().max() > 1e-3  # the adapter (and [MASK] row) act on queries


def test_a_cache_holds_the_base_models_keys():
    """Committed tokens go through the base weights: cached decoding of a gated model = the base's AR logits."""
    base, model = base_and_gated()
    x = ids(1, 9)
    cache = model.new_cache(1)
    with torch.no_grad():
        model(x[:, :5], block_size=1, cache=cache)
        out = model(x[:, 5:], block_size=4, cache=cache, query_ids=torch.full((1, 4), MASK))
        want = base(x, block_size=1).logits[:, 5:]
    assert torch.allclose(out.logits, want, atol=1e-5, rtol=0)


def test_gated_adapter_cannot_be_merged():
    _, model = base_and_gated()
    for merge in (merge_lora, merge_and_unload):
        with pytest.raises(ValueError, match="cannot be merged"):
            merge(model)


def test_gated_adapter_refuses_extra_trainable_base_parameters():
    torch.manual_seed(0)
    model = CloverForBlockDiffusion(CloverConfig.from_preset("clover-tiny"))
    with pytest.raises(ValueError, match="extra_trainable"):
        apply_lora(model, LoraConfig(rank=2, gated=True))


def test_save_and_load_restore_the_gated_adapter(tmp_path):
    _, model = base_and_gated()
    model.save_pretrained(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "adapter_config.json").is_file()
    loaded = CloverForBlockDiffusion.from_pretrained(tmp_path / "ckpt")
    assert is_gated(loaded) and loaded.config.context_reading == "causal"
    assert weights_checksum(loaded) == weights_checksum(model)
    x, query = ids(), torch.full((2, 4), MASK)
    with torch.no_grad():
        a = model(x, 4, prefix_len=3, query_ids=query)
        b = loaded(x, 4, prefix_len=3, query_ids=query)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.query_logits, b.query_logits)


def test_adapter_directory_records_gating_and_adapted_model_keeps_it_unmerged(tmp_path, monkeypatch):
    base, model = base_and_gated()
    save_adapter(model, tmp_path / "adapter", model.lora_config)
    fresh = copy.deepcopy(base)
    load_adapter(fresh, tmp_path / "adapter")
    assert is_gated(fresh) and fresh.config.context_reading == "causal"
    base.save_pretrained(tmp_path / "base")
    monkeypatch.setattr("clover.smol.base_dir", lambda: tmp_path / "base")
    built = adapted_model(tmp_path / "adapter", block_size=4, threshold=0.8)
    assert is_gated(built) and built.config.block_size == 4
    with torch.no_grad():
        assert torch.equal(built(ids(), 1).logits, base(ids(), 1).logits)


def gated_batch():
    from tests.training_helpers import documents

    return collate(documents(3, seed=4), 4, mask_token_id=MASK, seeds=[5, 6, 7])


def test_gated_training_loss_equals_block_by_block_decoding_layout():
    """The vectorised loss with causally read clean tokens equals one decoding-shaped forward per block."""
    _, model = base_and_gated()
    batch = gated_batch()
    noise = sample_noise(batch, 4, NoiseConfig(complementary=True))
    loss, metrics = bd3_loss(model, batch, 4, noise, confidence_weight=0.5)
    ref, ref_metrics = reference_block_loss(model, batch, 4, noise, confidence_weight=0.5)
    assert abs(loss.item() - ref.item()) < 1e-5
    assert abs(metrics["confidence_sum"] - ref_metrics["confidence_sum"]) < 1e-4


def test_gated_training_gradients_reach_only_the_adapter_and_survive_checkpointing():
    _, model = base_and_gated()
    model.train()
    batch = gated_batch()
    noise = sample_noise(batch, 4, NoiseConfig())
    grads = []
    for checkpointing in (False, True):
        model.gradient_checkpointing = checkpointing
        model.zero_grad()
        # the AR term's second (causal, query-free) forward runs before backward: recomputed layers must
        # re-open the gate with the first forward's split
        loss, _ = bd3_loss(model, batch, 4, noise, ar_weight=1.0)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert set(grads[0]) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert all("lora_" in n or "row_delta" in n for n in grads[0])
    for name, g in grads[0].items():
        assert torch.allclose(g, grads[1][name], atol=1e-6, rtol=1e-5), name


def test_deltanet_refuses_causal_reading_in_the_training_layout():
    _, model = base_and_gated("clover-tiny")
    batch = gated_batch()
    with pytest.raises(ValueError, match="attention layers only"):
        bd3_loss(model, batch, 4, NoiseConfig())


def test_one_token_per_forward_decoding_of_a_gated_model_is_the_bases_greedy_output():
    """With B = 1 every token is predicted from the committed context alone, which the base reads: the gated
    model decodes exactly what the base decodes (the property exact mode extends to drafted blocks)."""
    from clover.engine import generate

    base, model = base_and_gated()
    prompts = [[5, 17, 33, 2], [9, 101, 7]]
    want = generate(base, prompts, max_new_tokens=12, block_size=1, threshold=1.0).sequences
    got = generate(model, prompts, max_new_tokens=12, block_size=1, threshold=1.0).sequences
    assert got == want and all(len(s) for s in want)


@pytest.mark.parametrize("block_size", [4, 8])
def test_exact_mode_of_a_gated_model_is_the_bases_greedy_output(block_size):
    """Exact mode verifies drafts with the causal path, which a gated model reads with the base weights: at any
    block size its output is the base model's own greedy output (the adapter changes only the drafts)."""
    from clover.engine import generate

    base, model = base_and_gated()
    prompts = [[5, 17, 33, 2], [9, 101, 7, 44, 60, 3]]
    want = generate(base, prompts, max_new_tokens=20, block_size=1, threshold=1.0).sequences
    got = generate(model, prompts, max_new_tokens=20, block_size=block_size, rule="exact")
    assert got.sequences == want and all(len(s) >= 10 for s in want)
    assert all(s["forward_passes"] <= len(seq) + 1 for s, seq in zip(got.stats, want))


# -- quantised: the corrections gated at the query rows -----------------------------------------------------------
@torch.no_grad()
def test_a_quantised_gated_model_is_the_quantised_base_at_clean_rows_and_the_adapter_at_query_rows(tmp_path):
    """`quantize` keeps a gated adapter as corrections the kernels add at query rows only: with fp32 packing (exact
    weights), the clean stream is the base's to rounding and the query stream the gated model's to the
    correction's fp16; the fused C++ layers compute what the module path computes; and the quantised checkpoint
    loads gated again."""
    from clover.model import quantize
    from clover.model.quant import PackedLinear

    base, model = base_and_gated("clover-tiny-dense")
    packed = quantize(copy.deepcopy(model), "fp32")
    assert packed.quantization["gated"] and is_gated(packed)
    assert all(m.gate is packed.adapter_gate for m in packed.modules() if isinstance(m, PackedLinear) and m.rank)
    x, q = ids(2, 9), torch.full((2, 4), 255)
    clean = packed(x, 4, prefix_len=9, query_ids=q)
    want = model(x, 4, prefix_len=9, query_ids=q)
    scale = want.query_logits.abs().max().item()
    # the [MASK] row is merged into the (tied) table: its logit, banned from every choice, is the one that moves
    keep = torch.arange(model.config.vocab_size) != model.config.mask_token_id
    torch.testing.assert_close(clean.logits[..., keep], base(x).logits[..., keep], rtol=1e-4, atol=1e-4 * scale)
    torch.testing.assert_close(clean.query_logits[..., keep], want.query_logits[..., keep], rtol=1e-2,
                               atol=2e-3 * scale)
    assert (want.query_logits - base(x, 4, prefix_len=9, query_ids=q).query_logits).abs().max() > 0.05 * scale
    assert all(layer.fused for layer in packed.model.layers)
    for layer in packed.model.layers:  # the module path: PackedLinear with its gate, layer by layer
        layer.fused = False
    modules = packed(x, 4, prefix_len=9, query_ids=q)
    torch.testing.assert_close(modules.query_logits, clean.query_logits, rtol=1e-4, atol=1e-4 * scale)
    torch.testing.assert_close(modules.logits, clean.logits, rtol=1e-4, atol=1e-4 * scale)
    for layer in packed.model.layers:
        layer.fused = True
    packed.save_pretrained(tmp_path / "packed")
    loaded = CloverForBlockDiffusion.from_pretrained(tmp_path / "packed")
    assert loaded.quantization["gated"] and is_gated(loaded)
    again = loaded(x, 4, prefix_len=9, query_ids=q)
    assert torch.equal(again.query_logits, clean.query_logits) and torch.equal(again.logits, clean.logits)


def test_exact_mode_of_a_quantised_gated_model_is_the_quantised_bases_greedy_output():
    from clover.engine import generate
    from clover.model import quantize

    base, model = base_and_gated("clover-tiny-dense")
    prompts = [[5, 9, 2, 7, 1], [3, 3, 8]]
    want = generate(quantize(copy.deepcopy(base), "int4"), prompts, max_new_tokens=20, block_size=1,
                    eos_token_ids=[]).sequences
    packed = quantize(model, "int4")
    got = generate(packed, prompts, max_new_tokens=20, block_size=4, rule="exact", rule_options={"adaptive": False},
                   eos_token_ids=[]).sequences
    assert got == want
