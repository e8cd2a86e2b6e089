"""The batch sampler: greedy and seeded sampling, filters, penalties, and the confidence rules read."""

from __future__ import annotations

import pytest
import torch

from clover.engine import RequestOptions, SamplingParams
from clover.engine.sampling import BatchSampler


def test_greedy_sampler_is_argmax_with_softmax_confidence_and_bans() -> None:
    logits = torch.randn(2, 3, 10)
    logits[0, 0, 9] = 50.0  # the mask id would win
    logits[1, 1, 8] = 50.0  # an id past the tokenizer's vocabulary would win
    sampler = BatchSampler([SamplingParams()] * 2, 10, banned=[9, 8])
    tokens, conf = sampler(logits)
    ref = logits.clone()
    ref[..., 8:] = float("-inf")
    probs = ref.softmax(-1)
    assert torch.equal(tokens, probs.argmax(-1))
    torch.testing.assert_close(conf, probs.max(-1).values)
    assert not torch.isin(tokens, torch.tensor([8, 9])).any()


def test_repetition_penalty_lowers_seen_tokens() -> None:
    logits = torch.tensor([[[2.0, 1.9, -1.0, -1.1]]])
    sampler = BatchSampler([SamplingParams(repetition_penalty=1.5)], 4, banned=[])
    assert sampler(logits)[0].item() == 0
    sampler.observe([[0]])
    assert sampler(logits)[0].item() == 1  # 2.0 / 1.5 < 1.9
    sampler.observe_block(torch.tensor([[1]]), torch.tensor([[True]]))
    assert sampler(logits)[0].item() == 0  # both seen: 1.33 > 1.27
    logits = torch.tensor([[[-1.0, -1.2, -5.0, -5.0]]])
    sampler = BatchSampler([SamplingParams(repetition_penalty=1.5)], 4, banned=[])
    sampler.observe([[0]])
    assert sampler(logits)[0].item() == 1  # negative logits are multiplied: -1.5 < -1.2


def test_seeded_sampling_is_reproducible_and_row_independent() -> None:
    logits = torch.randn(3, 4, 50)
    params = [SamplingParams(temperature=1.0, seed=1), SamplingParams(), SamplingParams(temperature=1.0, seed=2)]
    a = BatchSampler(params, 50, banned=[])(logits)[0]
    b = BatchSampler(params, 50, banned=[])(logits)[0]
    assert torch.equal(a, b)
    alone = BatchSampler([params[2]], 50, banned=[])(logits[2:])[0]
    assert torch.equal(alone[0], a[2])
    assert torch.equal(a[1], logits[1].argmax(-1))  # the greedy row in a sampled batch
    # a row that sits a step out draws nothing: its candidates are the argmax, and its next draw is unchanged
    skip = BatchSampler(params, 50, banned=[])
    out = skip(logits.clone(), draw=torch.tensor([[True] * 4, [True] * 4, [False] * 4]))[0]
    assert torch.equal(out[2], logits[2].argmax(-1)) and torch.equal(out[0], a[0])
    assert torch.equal(skip(logits)[0][2], a[2])


def test_a_draw_is_keyed_by_answer_position_and_step_not_by_draws_so_far() -> None:
    """The noise of a seeded row is a function of (seed, answer position, step): the same distribution at the
    same answer position gives the same token whichever column holds it and whatever was drawn before; another
    step or another seed draws anew."""
    logits = torch.randn(1, 1, 40).expand(1, 64, 40).contiguous()  # one distribution at every column
    params = [SamplingParams(temperature=1.0, seed=5)]
    sampler = BatchSampler(params, 40, banned=[])
    base = sampler(logits.clone())[0][0]  # answer positions 0..63
    shifted = sampler(logits.clone(), positions=[10])[0][0]  # answer positions 10..73
    assert torch.equal(shifted[:54], base[10:])
    assert len(set(base.tolist())) > 5  # the positions draw independently
    assert not torch.equal(sampler(logits.clone(), steps=[1])[0][0], base)
    assert not torch.equal(BatchSampler([SamplingParams(temperature=1.0, seed=6)], 40, banned=[])(logits.clone())[0][0],
                           base)
    # an unseeded row draws fresh randomness: two samplers disagree
    fresh = [BatchSampler([SamplingParams(temperature=1.0)], 40, banned=[])(logits.clone())[0][0] for _ in range(2)]
    assert not torch.equal(fresh[0], fresh[1])


