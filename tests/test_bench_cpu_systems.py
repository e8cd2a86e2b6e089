"""The pure parts of benchmarks/bench_cpu_systems.py: how per-prompt records become the reported figures."""

from __future__ import annotations

import pytest
from script_helpers import ROOT, load_script



@pytest.fixture(scope="module")
def bench():
    return load_script(ROOT / "benchmarks" / "bench_cpu_systems.py", "bench_cpu_systems")


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


def test_the_markdown_tables_keep_their_width_with_a_skipped_system(bench):
    figs = {"tokens": 8, "forward_passes": 4, "tokens_per_forward": 2.0, "tokens_per_second": 10.0,
            "decode_tokens_per_second": 12.0, "time_to_first_token_s": 0.1, "wall_s": 0.8}
    report = {
        "config": {"threads": 2, "decode_sizes": [1, 4]},
        "machine": {"cpu": "test CPU", "cores": 2, "simd": "avx2", "load_average_at_start": [0.1, 0.1, 0.1],
                    "xllamacpp": "0", "torch": "0", "transformers": "0"},
        "prompts": {"chat": 1, "tools_heldout": 1},
        "systems": {"clover-torch/b4": {"status": "ok", "peak_rss_mib": 900.0, "all": figs,
                                        "sets": {"chat": figs, "tools_heldout": figs},
                                        "quality": {"agree_ar": 1.0, "tool_call_exact_match": 0.5}},
                    "clover-llamacpp/q4_0/b4": {"status": "skipped", "reason": "no runner"}},
        "aims": {"q4_0": {"tools_speedup": 1.3, "code_speedup": None, "b1_ratio": 0.95, "tool_prompts_vs_b1": -1.0,
                          "humaneval_prompts_vs_b1": None}},
        "decode_cost": {"clover-q4_0": {"ms": {"1": 10.0, "4": 20.0}, "breakeven_tpf": {"1": 1.0, "4": 2.0}},
                        "base-q4_1": {"reason": "failed to load"}},
    }
    text = bench.markdown(report)
    tables: list[list[str]] = []
    for line in text.splitlines():
        if line.startswith("|"):
            if not tables or not tables[-1]:
                tables.append([])
            tables[-1].append(line)
        elif tables and tables[-1]:
            tables.append([])
    tables = [t for t in tables if t]
    assert len(tables) == 4  # systems, per set, aims, decode cost
    for table in tables:
        assert len({row.count("|") for row in table}) == 1, table
    assert "clover-llamacpp/q4_0/b4: skipped, no runner" in text
    assert "| 10.0 (1.00) | 20.0 (2.00) |" in text and "| 1.30 | – | 0.95 | -1, – |" in text
