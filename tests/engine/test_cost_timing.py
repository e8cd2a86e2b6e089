"""How the cost table times each count of rows (clover.engine.drafts.cost: `time_forwards`, `off_the_curve`), on a
stand-in runner whose forwards advance a fake clock: no real timing, so the noise is exactly the test's."""

from __future__ import annotations

import random
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from clover.engine.drafts import cost

ROWS = list(cost.CALIBRATION_ROWS)
ROUNDS = 1 + cost.CALIBRATION_PASSES * cost.CALIBRATION_REPEATS  # the warm-up, then the passes


def truth(rows: int) -> float:
    """A MoE's forward: a fixed part and a part per row that shrinks as rows share experts (the twin's shape)."""
    return 0.040 + 0.012 * rows - 0.0002 * rows * rows


class FakeCache:
    def __init__(self) -> None:
        self.length, self.marked = 0, None

    def mark(self) -> None:
        self.marked = self.length

    def rewind(self, keep: torch.Tensor) -> None:
        self.length, self.marked = self.marked + int(keep[0]), None

    def select(self, rows: list[int]) -> None:
        pass


class ClockedRunner:
    """A runner whose timed forwards (logits kept) last `seconds(rows, n)` on its clock, `n` counting them."""

    name = "fake"
    device = torch.device("cpu")

    def __init__(self, seconds: Callable[[int, int], float]) -> None:
        self.seconds = seconds
        self.config = SimpleNamespace(vocab_size=1000, max_position_embeddings=4096, to_dict=lambda: {"fake": 1})
        self.now = 0.0
        self.timed: list[int] = []  # the rows of each timed forward, in order

    def new_cache(self, batch_size: int) -> FakeCache:
        return FakeCache()

    def forward(self, ids, block_size, cache, prefix_len, logits_at=None, logits_to_keep=None):
        if logits_at is not None:
            self.now += self.seconds(ids.shape[1], len(self.timed))
            self.timed.append(ids.shape[1])
        cache.length += ids.shape[1]

    def clock(self) -> float:
        return self.now


def table(seconds: Callable[[int, int], float]) -> tuple[cost.ForwardCost, ClockedRunner]:
    runner = ClockedRunner(seconds)
    return cost.calibrate(runner, clock=runner.clock), runner


def test_a_quiet_machine_gets_the_true_curve_in_a_bounded_number_of_forwards():
    got, runner = table(lambda rows, n: truth(rows))
    assert got.seconds == pytest.approx([truth(r) for r in ROWS])
    assert got.per_token == pytest.approx(0.0, abs=1e-12) and got.per_row_token == pytest.approx(0.0, abs=1e-12)
    # every count in each round at the short context, then 1 and 16 rows at the long one: nothing timed again
    assert len(runner.timed) == ROUNDS * (len(ROWS) + 2)


def test_a_count_slow_through_both_passes_is_timed_again_and_priced_by_the_curve():
    """Whatever slowed 4 rows (another process's work in step with the calibration's turns) lasted through both
    passes: 4 rows then sit above the line through 3 and 5 rows, are timed once more when it has passed, and are
    priced as they cost. (The fastest of five forwards, timed before, kept the slow stretch's 1.77x.)"""
    slow_until = ROUNDS * len(ROWS)  # the warm-up and both passes over the short context's counts
    got, runner = table(lambda rows, n: truth(rows) * (1.6 if rows == 4 and n < slow_until else 1.0))
    assert got(4) == pytest.approx(truth(4))
    assert cost.off_the_curve(got.rows, got.seconds) == []
    retimed = runner.timed[slow_until:-ROUNDS * 2]
    assert retimed == [4] * cost.CALIBRATION_REPEATS  # only the count off the curve


@pytest.mark.parametrize("fast", [0.5, 0.8])
def test_one_lucky_or_slow_forward_a_pass_moves_no_count(fast):
    """One forward of each count a pass out of line, either way (a lucky draw of experts, a slow moment): each
    pass's median ignores it. (The fastest of five kept every lucky forward: a count timed once at half its cost
    was priced at half.)"""
    per_pass = cost.CALIBRATION_REPEATS * len(ROWS)

    def seconds(rows: int, n: int) -> float:
        odd = (n - len(ROWS)) % per_pass == ROWS.index(rows)  # its count's first forward of each pass
        return truth(rows) * ((fast if rows % 2 else 3.0) if odd and n < ROUNDS * len(ROWS) else 1.0)

    got, _ = table(seconds)
    assert got.seconds == pytest.approx([truth(r) for r in ROWS])


def test_random_bursts_leave_a_table_on_its_curve_and_close_to_the_truth():
    """Bursts on a shared machine (a third of the forwards 10-100 % slower, at random): the table keeps the curve's
    shape (more rows never cheaper, no count above its neighbours' line) and is within 10 % of the truth."""
    rng = random.Random(0)
    got, runner = table(lambda rows, n: truth(rows) * (1 + rng.uniform(0.1, 1.0) * (rng.random() < 0.33)))
    assert cost.off_the_curve(got.rows, got.seconds) == [] and cost.implausibility(got) is None
    assert all(abs(t / truth(r) - 1) <= 0.10 for r, t in zip(ROWS, got.seconds))
    # bounded: at most one more pass over the short context's counts
    assert len(runner.timed) <= (ROUNDS + cost.CALIBRATION_REPEATS) * len(ROWS) + (ROUNDS + cost.CALIBRATION_REPEATS) * 2


def test_off_the_curve_flags_the_count_above_its_neighbours_not_the_twins_measured_curves():
    """The AVX2 twin run's own table (4 rows at 2.67x one where its verifying steps cost 1.89x) is flagged at 4
    rows; the twin's other measured tables (benchmarks/results/bench_hybrid*.json; the AVX-512 VNNI one and the
    AVX2 one of tests/engine/test_exact_mode.py), and the proportional and flat curves, are not."""
    mispriced = [1, 1.36, 1.51, 2.67, 2.88, 3.34, 3.78, 4.52, 4.94, 5.62, 7.2]
    assert cost.off_the_curve(ROWS, mispriced) == [4]
    for curve in ([20.4, 25.4, 29.9, 32.9, 39.8, 45.0, 50.4, 48.7, 59.5, 62.8, 85.6],
                  [40.62, 49.49, 65.59, 78.01, 93.27, 93.48, 116.27, 126.66, 160.5, 172.01, 218.36],
                  [1, 1.22, 1.61, 1.92, 2.3, 2.3, 2.86, 3.12, 3.95, 4.23, 5.38]):
        assert cost.off_the_curve(ROWS, curve) == []
    assert cost.off_the_curve(list(range(1, 17)), [float(r) for r in range(1, 17)]) == []
    assert cost.off_the_curve([1, 2], [1.0, 1.0]) == []
    assert cost.off_the_curve([1, 2, 3], [1.0, 0.7, 0.75]) == [1]  # dearer than more rows: the one above is suspect
