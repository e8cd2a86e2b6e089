"""benchmarks/exact_step_split.py's accounting, on a tiny hybrid: every forward is counted to the system whose
request ran it, by its rows, and the runner is left as it was."""

from __future__ import annotations

from model_helpers import tiny_model
from script_helpers import ROOT, load_script

from clover.engine.runner import as_runner

split_script = load_script(ROOT / "benchmarks" / "exact_step_split.py", "exact_step_split")


def test_each_systems_forwards_are_counted_by_rows_and_the_runner_is_restored():
    runner = as_runner(tiny_model("clover-tiny"))
    forward = runner.forward
    prompts = [[3, 4, 5, 6], [7, 8, 9]]
    out = split_script.split(runner, prompts, 1.0, repeats=2, max_new=12)  # p = 1: every draft accepted
    one, exact = out["block size 1"], out["exact mode"]
    # block size 1: one prompt forward and one row a token after it, for each of the 4 requests
    assert one["forwards_by_rows"][4]["count"] + one["forwards_by_rows"][3]["count"] == 4
    assert one["forwards_by_rows"][1]["count"] == 4 * 11
    assert any(rows > 1 and rows not in (3, 4) for rows in exact["forwards_by_rows"])  # verifications of drafts
    assert sum(v["count"] for v in exact["forwards_by_rows"].values()) < 4 * 12
    for s in (one, exact):
        assert abs(s["in_forwards_s"] + s["outside_forwards_s"] - s["seconds"]) < 1e-9 and s["in_forwards_s"] > 0
    assert out["exact / block size 1 speed"] > 0
    assert runner.forward == forward and "forward" not in vars(runner) and not runner.causal_only