def test_sampling_follows_the_distribution_and_filters() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))[None, None].expand(1, 4000, 4).clone()
    tokens, conf = BatchSampler([SamplingParams(temperature=1.0, seed=0)], 4, banned=[])(logits)
    freq = torch.bincount(tokens[0], minlength=4).float() / 4000
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03, rtol=0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    torch.testing.assert_close(conf, probs[tokens])  # confidence: the drawn token's probability
    tokens, conf = BatchSampler([SamplingParams(temperature=1.0, top_k=2, seed=0)], 4, banned=[])(logits)
    assert set(tokens.unique().tolist()) == {0, 1}
    torch.testing.assert_close(conf, probs[tokens])  # the model's probability, not the filtered renormalised one
    # a top_k beyond the vocabulary (even beyond int64) keeps every token, as top_k = 0 does
    for big in (4, 2**64):
        tokens_all, _ = BatchSampler([SamplingParams(temperature=1.0, top_k=big, seed=0)], 4, banned=[])(logits)
        assert torch.equal(tokens_all, BatchSampler([SamplingParams(temperature=1.0, seed=0)], 4, banned=[])(logits)[0])
    tokens, _ = BatchSampler([SamplingParams(temperature=1.0, top_p=0.7, seed=0)], 4, banned=[])(logits)
    assert set(tokens.unique().tolist()) == {0, 1}  # 0.5 + 0.3 covers 0.7
    tokens, _ = BatchSampler([SamplingParams(temperature=1.0, top_p=0.01, seed=0)], 4, banned=[])(logits)
    assert set(tokens.unique().tolist()) == {0}


def test_confidence_is_the_untempered_probability_of_the_candidate() -> None:
    """Temperature shapes the draw, not the confidence: the threshold reads the model's probability of the token
    the step would commit (softmax of the penalised logits), not the tempered maximum (0.5 ** 2 / 0.365 at
    temperature 0.5 here; 0.5 for any draw at temperature 2)."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None, None].expand(3, 500, 4).clone()
    params = [SamplingParams(temperature=0.5, seed=0), SamplingParams(temperature=2.0, seed=1), SamplingParams()]
    tokens, conf = BatchSampler(params, 4, banned=[])(logits)
    assert set(tokens[1].unique().tolist()) == {0, 1, 2, 3} and (tokens[2] == 0).all()
    torch.testing.assert_close(conf, probs[tokens])
    penalised = BatchSampler([SamplingParams(temperature=0.5, repetition_penalty=2.0, seed=0)], 4, banned=[])
    penalised.observe([[0]])  # token 0 seen: its logit log(0.5) < 0 is doubled, so it now has 0.25 / 0.75
    tokens, conf = penalised(probs.log()[None, None].clone())
    model = torch.tensor([0.25, 0.3, 0.15, 0.05]) / 0.75
    torch.testing.assert_close(conf[0, 0], model[tokens[0, 0]])


def test_sampling_params_validation() -> None:
    for kwargs, name in [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -1}, "top_k"),
                         ({"repetition_penalty": 0}, "repetition_penalty"), ({"stop": [""]}, "stop")]:
        with pytest.raises(ValueError, match=name):
            RequestOptions.of(**kwargs)
    assert RequestOptions.of(stop="</s>").stop == ("</s>",)


# -- detokenizer --------------------------------------------------------------------------------------------
