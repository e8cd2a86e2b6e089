"""benchmarks/bench_hybrid.py's figures that need no timing: where int4 parts from fp32 against fp32's margins, and
the 35B projection from a twin's bytes a token (a tiny int4 hybrid stands in for the twin)."""

from __future__ import annotations

import pytest
import torch

from clover.model import quantize
from model_helpers import tiny_model
from script_helpers import ROOT, load_script

bench = load_script(ROOT / "benchmarks" / "bench_hybrid.py", "bench_hybrid")


def _parting_at(fp32: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """fp32's logits, except that its second token wins at `positions`."""
    out = fp32.clone()
    rows = torch.tensor(positions)
    top2 = fp32.topk(2, dim=-1)
    out[rows, top2.indices[rows, 1]] = top2.values[rows, 0] + 1.0
    return out


def test_partings_at_the_smallest_margins_are_near_ties_and_at_wide_ones_are_not():
    fp32 = torch.randn(200, 50, generator=torch.Generator().manual_seed(0))
    top2 = fp32.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    nearest = margin.argsort()[:5].tolist()
    widest = margin.argsort()[-5:].tolist()
    near = bench.parting_margins(fp32, _parting_at(fp32, nearest))
    assert near["partings"] == 5 and near["near_ties_only"]
    assert near["fp32_margin_median_at_partings"] < near["fp32_margin_median"]
    wide = bench.parting_margins(fp32, _parting_at(fp32, nearest[:4] + widest[:1]))
    assert wide["partings"] == 5 and not wide["near_ties_only"]
    assert wide["fp32_margin_max_at_partings"] == pytest.approx(float(margin[widest[0]]), abs=1e-4)
    same = bench.parting_margins(fp32, fp32.clone())
    assert same == {"positions": 200, "partings": 0, "fp32_margin_median": round(float(margin.median()), 4)}


def test_a_twin_projected_onto_its_own_shape_runs_at_its_own_speed_and_the_35b_reads_its_active_bytes():
    model = quantize(tiny_model("clover-tiny"), "int4")
    itself = bench.projection(model, 40.0, preset="clover-tiny")
    assert itself["tok_s"] == pytest.approx(40.0, rel=1e-6)
    assert itself["mb_per_token"] == pytest.approx(itself["twin_mb_per_token"])
    big = bench.projection(model, 40.0)
    # ~2.4 B active non-embedding parameters, packed at the tiny model's bytes per parameter (int4 with its scales,
    # the head and the router as it keeps them): between 1 and 3 GB a token; 35 B parameters resident
    assert 1000 < big["mb_per_token"] < 3000 and 15 < big["resident_gb"] < 40
    assert big["tok_s"] == pytest.approx(40.0 * big["twin_mb_per_token"] / big["mb_per_token"])


def test_oracle_drafting_swaps_exact_modes_copied_drafts_inside_the_block_only():
    """Inside `oracle_drafting` exact mode copies the reference's next tokens (at most `most`, when given) after a
    context that starts with a known prompt; after the block, or an error in it, its own copied drafts are back."""
    from types import SimpleNamespace

    from clover.engine.loops import exact

    own = exact.copied_drafts
    prompt, answer = (5, 6, 7, 8), [9, 10, 11, 12, 13]
    context = SimpleNamespace(tokens=[*prompt, 9, 10])  # two answer tokens committed
    with bench.oracle_drafting({prompt: answer}, 1.0, most=2):
        assert exact.copied_drafts(context, None, 15) == ([11, 12], None, 0)
        assert exact.copied_drafts(SimpleNamespace(tokens=[1, 2, 3, 4]), None, 15) == ([], None, 0)
    assert exact.copied_drafts is own
    with pytest.raises(RuntimeError), bench.oracle_drafting({prompt: answer}, 0.0):
        drafted, _, _ = exact.copied_drafts(context, None, 15)
        assert len(drafted) == 3 and all(d != a for d, a in zip(drafted, answer[2:]))  # p = 0: every one replaced
        raise RuntimeError
    assert exact.copied_drafts is own


def test_the_threshold_rule_below_every_confidence_commits_whole_blocks_and_is_timed_beside_block_size_1():
    """`threshold_rule` on a tiny hybrid: at a threshold of 1e-9 each block forward commits the block (tokens per
    forward is the block size, but for the prompt's forward), at 1 only positions the tiny model is certain of;
    every figure the report prints is there."""
    from clover.engine.runner import as_runner

    runner = as_runner(tiny_model("clover-tiny"))
    prompts = [[3, 4, 5, 6], [7, 8, 9]]
    job = {"threshold": bench.threshold_pairs("4:1e-9,4:1"), "max_new_tokens": 16}
    out = bench.threshold_rule(runner, prompts, job)
    assert set(out) == {"4:1e-09", "4:1"}
    whole, one = out["4:1e-09"], out["4:1"]
    assert whole["tokens"] == one["tokens"] == 32
    assert whole["forwards"] <= 2 * (16 // 4 + 1) and whole["tokens_per_forward"] >= 3.2
    assert one["tokens_per_forward"] < 2 < whole["tokens_per_forward"]  # at 1 only certain positions are committed
    for e in out.values():
        assert e["tok_s"] > 0 and e["block_size_1_tok_s_beside"] > 0 and e["speedup"] > 0
    with pytest.raises(SystemExit, match="BLOCK:THRESHOLD"):
        bench.threshold_pairs("16")
    with pytest.raises(SystemExit, match="at least 2"):
        bench.threshold_pairs("1:0.5")
    with pytest.raises(SystemExit, match="threshold in"):
        bench.threshold_pairs("4:0")
