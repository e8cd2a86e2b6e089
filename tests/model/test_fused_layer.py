"""The fused C++ decoder layer (clover.model.fused) computes what the module path computes: logits and cache, in
every layout a forward can have (AR, prefill + query blocks, cached block steps, commit + next block, left
padding, exact mode's rewind), for every weight format and with an adapter's correction; it runs only where it
applies."""

from __future__ import annotations

import copy

import pytest
import torch
from model_helpers import assert_close_up_to_activation_rounding, tiny_model

from clover.model import CloverForBlockDiffusion, quantize
from clover.model.quant import can_fuse
from clover.model.lora import LoraConfig, apply_lora
from clover.ops import woq


def _set_fused(model: CloverForBlockDiffusion, on: bool) -> None:
    for layer in model.model.layers:
        layer.fused = on and can_fuse(layer)


def _forwards(model: CloverForBlockDiffusion) -> list[torch.Tensor]:
    """Logits of every kind of forward, and the attention caches they leave."""
    gen = torch.Generator().manual_seed(0)
    ids, q = torch.randint(0, 250, (2, 23), generator=gen), torch.randint(0, 250, (2, 8), generator=gen)
    long = torch.randint(0, 250, (1, 45), generator=gen)  # past the loops' 32 rows: the SDPA path
    out = [model(long).logits, model(long[:, :20]).logits,  # causal, uncached
           model(ids, block_size=4, prefix_len=7, query_ids=q).query_logits]  # prefill + two query blocks
    mask = torch.ones(2, 23, dtype=torch.long)
    mask[0, :3] = 0  # left padding: an explicit mask with per-row columns
    cache = model.new_cache(2)
    out.append(model(ids, attention_mask=mask, cache=cache, logits_to_keep=1).logits)
    out.append(model(None, block_size=4, cache=cache, query_ids=q[:, :4]).query_logits)  # a block step
    out.append(model(q[:, :4], block_size=4, cache=cache, query_ids=q[:, 4:]).query_logits)  # commit + next block
    cache.mark()  # exact mode: feed four clean tokens, keep one of row 0's and three of row 1's
    out.append(model(q[:, 4:], block_size=1, cache=cache).logits)
    cache.rewind(torch.tensor([1, 3]))
    out.append(model(None, block_size=4, cache=cache, query_ids=q[:, :4]).query_logits)
    for layer in cache.layers:
        out.extend(layer.keys_values())
    return out


class _Portable:
    """The compiled extension with the fused layer's AVX2 paths off: its portable loops, which a CPU without AVX2
    (an ARM machine) runs."""

    def __init__(self, extension):
        self.extension = extension

    def __getattr__(self, name):
        return getattr(self.extension, name)

    def decoder_layers(self, *args):
        *head, _vector, gated_from = args
        return self.extension.decoder_layers(*head, False, gated_from)


@pytest.mark.parametrize("kind,adapter,activations", [
    ("fp32", False, None), ("bf16", False, None), ("int8", False, "int8"), ("int8", False, "int8x2"),
    ("int4", False, "int8"), ("int4", True, "int8x2")])
@pytest.mark.parametrize("overrides", [{}, {"partial_rotary_factor": 0.5}])
@torch.no_grad()
def test_fused_layer_equals_the_module_path(kind, adapter, activations, overrides):
    model = tiny_model("clover-tiny-dense", **overrides)
    if adapter:  # kept beside the quantised base as a low-rank correction, which the C++ layer adds too
        apply_lora(model, LoraConfig(rank=4, alpha=8.0))
        for name, param in model.named_parameters():
            if name.endswith("lora_B"):
                param.normal_(std=0.3)
    model = quantize(model, kind, activations=activations)
    assert all(layer.fused for layer in model.model.layers)
    want = _forwards(_unfused(model))
    got = _forwards(model)
    for w, g in zip(want, got, strict=True):  # the fp32 summation order of norms and attention differs
        if activations == "int8" and w.shape[-1] == model.config.vocab_size:
            assert_close_up_to_activation_rounding(g, w)
        elif activations == "int8":  # a later layer's keys / values, downstream of such a rounding step
            assert (g - w).abs().max() <= 0.01 * w.abs().max()
        elif activations == "int8x2":  # its steps are 254x finer (and one pass instead would be off by ~1 %)
            assert (g - w).abs().max() <= 1e-4 * w.abs().max()
        else:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * w.abs().max().item())


@pytest.mark.parametrize("kind,activations", [("fp32", None), ("int4", "int8x2")])
@torch.no_grad()
def test_the_portable_loops_equal_the_module_path(kind, activations, monkeypatch):
    model = quantize(tiny_model("clover-tiny-dense"), kind, activations=activations)
    want = _forwards(_unfused(model))
    monkeypatch.setattr(woq, "_extension", _Portable(woq.extension()))
    got = _forwards(model)
    for w, g in zip(want, got, strict=True):
        if activations == "int8x2":
            assert (g - w).abs().max() <= 1e-4 * w.abs().max()
        else:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * w.abs().max().item())


def _unfused(model: CloverForBlockDiffusion) -> CloverForBlockDiffusion:
    ref = copy.deepcopy(model)
    _set_fused(ref, False)
    return ref


