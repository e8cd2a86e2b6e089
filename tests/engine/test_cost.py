"""The forward-cost table (clover.engine.drafts.cost): measured once per combination of model shape, weights' format,
kernels, runner, threads, software and processor, kept under $CLOVER_CACHE and read back; measured again when any of
them changes, or when the kept file cannot be read, contradicts itself or is old. And the measurement itself, for
real, on a small model."""

from __future__ import annotations

import json
import time

import pytest
import torch

from clover.engine.drafts import cost
from clover.model import quantize
from clover.ops import woq
from clover.engine.runner import as_runner
from model_helpers import tiny_model


@pytest.fixture
def calibrations(monkeypatch, tmp_path):
    """Every calibration run, with a quick stand-in measurement (the real one is tested on its own below; a
    test may queue the seconds of the next ones in `runs.seconds`), the tables kept in a cache of this test's
    own."""
    monkeypatch.setenv("CLOVER_CACHE", str(tmp_path))
    runs = Calibrations()

    def calibrate(runner):
        runs.append(runner)
        seconds = runs.seconds.pop(0) if runs.seconds else [1e-3, 1.5e-3, 2e-3]
        return cost.ForwardCost([1, 2, 3], seconds, key=cost.fingerprint(runner), measured_at=time.time())

    monkeypatch.setattr(cost, "calibrate", calibrate)
    return runs


class Calibrations(list):
    seconds: list[list[float]]

    def __init__(self) -> None:
        super().__init__()
        self.seconds = []


def kept_table(root) -> tuple:
    (path,) = (root / "costs").glob("*.json")
    return path, json.loads(path.read_text())


def test_a_combination_is_measured_once_and_read_back(calibrations):
    runner = as_runner(tiny_model("clover-tiny-dense"))
    first = cost.cost_table(runner)
    again = cost.cost_table(as_runner(tiny_model("clover-tiny-dense")))  # another process's view: the kept file
    assert len(calibrations) == 1 and again == first
    cost.cost_table(runner, recalibrate=True)
    assert len(calibrations) == 2


def test_another_format_kernel_or_thread_count_is_measured_anew(calibrations, monkeypatch):
    model = tiny_model("clover-tiny-dense")
    cost.cost_table(as_runner(model))
    packed = as_runner(quantize(model, "int4"))
    cost.cost_table(packed)
    assert len(calibrations) == 2  # the weights' format
    cost.cost_table(packed)
    assert len(calibrations) == 2
    monkeypatch.setattr(woq, "kernel_tag", lambda: "rebuilt")  # the kernels' sources changed
    cost.cost_table(packed)
    assert len(calibrations) == 3
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        cost.cost_table(packed)
    finally:
        torch.set_num_threads(threads)
    assert len(calibrations) == 4


def test_an_unreadable_kept_table_is_measured_again(calibrations):
    runner = as_runner(tiny_model("clover-tiny-dense"))
    cost.cost_table(runner)
    kept = next((cost.cache_root() / "costs").glob("*.json"))
    kept.write_text('{"rows": [1], "seconds"')  # torn
    table = cost.cost_table(runner)
    assert len(calibrations) == 2 and table.rows == [1, 2, 3]
    assert cost.ForwardCost(**json.loads(kept.read_text())) == table
    assert [p.name for p in kept.parent.iterdir()] == [kept.name]  # no temporary left beside it


@pytest.mark.parametrize("ms", [[878, 501, 471], [28, 783, 85]])  # two tables found in a real cache
def test_a_kept_table_that_contradicts_itself_is_measured_again(calibrations, ms):
    runner = as_runner(tiny_model("clover-tiny-dense"))
    cost.cost_table(runner)
    path, data = kept_table(cost.cache_root())
    path.write_text(json.dumps({**data, "seconds": [m / 1e3 for m in ms]}))
    assert cost.implausibility(cost.ForwardCost(**json.loads(path.read_text()))) is not None
    table = cost.cost_table(runner)
    assert len(calibrations) == 2 and table.seconds == [1e-3, 1.5e-3, 2e-3]
    assert kept_table(cost.cache_root())[1]["seconds"] == table.seconds


def test_an_old_table_or_one_without_its_date_is_measured_again(calibrations):
    runner = as_runner(tiny_model("clover-tiny-dense"))
    cost.cost_table(runner)
    path, data = kept_table(cost.cache_root())
    path.write_text(json.dumps({**data, "measured_at": time.time() - cost.MAX_AGE_S + 60}))
    cost.cost_table(runner)
    assert len(calibrations) == 1  # a minute younger than the limit: trusted
    path.write_text(json.dumps({**data, "measured_at": time.time() - cost.MAX_AGE_S - 60}))
    cost.cost_table(runner)
    assert len(calibrations) == 2
    del data["measured_at"]  # a table kept before tables were dated
    path.write_text(json.dumps(data))
    cost.cost_table(runner)
    assert len(calibrations) == 3 and kept_table(cost.cache_root())[1]["measured_at"] > time.time() - 60


def test_a_calibration_that_contradicts_itself_is_measured_again_and_never_kept(calibrations):
    runner = as_runner(tiny_model("clover-tiny-dense"))
    calibrations.seconds = [[0.878, 0.501, 0.471], [1e-3, 1.2e-3, 1.4e-3]]
    assert cost.cost_table(runner).seconds == [1e-3, 1.2e-3, 1.4e-3]  # the second, plausible one
    assert len(calibrations) == 2 and kept_table(cost.cache_root())[1]["seconds"] == [1e-3, 1.2e-3, 1.4e-3]
    calibrations.seconds = [[0.878, 0.501, 0.471], [0.028, 0.783, 0.085]]
    table = cost.cost_table(runner, recalibrate=True)
    assert len(calibrations) == 4 and table.seconds == [0.028, 0.783, 0.085]  # used by this process...
    assert kept_table(cost.cache_root())[1]["seconds"] == [1e-3, 1.2e-3, 1.4e-3]  # ...but not kept


