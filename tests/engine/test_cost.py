"""The forward-cost table (clover.engine.cost): measured once per combination of model shape, weights' format,
kernels, runner, threads, software and processor, kept under $CLOVER_CACHE and read back; measured again when any of
them changes, or when the kept file cannot be read."""

from __future__ import annotations

import json

import pytest
import torch

from clover.engine import cost
from clover.model import quantize
from clover.ops import woq
from clover.runners.torch_runner import as_runner
from model_helpers import tiny_model


@pytest.fixture
def calibrations(monkeypatch, tmp_path):
    """Every calibration run, with a quick stand-in measurement (the real one is timed elsewhere), the tables kept
    in a cache of this test's own."""
    monkeypatch.setenv("CLOVER_CACHE", str(tmp_path))
    runs = []

    def calibrate(runner):
        runs.append(runner)
        return cost.ForwardCost([1, 2], [1e-3, 1.5e-3], key=cost.fingerprint(runner))

    monkeypatch.setattr(cost, "calibrate", calibrate)
    return runs


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
    assert len(calibrations) == 2 and table.rows == [1, 2]
    assert cost.ForwardCost(**json.loads(kept.read_text())) == table