@torch.no_grad()
def test_fused_generation_equals_the_module_path():
    model = quantize(tiny_model("clover-tiny-dense"), "int4")
    prompts = [[5, 17, 3, 99, 42, 7, 11], [8, 120]]
    want = _unfused(model).generate(prompts, max_new_tokens=24, threshold=0.7).sequences
    assert model.generate(prompts, max_new_tokens=24, threshold=0.7).sequences == want


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("portable", [False, True])
@torch.no_grad()
def test_a_step_of_several_tokens_equals_one_token_at_a_time_bit_for_bit(kind, portable, monkeypatch):
    """On integer weights every row's arithmetic is its own: the kernels round and multiply row by row, and the
    attention reads a kv head's keys once for all its queries (several heads, several positions) but computes each
    query's scores, softmax and sums in one fixed order. So verifying drafts in one forward gives exactly the logits
    of feeding them one at a time (exact mode's output then equals block size 1's, not just up to rounding), at
    context lengths past the loops' key chunks and not a multiple of their 8-key steps, and with a query block
    drafting after the verified tokens (its rows are masked from the clean ones); on the AVX2 path and the portable
    loops alike."""
    model = quantize(tiny_model("clover-tiny-dense"), kind, activations="int8x2")
    if portable:
        monkeypatch.setattr(woq, "_extension", _Portable(woq.extension()))
    gen = torch.Generator().manual_seed(0)
    context, step = torch.randint(0, 250, (1, 150), generator=gen), torch.randint(0, 250, (1, 5), generator=gen)
    alone, together, drafting = (model.new_cache(1) for _ in range(3))
    for cache in (alone, together, drafting):
        model(context, cache=cache, logits_to_keep=0)
    want = torch.cat([model(step[:, i:i + 1], cache=alone).logits for i in range(step.shape[1])], dim=1)
    assert torch.equal(model(step, cache=together).logits, want)
    masks = torch.full((1, 4), model.config.mask_token_id)
    at = torch.ones(1, 9, dtype=torch.bool)  # every clean position and every query position, as exact mode asks
    got = model(step, block_size=4, prefix_len=5, query_ids=masks, cache=drafting, logits_at=at).logits
    assert torch.equal(got[:5], want[0])


def test_only_layers_of_the_fused_form_are_marked(tmp_path):
    dense, hybrid = tiny_model("clover-tiny-dense"), tiny_model("clover-tiny")
    assert not any(layer.fused for layer in dense.model.layers)  # unquantised: torch's modules
    assert all(layer.fused for layer in quantize(dense, "int4").model.layers)
    # gated attention (q/k norm, output gate), DeltaNet and MoE layers keep the module path
    assert not any(layer.fused for layer in quantize(hybrid, "int4").model.layers)
    dense.save_pretrained(tmp_path / "q")
    assert all(layer.fused for layer in CloverForBlockDiffusion.from_pretrained(tmp_path / "q").model.layers)


@torch.no_grad()
def test_a_marked_layer_whose_projections_were_replaced_is_a_clear_error():
    """`fused` is set once, by `quantize`: a layer whose packed projection is swapped afterwards is refused with
    what to do, not run with modules the C++ layer cannot read; marking it again runs it on the module path."""
    model = quantize(tiny_model("clover-tiny-dense"), "int4")
    layer = model.model.layers[0]
    down = layer.mlp.down_proj
    layer.mlp.down_proj = torch.nn.Linear(down.in_features, down.out_features, bias=False)
    ids = torch.randint(0, 250, (1, 6))
    with pytest.raises(RuntimeError, match="no longer has packed projections.*can_fuse"):
        model(ids)
    layer.fused = can_fuse(layer)
    assert not layer.fused and model(ids).logits.isfinite().all()


@torch.no_grad()
def test_a_layer_with_a_hook_runs_the_fused_layers_one_call_each_with_the_same_logits():
    """The stack runs as one C++ call; a hook on a layer (which that call would skip) makes every layer its own
    call, and the results are bit for bit the stack's."""
    model = quantize(tiny_model("clover-tiny-dense"), "int4")
    ids = torch.randint(0, 250, (2, 11))
    cache = model.new_cache(2)
    want = [model(ids, cache=cache).logits, model(ids[:, :3], cache=cache).logits]
    seen = []
    model.model.layers[1].register_forward_hook(lambda module, args, out: seen.append(out.shape))
    cache = model.new_cache(2)
    got = [model(ids, cache=cache).logits, model(ids[:, :3], cache=cache).logits]
    assert seen == [(2, 11, model.config.hidden_size), (2, 3, model.config.hidden_size)]
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@torch.no_grad()
def test_the_stack_refuses_caches_of_different_lengths():
    """One call appends at one position in every layer: a cache whose layers disagree is an error, not keys and
    values written at the wrong place."""
    model = quantize(tiny_model("clover-tiny-dense"), "int4")
    cache = model.new_cache(1)
    model(torch.randint(0, 250, (1, 5)), cache=cache)
    cache.layers[1].length -= 1
    with pytest.raises(RuntimeError, match="different lengths"):
        model(torch.randint(0, 250, (1, 2)), cache=cache)


def test_autograd_and_other_dtypes_take_the_module_path(monkeypatch):
    from clover.model import modeling

    model = quantize(tiny_model("clover-tiny-dense"), "int4")
    model.model.embed_tokens.weight.requires_grad_(True)
    ids = torch.randint(0, 250, (1, 9))
    calls = []  # the layers of each fused call
    fused_layers = modeling.fused_layers
    monkeypatch.setattr(modeling, "fused_layers", lambda layers, *a: calls.append(len(layers)) or fused_layers(
        layers, *a))
    with torch.no_grad():
        want = model(ids).logits
    assert calls == [model.config.num_hidden_layers]  # the whole stack in one call
    got = model(ids).logits  # grad enabled and the embedding trainable: the modules, which autograd records
    assert calls == [model.config.num_hidden_layers]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    with torch.no_grad():
        assert model.to(torch.bfloat16)(ids).logits.dtype == torch.bfloat16  # bf16 activations: the modules
    assert calls == [model.config.num_hidden_layers]