def test_implausibility_allows_timing_noise_and_batching_gains():
    assert cost.implausibility(cost.ForwardCost([1, 2, 3], [0.0110, 0.0105, 0.0130])) is None  # 5 % noise
    assert cost.implausibility(cost.ForwardCost([1, 2, 16], [0.011, 0.030, 0.054])) is None  # a one-row fast path
    assert cost.implausibility(cost.ForwardCost.flat()) is None  # rows free (a GPU)
    assert cost.implausibility(cost.ForwardCost.proportional(16)) is None  # rows cost their count
    assert "less than 1 rows" in cost.implausibility(cost.ForwardCost([1, 2, 3], [0.878, 0.501, 0.471]))
    assert "more than 2 x 2 times 1 rows" in cost.implausibility(cost.ForwardCost([1, 2, 3], [0.028, 0.783, 0.085]))


def test_the_real_calibration_is_positive_grows_with_rows_and_rewinds_after_each_forward(monkeypatch, request):
    """The measurement itself (no stand-in), on a small dense model whose LM head makes a row cost clearly more
    than nothing (16k vocabulary: ~4 M multiply-adds a row): every time positive, 16 rows clearly dearer than 1
    and no count cheaper than 1; every timed forward starts from the same cached context (the forward before it
    was rewound). The table need not grow with every row: it is what the machine does, and this model's fp32
    forward of 2-3 rows has been slower than of 4-16 on one thread of an AVX-512 EPYC, calibration after
    calibration."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # threads that wait on each other at every op time a loaded machine's scheduling
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    runner = as_runner(tiny_model("clover-tiny-dense", vocab_size=16384, hidden_size=256, intermediate_size=512))
    starts: dict[int, set[int]] = {}
    forward = runner.forward

    def recorded(ids, *args, cache, **kwargs):
        if kwargs.get("logits_at") is not None:  # a timed forward (the context's prefill keeps no logits)
            starts.setdefault(ids.shape[1], set()).add(cache.length)
        return forward(ids, *args, cache=cache, **kwargs)

    monkeypatch.setattr(runner, "forward", recorded)
    table = cost.calibrate(runner)
    long = cost.LONG_CONTEXT
    assert sorted(starts) == list(cost.CALIBRATION_ROWS)
    for rows, lengths in starts.items():  # 1 and 16 rows are timed at both context lengths, the others at L0
        assert lengths == ({cost.SHORT_CONTEXT, long} if rows in (1, 16) else {cost.SHORT_CONTEXT}), (rows, lengths)
    assert table.rows == list(cost.CALIBRATION_ROWS) and min(table.seconds) > 0
    assert table.per_token >= 0 and table.per_row_token >= 0 and table(16, long) >= table(16)
    assert table.seconds[-1] > 1.5 * table.seconds[0] and min(table.seconds[1:]) > 0.9 * table.seconds[0]
    assert table.key == cost.fingerprint(runner) and time.time() - 60 < table.measured_at <= time.time()


def test_a_first_engine_decodes_on_the_shape_prior_and_measures_when_idle(calibrations):
    """Nothing kept: the first answer's tokens come before any calibration (the shape prior decides), the table is
    measured once the engine is idle and kept; the next engine reads it and measures nothing."""
    from clover.engine import Engine, SamplingParams

    runner = as_runner(tiny_model("clover-tiny-dense"))
    engine = Engine(runner, 4, rule="exact")
    events = engine.run([[5, 6, 7, 8]], 12, SamplingParams())
    next(events)
    assert not calibrations and engine.loop.cost.key["kind"] == "prior"
    list(events)
    assert len(calibrations) == 1 and engine.loop.cost == cost.kept_table(runner)
    again = Engine(runner, 4, rule="exact")
    list(again.run([[5, 6, 7, 8]], 4, SamplingParams()))
    assert len(calibrations) == 1 and again.loop.cost == engine.loop.cost


def test_the_shape_prior_is_plausible_and_grows_with_rows_and_experts(tmp_path):
    """Rows cost more, never implausibly; a GGUF's experts: one row reads its chosen few, many rows most of them,
    so a MoE's prior is cheaper at one row and dearer per row than a dense model of the same bytes."""
    from types import SimpleNamespace

    from clover.conversion.gguf_header import GGUFHeader

    runner = as_runner(tiny_model("clover-tiny-dense"))
    prior = cost.shape_prior(runner)
    assert cost.implausibility(prior) is None and prior.rows == list(cost.CALIBRATION_ROWS)
    assert all(a < b for a, b in zip(prior.seconds, prior.seconds[1:])) and prior.key["kind"] == "prior"
    (tmp_path / "m.gguf").write_bytes(bytes(2**20))

    def gguf(tensors, metadata):
        return SimpleNamespace(name="llamacpp", device=torch.device("cpu"), threads=2, config=runner.config,
                               path=tmp_path / "m.gguf", _header=GGUFHeader({"general.architecture": "x", **metadata},
                                                                            tensors))

    dense = cost.shape_prior(gguf({"blk.0.ffn_up.weight": (1024, 1024)}, {}))
    moe = cost.shape_prior(gguf({"blk.0.ffn_up_exps.weight": (1024, 64, 16), "blk.0.attn_q.weight": (64, 1024)},
                                {"x.expert_count": 16, "x.expert_used_count": 2}))
    assert cost.implausibility(moe) is None and moe.seconds[0] < dense.seconds[0] / 2
    assert moe.seconds[4] / moe.seconds[0] > dense.seconds[4] / dense.seconds[0]
