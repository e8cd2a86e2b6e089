"""Exact mode's draft sizing on a measured cost table, without timing: rows verified per token and the predicted
speedup over block size 1, at each acceptance rate of `bench_hybrid.py`'s oracle drafts.

    python benchmarks/exact_policy_rows.py [--results benchmarks/results/bench_hybrid_avx2.json]
        [--system clover/int4] [--acceptance 0.9,0.7,0.5,0] [--prompts 3] [--max-new-tokens 96]

What `bench_hybrid.py` times, counted instead: the same prompts (`--prompts` random ones of 64 tokens, drawn as it
draws them) and the same drafts (`oracle_drafting`: the block-size-1 answer, each token replaced at rate `1 - p`, the
replacements keyed by the prompt and the position), verified by the real exact loop (`rule="exact"`, block size
16, `causal_only`, a new engine per request as `generate` makes one) whose policy reads the cost table that
`bench_hybrid.py` measured on the twin (`cost_ms` of `--system` in `--results`), given as its whole cost model (no
step is timed, so the engine's own time a step, which a timed run adds to every size alike, is left out). Which
drafts are accepted depends only on where the oracle replaced a token, not on the model, so a small random model
of the twin's vocabulary stands in for it: the decisions are the ones the twin's run takes on that table (on the
AVX2 table, 67 / 173 / 198 / 288 forwards at p = 0.9 / 0.7 / 0.5 / 0, where the timed run counted 67 / 171 / 198 /
288). Per `p`: tokens, forwards, draft rows per token (rows a forward verifies beyond its first, summed, over
tokens), and the predicted speedup `tokens / sum_f t(rows_f) / t(1)` (block size 1: one row a token; the first
forward, the prompt's, counted as one in both).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from bench_hybrid import EXACT_BLOCK, RESULTS, oracle_drafting, twin_prompts  # noqa: E402

TWIN_VOCAB = 49152  # the twin's vocabulary: clover-smol's tokenizer


def stand_in(vocab_size: int) -> Any:
    """A small random hybrid (DeltaNet, attention, MoE) with the twin's vocabulary: the prompts and drafts are the
    twin's token ids."""
    import torch

    from clover import CloverConfig, CloverForBlockDiffusion
    from clover.engine.runner import as_runner

    torch.manual_seed(0)
    config = CloverConfig.from_preset("clover-tiny", vocab_size=vocab_size, mask_token_id=vocab_size - 1,
                                      eos_token_id=vocab_size - 2)
    runner = as_runner(CloverForBlockDiffusion(config).eval())
    runner.causal_only = True  # drafts come from the oracle alone, as in bench_hybrid's exact runs
    return runner


def count_rows(runner: Any, table: Any, prompts: list[list[int]], p: float, max_new: int) -> dict[str, Any]:
    """Exact mode with oracle drafts at `p`, a new engine per prompt, every forward's rows counted."""
    from clover.engine import Engine, SamplingParams, generate

    answers = [generate(runner, [prompt], max_new, block_size=1, rule="threshold", eos_token_ids=[]).sequences[0]
               for prompt in prompts]
    tokens = forwards = draft_rows = 0
    cost = 0.0
    with oracle_drafting({tuple(q): a for q, a in zip(prompts, answers)}, p):
        for prompt, answer in zip(prompts, answers):
            engine = Engine(runner, EXACT_BLOCK, rule="exact", cost=table, eos_token_ids=[])
            engine.loop._timed = lambda rows, start, forward: None  # nothing timed: the table is the whole cost
            rows: list[int] = []
            forward = engine.forward
            engine.forward = lambda ids, cache, **kw: (rows.append(ids.shape[1]), forward(ids, cache, **kw))[1]
            got = [t for event in engine.run([prompt], max_new, SamplingParams()) for t in event.token_ids]
            if got != answer:
                raise AssertionError(f"exact mode's tokens differ from block size 1's at p = {p}")
            decode = rows[1:]  # the first forward is the prompt's (one for both decodings)
            tokens += len(got)
            forwards += len(rows)
            draft_rows += sum(r - 1 for r in decode)
            cost += 1 + sum(table(r) / table(1) for r in decode)
    return {"tokens": tokens, "forwards": forwards, "draft_rows_per_token": round(draft_rows / tokens, 4),
            "predicted_speedup": round(tokens / cost, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS / "bench_hybrid_avx2.json")
    parser.add_argument("--system", default="clover/int4")
    parser.add_argument("--acceptance", default="0.9,0.7,0.5,0")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()

    from clover.engine.drafts.cost import ForwardCost

    measured = json.loads(args.results.read_text())
    ms = measured["systems"][args.system]["cost_ms"]
    table = ForwardCost([int(r) for r in ms], [v / 1e3 for v in ms.values()], key={"kind": "measured"})
    runner = stand_in(TWIN_VOCAB)
    prompts = twin_prompts(TWIN_VOCAB, args.prompts, args.prompt_len)
    print(f"cost table of {args.system} in {args.results} (k rows / 1): "
          f"{ {r: round(table(r) / table(1), 3) for r in table.rows} }")
    for p in (float(x) for x in args.acceptance.split(",")):
        out = count_rows(runner, table, prompts, p, args.max_new_tokens)
        print(f"p = {p}: {out['tokens']} tokens in {out['forwards']} forwards, {out['draft_rows_per_token']:.3f} "
              f"draft rows a token, predicted {out['predicted_speedup']:.3f}x block size 1", flush=True)


if __name__ == "__main__":
    main()
