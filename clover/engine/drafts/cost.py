"""The cost model of a runner: how long one forward of `R` rows takes at a context length, on this machine.

Exact mode decides from it how many drafts a forward verifies and how many it drafts (clover.engine.drafts.drafting):
on a GPU rows are nearly free, so the whole block pays; on two CPU cores a row costs most of what the first one
does (clover-smol's int4 build: 11.4 ms at 1 row, 52.3 at 16 in docs/cpu.md's table), so only well-accepted
drafts pay. The table is
measured, not assumed:

    t(R, L) = t(R, L0) + (a + b R) (L - L0)

`t(R, L0)` is measured for every `R` up to a few blocks' worth at a short context `L0` (interpolated between
measured counts, extended linearly past the last), and `a`, `b` from a second context length: reading the keys
and values grows with `L` once per forward, their arithmetic once per row.

Each count is timed as a shared machine allows (`time_forwards`): the counts take turns, on fresh tokens each
forward, in two passes whose medians a count keeps the lower of, and a count still off the curve's shape
(`off_the_curve`) is timed once more. `cost_table(runner)` measures once per combination of model shape, runner,
weight format (and the build of the kernels that run packed weights), threads, torch and processor
(`fingerprint`), in seven rounds over the counts (a warm-up, two passes of three: one round more than the fastest
of five it replaces; a round is the sum of the table, ~1.3 s on the 1.28 B int4 hybrid twin on two AVX2 cores,
plus at most three rounds of the counts off the curve), and keeps the table in `$CLOVER_CACHE/costs/` (written
atomically: two processes measuring the same combination each publish a
whole table); a later process with the same combination reads it back. A kept table is trusted only while it is
plausible and fresh: one whose rows contradict each other (`implausibility`: a load spike during one count of a
calibration on a shared machine) or older than `MAX_AGE_S` (what the fingerprint cannot see: the machine's power
settings, a firmware or microcode update) is measured again. A fresh calibration that is itself implausible is
measured once more; if that one is too, it is used by this process only, with a warning, and not kept.

**First use.** Before a combination's table is kept, `shape_prior` stands in for it, so a first answer starts at
once: the weights' bytes and parameters from the model's shape (a GGUF's header, a torch model's tensors) give

    t(R) = (dense bytes + expert bytes * (1 - (1 - k / E)^R)) / bandwidth + R * 2 * active parameters / flops

(every forward reads the dense weights once; `R` rows touch that share of `E` experts when each row picks `k`;
every row multiplies the active parameters), with a two-core machine's bandwidth and arithmetic guessed
(`PRIOR_BANDWIDTH`, `PRIOR_FLOPS`). Exact mode times its steps and corrects the guess's scale as it decodes; only
how rows compare is the prior's until the real table is measured at the engine's first idle moment
(clover.engine.loops.exact: `ExactLoop.idle`) and kept.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from clover.atomic_files import atomic_write_text
from clover.ops import woq
from clover.paths import cache_root

logger = logging.getLogger(__name__)

SHORT_CONTEXT, LONG_CONTEXT = 32, 288  # L0 and the second length (prefilling it is part of the calibration)
CALIBRATION_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16)
CALIBRATION_PASSES, CALIBRATION_REPEATS = 2, 3  # `time_forwards`: passes over the counts, rounds a pass
CURVE_SLACK = 0.15  # how far a count's time may stray above the curve's shape before it is timed again
# (`off_the_curve`; the twin's measured curves stray up to ~10 %: a MoE's rows share experts)
MAX_AGE_S = 7 * 24 * 3600.0  # a kept table is measured again after a week
# how far timings may stray from the shape every forward cost has (`implausibility`): more rows at most 25 %
# cheaper than fewer (timing noise), at most twice dearer than proportionally (a kernel switching from its one-row
# path to a matrix product may lose that much)
CHEAPER_SLACK, DEARER_FACTOR = 0.25, 2.0
CALIBRATION_TRIES = 2
# a two-core CPU guessed for `shape_prior` (module docstring): weights read a second, arithmetic a second
PRIOR_BANDWIDTH, PRIOR_FLOPS = 10e9, 60e9


@dataclass
class ForwardCost:
    """Seconds per forward of `rows` rows at `context` tokens: `t(R, L)` of the module docstring."""

    rows: list[int]  # measured row counts, ascending, the first 1
    seconds: list[float]  # t(R, L0) for each
    context: int = SHORT_CONTEXT  # L0
    per_token: float = 0.0  # a: seconds per context token, once per forward
    per_row_token: float = 0.0  # b: seconds per context token and row
    key: dict[str, Any] = field(default_factory=dict)  # what was measured (fingerprint)
    measured_at: float = 0.0  # when (Unix seconds; 0: unknown, as in tables kept before this field)

    def __post_init__(self) -> None:
        if not self.rows or self.rows[0] != 1 or sorted(set(self.rows)) != self.rows:
            raise ValueError(f"a cost table needs ascending distinct row counts starting at 1, got {self.rows}")
        if len(self.seconds) != len(self.rows) or min(self.seconds) <= 0:
            raise ValueError("a cost table needs one positive time per row count")

    def __call__(self, rows: float, context: int = SHORT_CONTEXT) -> float:
        base = self._at_short_context(rows)
        return max(base + (self.per_token + self.per_row_token * rows) * (context - self.context), self.seconds[0])

    def _at_short_context(self, rows: float) -> float:
        r, s = self.rows, self.seconds
        if rows <= r[0]:
            return s[0]
        for i in range(1, len(r)):
            if rows <= r[i]:
                return s[i - 1] + (s[i] - s[i - 1]) * (rows - r[i - 1]) / (r[i] - r[i - 1])
        if len(r) == 1:
            return s[0] * rows
        return s[-1] + self._tail_slope() * (rows - r[-1])

    def _tail_slope(self) -> float:
        """Seconds per row past the last count (arithmetic-bound: linear there): the least-squares slope over the
        upper half of the table, which one noisy timing cannot flatten (two neighbouring counts can time alike)."""
        pairs = [(r, s) for r, s in zip(self.rows, self.seconds) if 2 * r >= self.rows[-1]]
        if len(pairs) < 2:
            pairs = list(zip(self.rows, self.seconds))[-2:]
        mean_r = sum(r for r, _ in pairs) / len(pairs)
        mean_s = sum(s for _, s in pairs) / len(pairs)
        spread = sum((r - mean_r) ** 2 for r, _ in pairs)
        return max(sum((r - mean_r) * (s - mean_s) for r, s in pairs) / spread, 0.0)

    @classmethod
    def proportional(cls, max_rows: int = 64, seconds: float = 1e-2) -> ForwardCost:
        """Rows cost their count (no batching gain at all): the best exact mode can do is one token a forward."""
        return cls(list(range(1, max_rows + 1)), [seconds * r for r in range(1, max_rows + 1)], key={"kind": "model"})

    @classmethod
    def flat(cls, seconds: float = 1e-2) -> ForwardCost:
        """Rows are free (a GPU at small batch): every draft is worth verifying."""
        return cls([1, 2], [seconds, seconds], key={"kind": "model"})

    def summary(self) -> dict[str, Any]:
        """The table in milliseconds, for `clover info` and `--json`."""
        return {"ms_by_rows": {r: round(s * 1e3, 3) for r, s in zip(self.rows, self.seconds)},
                "context": self.context, "us_per_context_token": round(self.per_token * 1e6, 4),
                "us_per_context_token_and_row": round(self.per_row_token * 1e6, 4), **self.key}


def implausibility(table: ForwardCost) -> str | None:
    """What makes a measured table contradict itself, or None. More rows share one read of the weights, so for
    `i < j` rows `t(i) <= t(j)` (rows never make a forward cheaper) and `t(j) <= t(i) * j / i` (a forward of `j`
    rows is never dearer than `j / i` forwards of `i`): a timing outside these bounds by more than
    `CHEAPER_SLACK` / `DEARER_FACTOR` was disturbed (as tables found in a real cache were)."""
    pairs = list(zip(table.rows, table.seconds))
    for k, (i, ti) in enumerate(pairs):
        for j, tj in pairs[k + 1:]:
            if tj < ti * (1 - CHEAPER_SLACK):
                return f"{j} rows took {tj * 1e3:.3g} ms, less than {i} rows' {ti * 1e3:.3g} ms"
            if tj > ti * j / i * DEARER_FACTOR:
                return (f"{j} rows took {tj * 1e3:.3g} ms, more than {DEARER_FACTOR:g} x {j / i:g} times {i} rows' "
                        f"{ti * 1e3:.3g} ms")
    return None


def fingerprint(runner: Any) -> dict[str, Any]:
    """What a forward's time depends on: the network's shape and weight format (and the kernels that run packed
    weights), the runner, its threads, the software and the processor (not the weights' values)."""
    config = runner.config.to_dict()
    for name in ("block_size", "threshold", "draft_acceptance", "eos_token_id", "mask_token_id"):
        config.pop(name, None)
    model = getattr(runner, "model", None)
    weights: Any = getattr(runner, "path", None)
    header = getattr(runner, "_header", None)
    if header is not None:  # a GGUF: its weight types and size, wherever the file lies (a copy shares the table)
        weights = {"file_type": header.get("general.file_type"), "bytes": Path(runner.path).stat().st_size}
    if model is not None:
        weights = {"dtype": str(next(model.parameters()).dtype), "quantization": getattr(model, "quantization", None)}
        if weights["quantization"] is not None:  # packed weights run on Clover's own kernels, as built and run now
            weights["kernels"] = [woq.kernel_tag(), woq.has_vnni()]
    found = {"runner": runner.name, "model_shape": _digest(config), "weights": _digest(weights),
             "device": str(runner.device), "threads": getattr(runner, "threads", None) or torch.get_num_threads(),
             "torch": torch.__version__, "cpu": processor_name()}
    if getattr(runner, "kernel_options", None):  # a runner's own kernel choices (llama.cpp's flash attention)
        found["kernel_options"] = runner.kernel_options
    return found


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def processor_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` knows: what a cost table and a benchmark's figures
    are recorded against."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def calibrate(runner: Any, rows: tuple[int, ...] = CALIBRATION_ROWS, repeats: int = CALIBRATION_REPEATS,
              clock: Callable[[], float] = time.perf_counter) -> ForwardCost:
    """Measure `t(R, L)` through `runner.forward` on one row of random tokens (`time_forwards`: `R` causal clean
    tokens after a cached context, logits at each, as exact mode asks), at `L0` for every count of `rows` and at
    the second length for the first and the last."""
    vocab = min(runner.config.vocab_size, 1000)
    gen = torch.Generator().manual_seed(0)
    cache = runner.new_cache(1)
    long = min(LONG_CONTEXT, runner.config.max_position_embeddings - max(rows) - 1)
    try:
        with torch.inference_mode():
            extend(runner, cache, SHORT_CONTEXT, vocab, gen)
            short = time_forwards(runner, cache, rows, repeats, vocab=vocab, gen=gen, clock=clock)
            extend(runner, cache, long - cache.length, vocab, gen)
            one, most = time_forwards(runner, cache, (rows[0], rows[-1]), repeats, vocab=vocab, gen=gen, clock=clock)
    finally:
        cache.select([])  # frees a runner's rows (llama.cpp's sequence slots)
    span = long - SHORT_CONTEXT
    per_row_token = max((most - short[-1]) - (one - short[0]), 0.0) / ((rows[-1] - rows[0]) * span)
    per_token = max((one - short[0]) / span - per_row_token * rows[0], 0.0)
    return ForwardCost(list(rows), short, SHORT_CONTEXT, per_token, per_row_token, fingerprint(runner), time.time())


def extend(runner: Any, cache: Any, n: int, vocab: int, gen: torch.Generator, chunk: int = 256) -> None:
    """Append `n` random tokens (below `vocab`) to `cache`, `chunk` a forward, keeping no logits."""
    for done in range(0, n, chunk):
        ids = torch.randint(0, vocab, (1, min(chunk, n - done)), generator=gen).to(runner.device)
        runner.forward(ids, 1, cache=cache, prefix_len=ids.shape[1], logits_to_keep=0)


def time_forwards(runner: Any, cache: Any, rows: Sequence[int], repeats: int = CALIBRATION_REPEATS,
                  passes: int = CALIBRATION_PASSES, vocab: int = 1000, gen: torch.Generator | None = None,
                  clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Seconds of a forward of each count of `rows` causal tokens after `cache`'s context (logits at each, as exact
    mode's verification asks), the forward undone after each (`mark` / `rewind`), so every one starts from the
    same context (one token later where the cache keeps a forward's first: llama.cpp's recurrent snapshots,
    clover.runners.llamacpp_hybrid).

    A first round warms allocators and caches up for each shape, uncounted. Then `passes` passes of `repeats`
    rounds, the counts taking turns within a round (a slow moment of a shared machine falls on every count alike),
    each forward on fresh random tokens (a MoE's cost depends on the experts its rows route to: one draw per count
    would price that draw's routing, not a typical one). Each pass gives a count the median of its rounds (one slow
    or lucky forward moves it not at all), and a count keeps the lower of its passes' (a stretch during which a
    pass ran slow is dropped whole). A count still off the shape every cost curve has (`off_the_curve`: dearer
    than a larger count, or above the line through its neighbours by more than `CURVE_SLACK`) was slow in both
    passes: it alone is timed one more pass, in turns, and keeps the lowest. So the extra cost over one pass is
    one pass and a warm-up round, and at most one pass more of the counts found off the curve."""
    gen = gen if gen is not None else torch.Generator().manual_seed(0)
    first = torch.full((1,), int(getattr(cache, "keeps_first", False)), dtype=torch.long)

    def timed_pass(counts: Sequence[int], rounds: int) -> dict[int, float]:
        took: dict[int, list[float]] = {r: [] for r in counts}
        for _ in range(rounds):
            for r in counts:
                ids = torch.randint(0, vocab, (1, r), generator=gen).to(runner.device)
                at = torch.ones(1, r, dtype=torch.bool, device=runner.device)
                cache.mark()
                start = clock()
                runner.forward(ids, 1, cache=cache, prefix_len=r, logits_at=at)
                took[r].append(clock() - start)
                cache.rewind(first)
        return {r: statistics.median(t) for r, t in took.items()}

    rows = list(rows)
    timed_pass(rows, 1)  # the warm-up
    best = timed_pass(rows, repeats)
    for _ in range(passes - 1):
        best = {r: min(best[r], t) for r, t in timed_pass(rows, repeats).items()}
    suspects = off_the_curve(rows, [best[r] for r in rows])
    if suspects:
        logger.debug("timing %s rows again: off the cost curve (%s)", suspects, [best[r] for r in rows])
        best.update({r: min(best[r], t) for r, t in timed_pass(suspects, repeats).items()})
    return [best[r] for r in rows]


def off_the_curve(rows: Sequence[int], seconds: Sequence[float], slack: float = CURVE_SLACK) -> list[int]:
    """The counts whose time strays from the shape of a forward's cost by more than `slack`: dearer than a larger
    count (more rows never make a forward cheaper), or above the straight line through the times of the counts
    either side (past one row a forward's cost is close to linear in its rows, a MoE's a little below: its rows
    share experts; a one-row path shows only at the first count, which has no left neighbour). Timing noise only
    adds time, so the count above is the suspect, not the one below it."""
    out = []
    for i, (r, t) in enumerate(zip(rows, seconds)):
        dearer = any(later < t * (1 - slack) for later in seconds[i + 1:])
        if 0 < i < len(rows) - 1:
            (r0, t0), (r1, t1) = (rows[i - 1], seconds[i - 1]), (rows[i + 1], seconds[i + 1])
            dearer |= t > (t0 + (t1 - t0) * (r - r0) / (r1 - r0)) * (1 + slack)
        if dearer:
            out.append(r)
    return out


def kept_table(runner: Any) -> ForwardCost | None:
    """The table kept in `$CLOVER_CACHE/costs/` for the runner's combination (readable, plausible and fresh), or
    None: nothing is measured."""
    path = _table_path(runner)
    return _trusted(path) if path.is_file() else None


def cost_table(runner: Any, recalibrate: bool = False) -> ForwardCost:
    """The runner's cost table: the kept one (`kept_table`), else measured now (seconds) and kept."""
    kept = None if recalibrate else kept_table(runner)
    if kept is not None:
        return kept
    path = _table_path(runner)
    logger.info("measuring the forward cost of %s rows at %d and %d context tokens (once for this model, runner "
                "and machine)", CALIBRATION_ROWS[-1], SHORT_CONTEXT, LONG_CONTEXT)
    for attempt in range(1, CALIBRATION_TRIES + 1):
        table = calibrate(runner)
        problem = implausibility(table)
        if problem is None:
            atomic_write_text(path, json.dumps(asdict(table), indent=1))
            return table
        logger.warning("the forward-cost calibration contradicts itself (%s, a busy machine?): %s", problem,
                       "measuring again" if attempt < CALIBRATION_TRIES else "using it for now, not keeping it")
    return table


def _table_path(runner: Any) -> Path:
    return cache_root() / "costs" / f"{_digest(fingerprint(runner))}.json"


@dataclass
class WeightShape:
    """What a forward reads and multiplies: dense weights (every row uses them) and experts (`used` of `experts`
    a row), in bytes as stored and in parameters."""

    dense_bytes: float
    dense_params: float
    expert_bytes: float = 0.0
    expert_params: float = 0.0
    experts: int = 1
    used: int = 1

    @classmethod
    def of(cls, runner: Any) -> WeightShape:
        """From a GGUF's header (tensor shapes, the file's size shared out by parameters: quantised blocks store
        a fixed number of bytes a weight) or a torch model's tensors."""
        header = getattr(runner, "_header", None)
        if header is None:
            tensors = [*runner.model.parameters(), *runner.model.buffers()]  # packed weights are buffers
            return cls(float(sum(t.numel() * t.element_size() for t in tensors)),
                       float(sum(t.numel() for t in tensors)))
        counts = {name: math.prod(dims) for name, dims in header.tensors.items()}
        per_param = Path(runner.path).stat().st_size / max(sum(counts.values()), 1)
        expert = sum(n for name, n in counts.items() if "_exps" in name)
        dense = sum(counts.values()) - expert
        arch = header.get("general.architecture")
        experts, used = (int(header.get(f"{arch}.{key}", 1) or 1) for key in ("expert_count", "expert_used_count"))
        return cls(dense * per_param, dense, expert * per_param, expert, experts, used)


def shape_prior(runner: Any, bandwidth: float = PRIOR_BANDWIDTH, flops: float = PRIOR_FLOPS) -> ForwardCost:
    """The cost table guessed from the model's shape (module docstring: first use), for `CALIBRATION_ROWS`."""
    w = WeightShape.of(runner)
    share = min(w.used / w.experts, 1.0)
    active = w.dense_params + w.expert_params * share
    seconds = [(w.dense_bytes + w.expert_bytes * (1 - (1 - share) ** r)) / bandwidth + r * 2 * active / flops
               for r in CALIBRATION_ROWS]
    return ForwardCost(list(CALIBRATION_ROWS), seconds, key={"kind": "prior", **fingerprint(runner)})


def _trusted(path: Path) -> ForwardCost | None:
    """The table kept at `path`, or None (logged) when it cannot be read, contradicts itself or is too old."""
    try:
        table = ForwardCost(**json.loads(path.read_text()))
    except (ValueError, TypeError) as error:  # a foreign file, or a format before this one
        logger.warning("measuring again: the cost table %s is unreadable (%s)", path, error)
        return None
    problem = implausibility(table)
    if problem is not None:
        logger.warning("measuring again: the cost table %s contradicts itself (%s)", path, problem)
        return None
    age = time.time() - table.measured_at
    if age > MAX_AGE_S:
        logger.info("measuring again: the cost table %s is %.0f days old", path, age / 86400)
        return None
    return table
