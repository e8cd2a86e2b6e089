"""Unmasking rules on hand-made tensors (no model): the contract every rule keeps, and each rule's own choice."""

from __future__ import annotations

import pytest
import torch

from clover.engine import RULES, UnmaskingRule, make_rule


def _random_case(seed: int, n: int = 6, b: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 4, (n, b), generator=g)  # few ids: adjacent repeats are common
    confidence = torch.rand(n, b, generator=g)
    masked = torch.rand(n, b, generator=g) < 0.7
    masked[0] = False  # a row with nothing left
    masked[1] = True
    return tokens, confidence, masked


@pytest.mark.parametrize("name", sorted(n for n, rule in RULES.items() if issubclass(rule, UnmaskingRule)))
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


def test_sub_blocks_fill_the_leftmost_sub_block_with_masks_first() -> None:
    confidence = torch.tensor([[0.30, 0.95, 0.99, 0.99, 0.99, 0.99],
                               [0.99, 0.20, 0.50, 0.99, 0.95, 0.10],
                               [0.99, 0.99, 0.99, 0.99, 0.99, 0.99]])
    masked = torch.tensor([[True, True, True, True, True, True],
                           [False, False, True, True, True, True],
                           [False, False, False, False, False, False]])
    accept = make_rule("sub_blocks", threshold=0.9, size=2).select(torch.zeros(3, 6, dtype=torch.long), confidence,
                                                                    masked)
    # row 0: sub-block {0, 1} only (0.95, not the 0.99s right of it); row 1: sub-block {0, 1} is full, so {2, 3}:
    # 0.99 and nothing else; row 2: nothing masked, nothing accepted
    assert accept.tolist() == [[False, True, False, False, False, False],
                               [False, False, False, True, False, False],
                               [False] * 6]
    whole = make_rule("sub_blocks", threshold=0.9, size=6).select(torch.zeros(3, 6, dtype=torch.long), confidence,
                                                                  masked)
    plain = make_rule("threshold", threshold=0.9).select(torch.zeros(3, 6, dtype=torch.long), confidence, masked)
    assert torch.equal(whole, plain)


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
    with pytest.raises(ValueError, match="size must be"):
        make_rule("sub_blocks", size=0)
    rule = make_rule("threshold", threshold=0.3)
    assert make_rule(rule) is rule and isinstance(rule, UnmaskingRule) and rule.threshold == 0.3
    assert make_rule("top_k_per_step", threshold=0.5).k == 2  # a threshold is ignored by rules without one


# -- sampler ------------------------------------------------------------------------------------------------
