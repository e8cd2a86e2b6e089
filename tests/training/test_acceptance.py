"""Teacher-forced draft acceptance: what exact decoding would accept, from one forward of the training layout."""

from __future__ import annotations

import pytest
import torch

from clover.training.acceptance import draft_acceptance

from model_helpers import base_and_gated

B = 4


def own_answer(model, prompt: list[int], blocks: int) -> list[int]:
    """A response decoding would draft exactly: block by block, the causal token at a block's first position and
    the drafts of a fully masked block after it (as exact decoding forms them, one forward per block)."""
    ids = list(prompt)
    mask = model.config.mask_token_id
    for _ in range(blocks):
        out = model(torch.tensor([ids]), B, prefix_len=len(prompt), query_ids=torch.full((1, B), mask))
        ids += [int(out.logits[0, -1].argmax())] + out.query_logits[0, :-1].argmax(-1).tolist()
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def gated():
    return base_and_gated()[1]


def test_a_models_own_drafts_are_all_accepted_and_a_wrong_token_ends_the_run(gated):
    prompts = [[5, 17, 3, 99, 42], [8, 120, 7]]
    answers = [own_answer(gated, p, 3) for p in prompts]
    docs = [(p + a, [False] * len(p) + [True] * len(a), len(p)) for p, a in zip(prompts, answers)]
    full = draft_acceptance(gated, docs, B, eos_token_id=None, pad_target="none", batch_size=1)
    assert full == {"blocks": 6, "accept": [1.0, 1.0, 1.0], "tokens_per_forward": 4.0,
                    "exact_tokens_per_forward": 4.0, "draft_accuracy": 1.0}

    # the last block's second draft replaced: that block accepts one draft (the third, though right, is not
    # reached); the other blocks read nothing of it
    wrong = list(docs[0][0])
    wrong[-2] = (wrong[-2] + 1) % 250
    docs[0] = (wrong, docs[0][1], docs[0][2])
    got = draft_acceptance(gated, docs, B, eos_token_id=None, pad_target="none", batch_size=2)
    runs = [3, 3, 1, 3, 3, 3]  # right drafts leading each block: the first document's last block stops at 1
    assert got["accept"] == pytest.approx([1.0, 5 / 6, 5 / 6])
    assert got["tokens_per_forward"] == pytest.approx(1 + sum(runs) / len(runs))
    assert got["draft_accuracy"] == pytest.approx(17 / 18)
    assert got["exact_tokens_per_forward"] == pytest.approx(pipelined_tokens_per_forward(runs, B))


def pipelined_tokens_per_forward(runs: list[int], block_size: int) -> float:
    """Exact decoding walked forward by forward over the blocks' runs, in turn (no closed form): a forward with
    drafts commits its accepted drafts and one causal token; its query block drafts the next block only when all
    of its own drafts were accepted, so after a miss one forward commits one token without drafts."""
    tokens = forwards = 0
    for run in runs:
        tokens, forwards = tokens + run + 1, forwards + 1
        if run < block_size - 1:
            tokens, forwards = tokens + 1, forwards + 1
    return tokens / forwards


def test_block_size_one_has_no_drafts(gated):
    with pytest.raises(ValueError, match="block_size >= 2"):
        draft_acceptance(gated, [([1, 2, 3], [False, True, True], 1)], 1, eos_token_id=None)
