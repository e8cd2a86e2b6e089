"""Where exact mode's time goes beside block size 1's on the hybrid twin: every forward timed, by its rows.

    python benchmarks/exact_step_split.py [--work DIR] [--form int4] [--p 0] [--prompts 3] [--repeats 3]
        [--max-new-tokens 96] [--threads 2] [--out F]

`bench_hybrid.py` gives exact mode's speed against block size 1 at each acceptance `p` of its oracle drafts; this
says what the difference is made of. On the twin `bench_hybrid.py` built under `--work` (built now if missing), its
prompts and its oracle drafts at `--p` (block size 1's answer, each drafted token replaced at rate `1 - p`),
`--repeats` rounds over the prompts, each request decoded at block size 1 and in exact mode (block size 16,
`causal_only`: drafts from the oracle alone), which runs first alternating (`timed_beside`). Every runner forward
is timed and counted by its rows (the prompt's forward among them); Python's collections during each system's
requests are timed through `gc.callbacks`. Per system: the whole time, the time inside forwards and outside them,
the one-row forwards' median, forwards and seconds by rows, collections; and exact mode's speed over block size 1's.
At `p = 0` every draft is rejected, so exact mode's forwards of more than one row are its probes: what its estimate
of the drafts' acceptance tries before it learns that they do not pay (each `generate()` builds an engine whose
estimate starts at its prior).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from bench_hybrid import EXACT_BLOCK, RESULTS, build, machine, oracle_drafting, timed_beside, twin_prompts  # noqa: E402


def split(runner: Any, prompts: list[list[int]], p: float, repeats: int, max_new: int) -> dict[str, Any]:
    """Both systems' requests over `repeats` rounds, their forwards timed (module docstring)."""
    from clover.engine import generate
    from clover.engine.drafts.cost import cost_table

    cost_table(runner)  # kept, or measured now: not inside a timed request (exact mode would measure when idle)
    references = {tuple(q): generate(runner, [q], max_new_tokens=max_new, block_size=1, rule="threshold").sequences[0]
                  for q in prompts}
    causal_only = getattr(runner, "causal_only", False)
    runner.causal_only = True  # drafts from the oracle alone, as bench_hybrid.py runs exact mode
    forwards: dict[str, list[tuple[int, float]]] = defaultdict(list)
    collections: dict[str, list[tuple[int, float]]] = defaultdict(list)
    current: list[str | None] = [None]  # the system whose request runs now (`timed_beside`'s `announce`)
    started = [0.0]

    def announce(name: str | None) -> None:
        current[0] = name

    forward = runner.forward

    def timed_forward(ids: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = forward(ids, *args, **kwargs)
        if current[0] is not None:
            forwards[current[0]].append((0 if ids is None else ids.shape[1], time.perf_counter() - start))
        return out

    def on_collection(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        elif current[0] is not None:
            collections[current[0]].append((info["generation"], time.perf_counter() - started[0]))

    seconds: Counter[str] = Counter()
    runner.forward = timed_forward
    gc.callbacks.append(on_collection)
    try:
        with oracle_drafting(references, p):
            generate(runner, prompts[:1], max_new_tokens=4, block_size=EXACT_BLOCK, rule="exact")  # warm-up
            for round_ in range(repeats):
                for i, prompt in enumerate(prompts):
                    for name, (_, took) in timed_beside(runner, prompt, round_ + i, max_new, announce=announce,
                                                        block_size=EXACT_BLOCK, rule="exact").items():
                        seconds[name] += took
    finally:
        del runner.forward  # the runner's own method again
        runner.causal_only = causal_only
        gc.callbacks.remove(on_collection)
    out: dict[str, Any] = {}
    for name, label in (("block1", "block size 1"), ("other", "exact mode")):
        rows = forwards[name]
        inside = sum(t for _, t in rows)
        one = [t for r, t in rows if r == 1]
        by_rows = defaultdict(list)
        for r, t in rows:
            by_rows[r].append(t)
        out[label] = {"seconds": seconds[name], "in_forwards_s": inside, "outside_forwards_s": seconds[name] - inside,
                      "one_row_median_ms": 1e3 * statistics.median(one) if one else None,
                      "forwards_by_rows": {r: {"count": len(v), "seconds": sum(v)} for r, v in sorted(by_rows.items())},
                      "collections": [{"generation": g, "ms": 1e3 * t} for g, t in collections[name]]}
    out["exact / block size 1 speed"] = seconds["block1"] / seconds["other"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=None, help="where bench_hybrid.py builds the twin (default: "
                        "$CLOVER_CACHE/bench_hybrid)")
    parser.add_argument("--form", choices=("int4", "fp32"), default="int4")
    parser.add_argument("--p", type=float, default=0.0, help="the oracle drafts' acceptance")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "exact_step_split.json")
    args = parser.parse_args()
    if not 0.0 <= args.p <= 1.0:
        raise SystemExit(f"--p is an acceptance rate in [0, 1], got {args.p}")

    import torch

    from clover import CloverForBlockDiffusion
    from clover.engine.runner import as_runner
    from clover.paths import cache_root

    torch.set_num_threads(args.threads)
    paths = build(args.work or cache_root() / "bench_hybrid", 1)
    runner = as_runner(CloverForBlockDiffusion.from_pretrained(paths[args.form]).eval())
    prompts = twin_prompts(runner.config.vocab_size, args.prompts, args.prompt_len)
    report = {"command": " ".join(sys.argv), "machine": machine(args.threads), "p": args.p, "form": args.form,
              **split(runner, prompts, args.p, args.repeats, args.max_new_tokens)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for label in ("block size 1", "exact mode"):
        s = report[label]
        rows = ", ".join(f"{r} rows: {v['count']} ({v['seconds']:.2f} s)" for r, v in s["forwards_by_rows"].items())
        print(f"{label}: {s['seconds']:.2f} s, {s['in_forwards_s']:.2f} in forwards, {s['outside_forwards_s']:.2f} "
              f"outside; one-row median {s['one_row_median_ms']:.2f} ms; {rows}; {len(s['collections'])} "
              "collections")
    print(f"exact / block size 1 speed: {report['exact / block size 1 speed']:.3f}")


if __name__ == "__main__":
    main()
