"""The pure parts of benchmarks/bench_cpu_systems.py: how per-prompt records become the reported figures."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_cpu_systems.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_cpu_systems", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_figures_pool_prompts_and_rate_decoding_after_the_first_output(bench):
    # block decoding: 8 tokens in 2 forwards, the first block of 4 after 1 s; then 4 tokens in 3 s
    records = [{"ids": list(range(8)), "wall_s": 4.0, "ttft_s": 1.0, "forwards": 2, "first": 4},
               {"ids": [1, 2], "wall_s": 1.0, "ttft_s": 0.5, "forwards": 1, "first": 2}]
    f = bench.figures(records)
    assert f["tokens"] == 10 and f["forward_passes"] == 3
    assert f["tokens_per_second"] == pytest.approx(10 / 5)
    assert f["decode_tokens_per_second"] == pytest.approx(4 / (3.0 + 0.5))  # tokens after the first output
    assert f["time_to_first_token_s"] == pytest.approx(0.75)
    assert f["tokens_per_forward"] == pytest.approx(10 / 3)


def test_an_answer_of_one_block_has_no_decode_rate(bench):
    f = bench.figures([{"ids": [5, 6], "wall_s": 1.0, "ttft_s": 1.0, "forwards": 1, "first": 2}])
    assert f["decode_tokens_per_second"] is None


def test_pooled_quality_weights_sets_by_their_prompts(bench):
    per_set = {"chat": {"agree_ar": 1.0}, "tools_heldout": {"agree_ar": 0.5, "tool_call_exact_match": 1.0},
               "tools_live_simple": {"agree_ar": 0.5, "tool_call_exact_match": 0.0}}
    q = bench.pooled_quality(per_set, {"chat": 2, "tools_heldout": 1, "tools_live_simple": 3})
    assert q["agree_ar"] == pytest.approx((2 * 1.0 + 0.5 + 3 * 0.5) / 6)
    assert q["tool_call_exact_match"] == pytest.approx(1 / 4)
    assert "pass_at_1" not in q
