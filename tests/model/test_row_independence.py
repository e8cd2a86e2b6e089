"""A row's bits do not depend on the rows beside it in a forward of the int4 hybrid (Gated DeltaNet, gated attention,
the grouped MoE): exact mode verifies `k` drafts in one forward and its tokens must be block size 1's, near-ties
included. Causal rows after a cache, with or without a query block after them, in a left-padded batch or alone, give
the logits one-token forwards give, bit for bit."""

from __future__ import annotations

import pytest
import torch
from model_helpers import tiny_model

from clover.model.quant import quantize


@pytest.fixture(scope="module")
def model():
    return quantize(tiny_model("clover-tiny", logit_scale=1.0), "int4")


def _prefilled(model, ids: torch.Tensor, valid: torch.Tensor, upto: int):
    cache = model.new_cache(ids.shape[0])
    model(ids[:, :upto], cache=cache, attention_mask=valid[:, :upto])
    return cache


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("query", [0, 4])
@torch.no_grad()
def test_causal_rows_get_the_bits_of_one_token_forwards(model, padded, query):
    ids = torch.randint(0, 250, (2, 14))
    valid = torch.ones_like(ids, dtype=torch.bool)
    if padded:  # the second row's prompt is shorter: left padding in the cache
        valid[1, :3] = False
    cache = _prefilled(model, ids, valid, 8)
    masks = torch.full((2, query), model.config.mask_token_id) if query else None
    out = model(ids[:, 8:], cache=cache, prefix_len=6, block_size=max(query, 1), query_ids=masks)
    cache = _prefilled(model, ids, valid, 8)
    alone = torch.cat([model(ids[:, t : t + 1], cache=cache).logits for t in range(8, 14)], 1)
    assert torch.equal(out.logits, alone)


@torch.no_grad()
def test_a_prompt_read_beside_a_query_block_gets_the_bits_it_gets_alone(model):
    """Exact mode's first forward: the prompt's rows and a query block after them (block size 1: the prompt alone)."""
    ids = torch.randint(0, 250, (2, 9))
    masks = torch.full((2, 4), model.config.mask_token_id)
    with_query = model(ids, cache=model.new_cache(2), prefix_len=9, block_size=4, query_ids=masks).logits
    assert torch.equal(with_query, model(ids, cache=model.new_cache(2)).logits)


@pytest.mark.parametrize("keep", [0, 2, 5])
@torch.no_grad()
def test_a_rewound_step_leaves_the_bits_of_its_kept_tokens_stepped_alone(model, keep):
    """Exact mode rejects drafts: the cache keeps the first tokens of a forward (DeltaNet's state replayed by the
    same C++ steps), and the next forward's logits are those after one-token forwards of the kept ones. (In a batch
    whose rows keep different counts, the cache's holes are masked out of attention: other sums, not this test.)"""
    ids = torch.randint(0, 250, (1, 16))
    valid = torch.ones_like(ids, dtype=torch.bool)
    cache = _prefilled(model, ids, valid, 8)
    cache.mark()
    model(ids[:, 8:14], cache=cache)
    cache.rewind(torch.tensor([keep + 1]))
    alone = _prefilled(model, ids, valid, 8)
    for t in range(8, 9 + keep):
        model(ids[:, t : t + 1], cache=alone)
    states = [(a.state, b.state) for a, b in zip(cache.layers, alone.layers) if hasattr(a, "state")]
    assert states and all(torch.equal(a, b) for a, b in states)
    assert torch.equal(model(ids[:, 14:15], cache=cache).logits, model(ids[:, 14:15], cache=alone).logits)


@torch.no_grad()
def test_rows_that_keep_different_counts_get_the_states_of_their_kept_steps(model):
    """A batch's rows reject their drafts at different places: each row's DeltaNet state and conv window after the
    rewind are those of stepping its own kept tokens alone (the C++ step kept the state after each token)."""
    ids = torch.randint(0, 250, (3, 14))
    valid = torch.ones_like(ids, dtype=torch.bool)
    cache = _prefilled(model, ids, valid, 8)
    cache.mark()
    model(ids[:, 8:14], cache=cache)
    keep = [1, 6, 3]
    cache.rewind(torch.tensor(keep))
    for r, kept in enumerate(keep):
        alone = _prefilled(model, ids, valid, 8)  # the same prefill (a batch's prompt rows may round otherwise)
        alone.select([r])
        for t in range(8, 8 + kept):
            model(ids[r : r + 1, t : t + 1], cache=alone)
        layers = [(a, b) for a, b in zip(cache.layers, alone.layers) if hasattr(a, "state")]
        assert layers
        for a, b in layers:
            assert torch.equal(a.state[r], b.state[0]) and torch.equal(a.conv[r], b.conv[0])
