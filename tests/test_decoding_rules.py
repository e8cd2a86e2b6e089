"""Unmasking rules, the sampler and incremental detokenisation, on hand-made tensors (no model)."""

from __future__ import annotations

import pytest
import torch

from clover.engine import RULES, IncrementalDetokenizer, SamplingParams, UnmaskingRule, make_rule
from clover.engine.sampling import BatchSampler


def _random_case(seed: int, n: int = 6, b: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 4, (n, b), generator=g)  # few ids: adjacent repeats are common
    confidence = torch.rand(n, b, generator=g)
    masked = torch.rand(n, b, generator=g) < 0.7
    masked[0] = False  # a row with nothing left
    masked[1] = True
    return tokens, confidence, masked


@pytest.mark.parametrize("name", sorted(RULES))
@pytest.mark.parametrize("seed", range(5))
def test_every_rule_accepts_a_nonempty_subset_of_masked(name: str, seed: int) -> None:
    tokens, confidence, masked = _random_case(seed)
    accept = make_rule(name, threshold=0.6).select(tokens, confidence, masked)
    assert accept.dtype == torch.bool and accept.shape == masked.shape
    assert not (accept & ~masked).any(), "accepted a position that was not masked"
    assert torch.equal(accept.any(1), masked.any(1)), "a row with masks must accept at least one; others none"


def test_threshold_accepts_all_confident_and_always_the_best() -> None:
    confidence = torch.tensor([[0.95, 0.20, 0.91, 0.50], [0.30, 0.10, 0.40, 0.20]])
    masked = torch.tensor([[True, True, True, True], [True, True, False, True]])
    accept = make_rule("threshold", threshold=0.9).select(torch.zeros(2, 4, dtype=torch.long), confidence, masked)
    assert accept.tolist() == [[True, False, True, False], [True, False, False, False]]  # row 1: best masked only


def test_threshold_one_is_one_token_per_step() -> None:
    confidence = torch.ones(3, 5)
    accept = make_rule("threshold", threshold=1.0).select(torch.zeros(3, 5, dtype=torch.long), confidence * 0.999,
                                                          torch.ones(3, 5, dtype=torch.bool))
    assert accept.sum(1).tolist() == [1, 1, 1]


def test_product_threshold_bounds_the_product_of_a_steps_confidences() -> None:
    confidence = torch.tensor([[0.96, 0.97, 0.20, 0.95], [0.99, 0.50, 0.98, 0.999], [0.60, 0.70, 0.10, 0.40]])
    masked = torch.tensor([[True, True, True, True], [True, True, False, True], [True, True, True, True]])
    accept = make_rule("product_threshold", threshold=0.9).select(torch.zeros(3, 4, dtype=torch.long), confidence,
                                                                  masked)
    # row 0: 0.97 * 0.96 = 0.93 passes, * 0.95 = 0.88 does not (the per-position rule would take all three);
    # row 1: 0.999 * 0.99 passes, position 2 (0.98) is not masked; row 2: only the best
    assert accept.tolist() == [[True, True, False, False], [True, False, False, True], [False, True, False, False]]
    plain = make_rule("threshold", threshold=0.9).select(torch.zeros(3, 4, dtype=torch.long), confidence, masked)
    assert plain[0].sum() == 3


def test_left_to_right_fills_a_run_from_the_leftmost_masked_position() -> None:
    confidence = torch.tensor([[0.30, 0.95, 0.50, 0.99], [0.99, 0.95, 0.97, 0.20], [0.99, 0.92, 0.91, 0.93]])
    masked = torch.tensor([[True, True, True, True], [False, True, False, True], [False, False, True, True]])
    accept = make_rule("left_to_right", threshold=0.9).select(torch.zeros(3, 4, dtype=torch.long), confidence,
                                                                masked)
    # row 0: the leftmost always, then 0.95; 0.50 waits, so 0.99 right of it waits too;
    # row 1: the run passes over decided position 2 and stops at 0.20; row 2: the run reaches the end
    assert accept.tolist() == [[True, True, False, False], [False, True, False, False], [False, False, True, True]]


def test_top_k_per_step_fills_exactly_k() -> None:
    tokens, confidence, masked = _random_case(0)
    accept = make_rule("top_k_per_step", k=3).select(tokens, confidence, masked)
    assert accept.sum(1).tolist() == masked.sum(1).clamp(max=3).tolist()
    best3 = confidence[1].topk(3).indices
    assert accept[1, best3].all()


def test_no_adjacent_repeat_refuses_a_duplicate_of_a_new_neighbour() -> None:
    tokens = torch.tensor([[7, 7, 7, 3, 3, 5]])
    confidence = torch.tensor([[0.99, 0.98, 0.97, 0.96, 0.95, 0.2]])
    masked = torch.ones(1, 6, dtype=torch.bool)
    plain = make_rule("threshold", threshold=0.9).select(tokens, confidence, masked)
    guarded = make_rule("no_adjacent_repeat", threshold=0.9).select(tokens, confidence, masked)
    assert plain.tolist() == [[True, True, True, True, True, False]]
    assert guarded.tolist() == [[True, False, False, True, False, False]]


def test_no_adjacent_repeat_ignores_neighbours_decided_in_earlier_steps() -> None:
    tokens = torch.tensor([[7, 7, 4]])
    masked = torch.tensor([[False, True, True]])  # position 0 was filled before this step
    accept = make_rule("no_adjacent_repeat", threshold=0.5).select(tokens, torch.full((1, 3), 0.9), masked)
    assert accept.tolist() == [[False, True, True]]


def test_rule_registry_errors_and_instances() -> None:
    with pytest.raises(ValueError, match="unknown unmasking rule 'nope'.*threshold"):
        make_rule("nope")
    with pytest.raises(ValueError, match="unknown"):
        make_rule("threshold", k=3)
    with pytest.raises(ValueError, match="threshold must be in"):
        make_rule("threshold", threshold=0.0)
    with pytest.raises(ValueError, match="k must be"):
        make_rule("top_k_per_step", k=0)
    rule = make_rule("threshold", threshold=0.3)
    assert make_rule(rule) is rule and isinstance(rule, UnmaskingRule) and rule.threshold == 0.3
    assert make_rule("top_k_per_step", threshold=0.5).k == 2  # a threshold is ignored by rules without one


# -- sampler ------------------------------------------------------------------------------------------------
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
    # a row that sits a step out draws nothing, so its next draw is the same as if that step never happened
    skip = BatchSampler(params, 50, banned=[])
    skip(logits, active=torch.tensor([True, True, False]))
    assert torch.equal(skip(logits)[0][2], a[2])


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
            SamplingParams(**kwargs)
    assert SamplingParams(stop="</s>").stop == ("</s>",)


# -- detokenizer --------------------------------------------------------------------------------------------
def test_incremental_detokenizer_waits_for_whole_characters() -> None:
    data = "héllo wörld ✓".encode()
    decode = lambda ids: bytes(ids).decode("utf-8", errors="replace")  # noqa: E731  byte-level "tokenizer"
    detok = IncrementalDetokenizer(decode)
    pieces = [detok.push(list(data[i : i + 3])) for i in range(0, len(data), 3)]
    pieces.append(detok.flush())
    assert "".join(pieces) == "héllo wörld ✓"
    assert all("\ufffd" not in p for p in pieces)
