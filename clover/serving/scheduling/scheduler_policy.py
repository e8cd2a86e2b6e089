"""The scheduling policy of continuous batching, without threads: which request prefills next, when prefilled
requests join their batch, what a step commits, what a cancellation drops.

    admit:   the oldest waiting request starts prefilling once fewer than `max_running` sequences run
             (prefilling and prefilled-but-not-joined ones count); one prefill at a time, one chunk per call;
             a short prompt (one chunk: no cached prefix to reuse, nothing to cache) is prefilled together with
             the waiting short prompts right behind it of the same engine, in one forward (up to `GROUP_ROWS`
             padded rows)
    join:    a prefilled request joins its batch only at a block boundary (every row then starts a fresh block)
    step:    one denoising step of every batch; committed blocks go to their requests' handles
    drop:    cancelled requests leave the queue, the prefill, the ready list and their batch at once
    decide:  decision runs (`response_format`: a form filled by decision mode) start once their rows fit under
             `max_running` and take one forward each per iteration, between the batches' steps, on the same
             thread: every runner (llama.cpp's too) is only ever called from it; a run whose client left stops

`Scheduler` (`scheduler.py`) calls these from its thread, in that order, once per iteration; the capacity bound
(`max_running` + `max_waiting`) is checked there, where requests arrive. A failure of one request (its prefill, or
its batch's step) fails that request or batch only; a group prefill that fails is retried one request at a time,
so only the request that fails alone fails.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence as Seq

from clover.engine import Engine
from clover.engine.engine import DecodeBatch, Prefill
from clover.engine.loops.loop import Run
from clover.engine.request import Sequence
from clover.serving.scheduling.handles import RequestHandle
from clover.serving.metrics import ServerMetrics
from clover.serving.request_log import RequestLog
from clover.serving.scheduling.prefix_cache import PrefixCache, SnapshotBudget

logger = logging.getLogger(__name__)

EngineKey = tuple[int, str]  # (block_size, rule): what picks the loop; threshold and ignore_eos are per row
GROUP_ROWS = 2048  # padded prompt rows of one grouped prefill forward (bounds its activation memory)


@dataclass
class AlonePrefill:
    """A job prefilled on its own, chunk by chunk: the engine's progress, the prefix-cache snapshots taken so far
    (and inherited from the prefix it reused) and those it took itself, held against the prefix cache's budget."""

    progress: Prefill
    states: dict[int, Any] = field(default_factory=dict)
    snapshots: SnapshotBudget | None = None


@dataclass
class Job:
    """One sequence (one choice of one request) on its way through the scheduler: its request's handle and the
    sequence, which carries what the request asked (`Sequence.options`) and when it arrived (`start_time`); where
    it runs; and its prefill while it is prefilled alone."""

    handle: RequestHandle
    seq: Sequence
    key: EngineKey  # which engine / batch
    engine: Engine  # the engine of `key` that validated it (kept: an idle engine may be evicted meanwhile)
    scope: Hashable = None  # whose prefix-cache entries it reuses and adds to (its API key's index)
    prefill: AlonePrefill | None = None
    rows = 1  # cache rows (and sequences) it holds


@dataclass
class DecisionJob:
    """A decision run (or a prompt scoring, which runs the same way: `step` until done, then `results`), its id
    (from the counter of request ids: one cancel set holds both) and where its result goes (`deliver`: the
    results, or the exception that ended it)."""

    id: int
    run: Run
    deliver: Callable[[list[Any] | BaseException], None]

    @property
    def rows(self) -> int:
        return len(self.run.prompts)


