"""The chunked and block-bidirectional delta-rule ops against their slow, obvious references."""

import pytest
import torch

from clover.ops.delta_rule import block_bidirectional_read, chunk_gated_delta_rule, l2norm, recurrent_gated_delta_rule
from clover.ops.delta_rule_naive import naive_block_bidirectional_read


def _inputs(n=2, h=3, t=37, dk=8, dv=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(n, h, t, dk, generator=gen)) * dk ** -0.5
    k = l2norm(torch.randn(n, h, t, dk, generator=gen))
    v = torch.randn(n, h, t, dv, generator=gen)
    g = -torch.rand(n, h, t, generator=gen)
    beta = torch.rand(n, h, t, generator=gen)
    state = torch.randn(n, h, dk, dv, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("chunk", [1, 4, 16, 64])
def test_chunked_rule_equals_recurrence(chunk):
    q, k, v, g, beta, s0 = _inputs()
    ref_out, ref_state = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    out, state, states = chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk_size=chunk, chunk_states=True)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, ref_state, atol=1e-5, rtol=1e-5)
    # states[c] is the state before chunk c: re-running the recurrence up to there gives it
    c = (q.shape[2] - 1) // chunk
    _, prefix_state = recurrent_gated_delta_rule(q[:, :, : c * chunk], k[:, :, : c * chunk], v[:, :, : c * chunk],
                                                 g[:, :, : c * chunk], beta[:, :, : c * chunk], s0)
    torch.testing.assert_close(states[:, :, c], prefix_state, atol=1e-5, rtol=1e-5)


def test_state_only_chunk_matches_full():
    q, k, v, g, beta, s0 = _inputs()
    _, full_state, _ = chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk_size=8)
    out, state, _ = chunk_gated_delta_rule(None, k, v, g, beta, s0, chunk_size=8)
    assert out is None
    torch.testing.assert_close(state, full_state)


def test_block_read_equals_naive_formula():
    q, k, v, g, beta, s0 = _inputs(t=15)
    bsz, nb = 5, 3
    _, _, states = chunk_gated_delta_rule(None, k, v, g, beta, s0, chunk_size=bsz, chunk_states=True)
    scale = torch.rand(3)[None, :, None] + 0.5
    blocks = [x.reshape(*x.shape[:2], nb, bsz, -1) for x in (q, k, v)]
    out = block_bidirectional_read(*blocks, g.reshape(2, 3, nb, bsz), beta.reshape(2, 3, nb, bsz), states, scale)
    for j in range(nb):
        sl = slice(j * bsz, (j + 1) * bsz)
        ref = naive_block_bidirectional_read(q[:, :, sl], k[:, :, sl], v[:, :, sl], g[:, :, sl], beta[:, :, sl],
                                             states[:, :, j], scale[..., 0])
        torch.testing.assert_close(out[:, :, j], ref, atol=1e-5, rtol=1e-5)


def test_block_of_one_token_is_the_causal_rule():
    q, k, v, g, beta, s0 = _inputs()
    ref, _ = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    _, _, states = chunk_gated_delta_rule(None, k, v, g, beta, s0, chunk_size=1, chunk_states=True)
    one = [x[:, :, :, None] for x in (q, k, v)]
    out = block_bidirectional_read(*one, g[..., None], beta[..., None], states, torch.ones(1, 1, 1))
    torch.testing.assert_close(out[:, :, :, 0], ref, atol=1e-5, rtol=1e-5)


def test_block_read_is_bidirectional_and_history_is_causal():
    q, k, v, g, beta, s0 = _inputs(t=8)
    args = lambda vv: ([x.reshape(2, 3, 2, 4, -1) for x in (q, k, vv)], g.reshape(2, 3, 2, 4), beta.reshape(2, 3, 2, 4))
    _, _, states = chunk_gated_delta_rule(None, k, v, g, beta, s0, chunk_size=4, chunk_states=True)
    blocks, gg, bb = args(v)
    base = block_bidirectional_read(*blocks, gg, bb, states, torch.ones(1, 1, 1))
    v2 = v.clone()
    v2[:, :, 3] += 1.0  # last token of block 0
    blocks, gg, bb = args(v2)
    changed = block_bidirectional_read(*blocks, gg, bb, states, torch.ones(1, 1, 1))
    assert (changed[:, :, 0, 0] - base[:, :, 0, 0]).abs().max() > 1e-3  # the block's first token reads it