class SchedulePolicy:
    """The queues and batches of one scheduler. `engines`: the engine of each key (shared with the scheduler,
    which creates them); `released(job)`: called once per sequence that leaves (finished, failed, cancelled)."""

    def __init__(self, engines: dict[EngineKey, Engine], prefix_cache: PrefixCache | None, max_running: int,
                 metrics: ServerMetrics, released: Callable[[Job], None],
                 request_log: RequestLog | None = None) -> None:
        self.engines, self.prefix_cache, self.max_running = engines, prefix_cache, max_running
        self.metrics, self.released, self.request_log = metrics, released, request_log
        self.batches: dict[EngineKey, DecodeBatch] = {}
        # prefilled (alone, or short prompts together), waiting for their batch's next block boundary
        self.ready: list[tuple[list[Job], DecodeBatch]] = []
        self.waiting: deque[Job] = deque()
        self.prefilling: Job | None = None
        self.jobs: dict[int, Job] = {}  # by Sequence.seq_id, every job not finished
        self.decisions_waiting: deque[DecisionJob] = deque()
        self.deciding: list[DecisionJob] = []

    def add(self, jobs: Seq[Job | DecisionJob]) -> None:
        """New work, in arrival order: sequences wait for a prefill, decision runs for their rows to fit."""
        for job in jobs:
            if isinstance(job, DecisionJob):
                self.decisions_waiting.append(job)
            else:
                self.jobs[job.seq.seq_id] = job
                self.waiting.append(job)

    @property
    def load(self) -> dict[str, int]:
        """Sequences per stage, a decision's rows among them (read from any thread: containers are copied by C
        calls, never iterated in Python while the scheduler thread may change them)."""
        running = sum(len(b.seqs) for b in list(self.batches.values())) + sum(d.rows for d in list(self.deciding))
        waiting = len(self.waiting) + sum(d.rows for d in list(self.decisions_waiting))
        return {"running": running, "waiting": waiting, "prefilling": int(self.prefilling is not None),
                "ready": sum(len(jobs) for jobs, _ in list(self.ready))}

    def busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self.ready or self.batches or self.decisions_waiting
                    or self.deciding)

    def running_count(self) -> int:
        return (sum(len(b.seqs) for b in self.batches.values()) + sum(len(jobs) for jobs, _ in self.ready)
                + (self.prefilling is not None) + sum(d.rows for d in self.deciding))

    def _short(self, job: Job) -> bool:
        """Whether `job`'s prompt fits one prefill chunk: it needs exactly one forward, which it can share, and has
        no cached prefix to start from (a reused prefix ends on the chunk grid before the prompt's end)."""
        return len(job.seq.prompt) <= self.engines[job.key].prefill_chunk

    def _prefill_group(self) -> bool:
        """If the oldest waiting request is short, prefill it with the short ones right behind it (same engine,
        within the free capacity and `GROUP_ROWS`) in one forward; whether it did."""
        first = self.waiting[0]
        if not self._short(first):
            return False
        group, longest = [first], len(first.seq.prompt)
        for job in list(self.waiting)[1:self.max_running - self.running_count()]:
            longest_with = max(longest, len(job.seq.prompt))
            if job.key != first.key or not self._short(job) or longest_with * (len(group) + 1) > GROUP_ROWS:
                break
            group.append(job)
            longest = longest_with
        for _ in group:
            self.waiting.popleft()
        try:
            self.ready.append((group, self.engines[first.key].prefill_together([job.seq for job in group])))
        except Exception as exc:  # noqa: BLE001 - one request's failure (which one: each alone says), not the server's
            if len(group) == 1:
                logger.exception("prefill failed")
                self.fail(first, exc)
                return True
            logger.warning("a grouped prefill of %d prompts failed (%s); each is prefilled alone", len(group), exc)
            for job in group:  # only the request that fails alone fails: another client's bad request is not theirs
                try:
                    self.ready.append(([job], self.engines[job.key].prefill_together([job.seq])))
                except Exception as alone:  # noqa: BLE001 - this request's failure
                    logger.exception("prefill failed")
                    self.fail(job, alone)
        return True

    def prefill_once(self) -> None:
        if self.prefilling is None:
            if not self.waiting or self.running_count() >= self.max_running:
                return
            if self._prefill_group():
                return
            self.prefilling = self.waiting.popleft()
        job = self.prefilling
        engine = self.engines[job.key]
        try:  # find and begin_prefill too: what one request makes them raise must not kill the loop
            if job.prefill is None:
                # a prompt read on a block grid is padded to whole blocks: no prefix of another prompt lines up
                caches = self.prefix_cache is not None and engine.prompt_grid == 1
                reuse = self.prefix_cache.find(job.seq.prompt, job.scope) if caches else None
                if reuse is not None:
                    job.handle.cached_tokens[job.handle.choice_of(job.seq.seq_id)] = reuse.length
                job.prefill = AlonePrefill(engine.begin_prefill(job.seq, reuse.cache if reuse else None),
                                           dict(reuse.states) if reuse else {})
            batch = engine.prefill_step(job.prefill.progress)
        except Exception as exc:  # noqa: BLE001 - this request's failure, not the server's
            logger.exception("prefill failed")
            self.prefilling = None
            self.fail(job, exc)
            return
        alone = job.prefill
        done, total = alone.progress.done, len(job.seq.prompt)
        caches = self.prefix_cache is not None and engine.prompt_grid == 1  # (see the find above)
        if caches and self.prefix_cache.wants_snapshot(done, total):
            alone.snapshots = alone.snapshots or SnapshotBudget(self.prefix_cache)
            alone.snapshots.add(alone.states, done, alone.progress.cache)
        if batch is None:
            return
        self.prefilling = None
        if caches:
            before = self.prefix_cache.stats.evictions
            self._release_snapshots(job)  # stored with the entry (counted there) from now on
            self.prefix_cache.insert(job.seq.prompt, alone.progress.cache, alone.states, job.scope)
            self.metrics.prefix_cache_evictions.inc(self.prefix_cache.stats.evictions - before)
        job.prefill = None
        self.ready.append(([job], batch))

    def join_ready(self) -> None:
        keep = []
        for jobs, new in self.ready:
            key = jobs[0].key
            engine = self.engines[key]
            current = self.batches.get(key)
            if current is None or engine.at_block_boundary(current):
                self.batches[key] = engine.join(current, new)
            else:
                keep.append((jobs, new))
        self.ready = keep

    def step_batches(self) -> None:
        for key in list(self.batches):
            engine, batch = self.engines[key], self.batches[key]
            forwards = engine.counters.forwards
            self.metrics.batch_size.observe(len(batch.seqs))
            seqs = list(batch.seqs)  # the step drops finished rows before its commit forward, which may raise
            try:
                events, batch = engine.step(batch)
            except Exception as exc:  # noqa: BLE001 - fail this batch's requests, keep serving the rest
                logger.exception("decode step failed")
                del self.batches[key]
                for seq in seqs:
                    if seq.seq_id in self.jobs:
                        self.fail(self.jobs[seq.seq_id], exc)
                continue
            self.metrics.engine_forwards.inc(engine.counters.forwards - forwards)
            if batch is None:
                del self.batches[key]
            else:
                self.batches[key] = batch
            for piece in events:
                job = self.jobs.get(piece.seq_id)
                if job is None:
                    continue
                job.handle.deliver(piece)
                if piece.finished:
                    self._finished(job, piece.stats or {})

    def step_decisions(self) -> None:
        """Start the waiting decision runs that fit (the oldest first; one alone always fits), then one forward of
        each running one; a finished run delivers its decisions, a failed one its exception."""
        while self.decisions_waiting:
            rows = self.decisions_waiting[0].rows
            if self.running_count() and self.running_count() + rows > self.max_running:
                break
            self.deciding.append(self.decisions_waiting.popleft())
        for job in list(self.deciding):
            try:
                done = job.run.step()
            except Exception as exc:  # noqa: BLE001 - this decision's failure, not the server's
                logger.exception("decision step failed")
                self._end_decision(job, exc)
                continue
            if done:
                self._end_decision(job, job.run.results())

    def _end_decision(self, job: DecisionJob, outcome: list[Any] | BaseException) -> None:
        """The run leaves (waiting or running), its rows freed; `outcome` goes to its caller."""
        if job in self.deciding:
            self.deciding.remove(job)
        if job in self.decisions_waiting:
            self.decisions_waiting.remove(job)
        job.deliver(outcome)
        self.released(job)

    def cancel(self, request_ids: set[int]) -> None:
        """Drop the requests (handle ids) and decision runs (job ids) in `request_ids`, wherever they are: their
        rows are freed at once; one already finished is not there any more."""
        for job in [j for j in [*self.decisions_waiting, *self.deciding] if j.id in request_ids]:
            self._end_decision(job, RuntimeError("the client went away"))
        gone = {i for i, job in self.jobs.items() if job.handle.id in request_ids}
        if not gone:
            return
        self.waiting = deque(j for j in self.waiting if j.seq.seq_id not in gone)
        if self.prefilling is not None and self.prefilling.seq.seq_id in gone:
            self.prefilling = None
        ready = []
        for jobs, batch in self.ready:
            kept = [j for j in jobs if j.seq.seq_id not in gone]
            if len(kept) < len(jobs) and kept:
                batch = self.engines[kept[0].key].drop(batch, gone)
            if kept:
                ready.append((kept, batch))
        self.ready = ready
        for key in list(self.batches):
            batch = self.engines[key].drop(self.batches[key], gone)
            if batch is None:
                del self.batches[key]
            else:
                self.batches[key] = batch
        for i in gone:
            self._forget(self.jobs[i])

    def _forget(self, job: Job) -> None:
        self._release_snapshots(job)
        self.jobs.pop(job.seq.seq_id, None)
        self.released(job)

    @staticmethod
    def _release_snapshots(job: Job) -> None:
        if job.prefill is not None and job.prefill.snapshots is not None:
            job.prefill.snapshots.release()
            job.prefill.snapshots = None

    def fail(self, job: Job | DecisionJob, exc: BaseException) -> None:
        if isinstance(job, DecisionJob):
            self._end_decision(job, exc)
            return
        job.handle.deliver(exc)
        self._forget(job)

    def _finished(self, job: Job, stats: dict[str, Any]) -> None:
        self._forget(job)
        if self.request_log is not None:
            self.request_log.write(job.seq, stats)
        seq = job.seq
        self.metrics.record_finished(len(seq.prompt), job.handle.cached_tokens[job.handle.choice_of(seq.seq_id)],
                                     stats, latency=(seq.end_time or time.perf_counter()) - seq.start_time,
                                     scope=job.scope, ttft=None if seq.first_output_time is None
                                     else seq.first_output_time - seq.start_time)
