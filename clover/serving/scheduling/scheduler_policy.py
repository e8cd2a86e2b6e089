"""The scheduling policy of continuous batching, without threads: which waiting work is admitted next, when
prefilled requests join their batch, what a step commits, what a cancellation drops.

    admit:   one queue of waiting work, requests' sequences and runs (a decision run, `response_format`
             filled by decision mode, or echo's prompt scoring) alike, admitted in arrival order (first come,
             first served, as vLLM's scheduler) at one point, the iteration's start: the head is admitted when its
             rows fit under `max_running` (prefilling and prefilled-but-not-joined sequences count; a run alone
             always fits), else nothing behind it is. A sequence is admitted by starting its prefill: one prefill
             at a time, one chunk per call; a short prompt (one chunk: no cached prefix to reuse, nothing to cache)
             is prefilled together with the waiting short prompts right behind it of the same engine, in one
             forward (up to `GROUP_ROWS` padded rows). A run is admitted whole (all its rows) and reads its
             prompts in its own steps.
    join:    a prefilled request joins its batch only at a block boundary (every row then starts a fresh block)
    step:    one step of all running work, batches and runs alike (`Running.step`): a batch's denoising step
             sends committed blocks to their requests' handles, a finished run its results to its caller
    drop:    cancelled work leaves the queue, the prefill, the ready list, its batch or the running runs at once

`Scheduler` (`scheduler.py`) calls these from its thread once per iteration (drop, then admit with one prefill
chunk: `prefill_once`, join, step: `step_running`), so every runner (llama.cpp's too) is only ever called from it;
the capacity bound (`max_running` + `max_waiting`) is checked there, where requests arrive. A failure of one request (its prefill, or
its batch's step) fails that request or batch only; a group prefill that fails is retried one request at a time,
so only the request that fails alone fails.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Protocol, Sequence as Seq

from clover.engine import Engine
from clover.engine.engine import DecodeBatch, Prefill
from clover.engine.loops.loop import Event, Run
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

    @property
    def request_id(self) -> int:
        return self.handle.id


@dataclass(eq=False)
class DecisionJob:
    """A decision run (or a prompt scoring, which runs the same way: `step` until done, then `results`), its id
    (from the counter of request ids: one cancel set holds both kinds of work) and where its result goes
    (`deliver`: the results, or the exception that ended it)."""

    id: int
    run: Run
    deliver: Callable[[list[Any] | BaseException], None]

    @property
    def request_id(self) -> int:
        return self.id

    @property
    def rows(self) -> int:
        return len(self.run.prompts)

    def step(self, policy: SchedulePolicy) -> tuple[list[Event], bool]:
        """One step of the run; a finished run delivers its results, a failed one its exception."""
        try:
            done = self.run.step()
        except Exception as exc:  # noqa: BLE001 - this run's failure, not the server's
            logger.exception("decision step failed")
            self.deliver(exc)
            return [], True
        if done:
            self.deliver(self.run.results())
        return [], done


@dataclass(eq=False)
class RunningBatch:
    """The decoding batch of one engine (`key`), as running work: a step is one `Engine.step`."""

    key: EngineKey
    engine: Engine
    batch: DecodeBatch

    @property
    def rows(self) -> int:
        return len(self.batch.seqs)

    def step(self, policy: SchedulePolicy) -> tuple[list[Event], bool]:
        """One denoising step: its committed blocks (a failed step fails every row's request)."""
        forwards = self.engine.counters.forwards
        policy.metrics.batch_size.observe(len(self.batch.seqs))
        seqs = list(self.batch.seqs)  # the step drops finished rows before its commit forward, which may raise
        try:
            events, batch = self.engine.step(self.batch)
        except Exception as exc:  # noqa: BLE001 - fail this batch's requests, keep serving the rest
            logger.exception("decode step failed")
            policy.leave(self)  # before the failures: a failed request's engine may then be evicted
            for seq in seqs:
                if seq.seq_id in policy.jobs:
                    policy.fail(policy.jobs[seq.seq_id], exc)
            return [], True
        policy.metrics.engine_forwards.inc(self.engine.counters.forwards - forwards)
        if batch is not None:
            self.batch = batch
        return events, batch is None


class Running(Protocol):
    """Work that holds runner rows and is stepped once an iteration until it is over: a `RunningBatch` or a
    `DecisionJob`."""

    @property
    def rows(self) -> int: ...

    def step(self, policy: SchedulePolicy) -> tuple[list[Event], bool]:
        """One step: the sequences' outputs it made, and whether it is over (finished or failed; a run delivers
        its own results)."""


class SchedulePolicy:
    """The queue and running work of one scheduler. `engines`: the engine of each key (shared with the scheduler,
    which creates them); `released(job)`: called once per sequence or run that leaves (finished, failed,
    cancelled)."""

    def __init__(self, engines: dict[EngineKey, Engine], prefix_cache: PrefixCache | None, max_running: int,
                 metrics: ServerMetrics, released: Callable[[Job | DecisionJob], None],
                 request_log: RequestLog | None = None) -> None:
        self.engines, self.prefix_cache, self.max_running = engines, prefix_cache, max_running
        self.metrics, self.released, self.request_log = metrics, released, request_log
        self.waiting: deque[Job | DecisionJob] = deque()  # one queue, in arrival order
        self.prefilling: Job | None = None
        # prefilled (alone, or short prompts together), waiting for their batch's next block boundary
        self.ready: list[tuple[list[Job], DecodeBatch]] = []
        self.running: list[Running] = []  # stepped once an iteration, in the order it started; a batch per key
        self.jobs: dict[int, Job] = {}  # by Sequence.seq_id, every job not finished

    def add(self, work: Seq[Job | DecisionJob]) -> None:
        """New work, in arrival order, at the back of the one queue."""
        for job in work:
            if isinstance(job, Job):
                self.jobs[job.seq.seq_id] = job
            self.waiting.append(job)

    @property
    def batches(self) -> dict[EngineKey, DecodeBatch]:
        """The running batch of each engine key."""
        return {w.key: w.batch for w in list(self.running) if isinstance(w, RunningBatch)}

    @property
    def deciding(self) -> list[DecisionJob]:
        """The running decision runs and prompt scorings."""
        return [w for w in list(self.running) if isinstance(w, DecisionJob)]

    @property
    def load(self) -> dict[str, int]:
        """Rows per stage, a run's among them (read from any thread: containers are copied by C calls, never
        iterated in Python while the scheduler thread may change them)."""
        return {"running": sum(w.rows for w in list(self.running)),
                "waiting": sum(w.rows for w in list(self.waiting)),
                "prefilling": int(self.prefilling is not None),
                "ready": sum(len(jobs) for jobs, _ in list(self.ready))}

    def busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self.ready or self.running)

    def running_count(self) -> int:
        return (sum(w.rows for w in self.running) + sum(len(jobs) for jobs, _ in self.ready)
                + (self.prefilling is not None))

    def _fits(self, rows: int) -> bool:
        """Whether `rows` more fit under `max_running` (work alone always fits: a run larger than it still runs)."""
        running = self.running_count()
        return not running or running + rows <= self.max_running

    def admit(self) -> None:
        """The one admission point: admit the queue's head while it fits, oldest first; a run starts running, a
        sequence starts its prefill (one prefill at a time: a sequence at the head waits for the one prefilling,
        and so does all behind it; one prefill started per call)."""
        while self.waiting:
            head = self.waiting[0]
            if not self._fits(head.rows):
                return
            if isinstance(head, DecisionJob):
                self.running.append(self.waiting.popleft())
                continue
            if self.prefilling is None and not self._prefill_group():
                self.prefilling = self.waiting.popleft()
            return

    def _short(self, job: Job) -> bool:
        """Whether `job`'s prompt fits one prefill chunk: it needs exactly one forward, which it can share, and has
        no cached prefix to start from (a reused prefix ends on the chunk grid before the prompt's end)."""
        return len(job.seq.prompt) <= self.engines[job.key].prefill_chunk

    def _prefill_group(self) -> bool:
        """If the oldest waiting request is short, prefill it with the short ones right behind it (same engine,
        within the free capacity and `GROUP_ROWS`; a run behind it ends the group) in one forward; whether it
        did."""
        first = self.waiting[0]
        if not self._short(first):
            return False
        group, longest = [first], len(first.seq.prompt)
        for job in list(self.waiting)[1:self.max_running - self.running_count()]:
            longest_with = max(longest, len(job.seq.prompt))
            if (not isinstance(job, Job) or job.key != first.key or not self._short(job)
                    or longest_with * (len(group) + 1) > GROUP_ROWS):
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
        """Admit (`admit`), then one chunk of the sequence prefilled alone (a group was prefilled by `admit`)."""
        self.admit()
        if self.prefilling is None:
            return
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
            current = next((w for w in self.running if isinstance(w, RunningBatch) and w.key == key), None)
            if current is None:
                self.running.append(RunningBatch(key, engine, engine.join(None, new)))
            elif engine.at_block_boundary(current.batch):
                current.batch = engine.join(current.batch, new)
            else:
                keep.append((jobs, new))
        self.ready = keep

    def step_running(self) -> None:
        """One step of every running batch and run, in the order they started; work that is over leaves (a run
        frees its rows; a batch's sequences left as they finished)."""
        for work in list(self.running):
            events, over = work.step(self)
            if over:  # before the deliveries: a finished request's engine may then be evicted
                self.leave(work)
            for piece in events:
                self.deliver(piece)

    def deliver(self, piece: Event) -> None:
        """A batch's output to its request (a finished sequence leaves)."""
        job = self.jobs.get(piece.seq_id)
        if job is None:
            return
        job.handle.deliver(piece)
        if piece.finished:
            self._finished(job, piece.stats or {})

    def leave(self, work: Running) -> None:
        """`work` stops running (a batch left twice: the second finds it gone); a run's rows are released (a run
        leaves once, running or waiting)."""
        if work in self.running:
            self.running.remove(work)
        if isinstance(work, DecisionJob):
            self.released(work)

    def cancel(self, request_ids: set[int]) -> None:
        """Drop the work of the requests in `request_ids` (a handle's id, a run's id) wherever it is: its rows are
        freed at once; work already finished is not there any more."""
        for run in [w for w in [*self.waiting, *self.running] if isinstance(w, DecisionJob)
                    and w.request_id in request_ids]:
            self.fail(run, RuntimeError("the client went away"))
        gone = {i for i, job in self.jobs.items() if job.request_id in request_ids}
        if not gone:
            return
        self.waiting = deque(w for w in self.waiting if not (isinstance(w, Job) and w.seq.seq_id in gone))
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
        for work in [w for w in self.running if isinstance(w, RunningBatch)]:
            batch = work.engine.drop(work.batch, gone)
            if batch is None:
                self.leave(work)
            else:
                work.batch = batch
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
        """`exc` ends `job` wherever it is (waiting or running), delivered to its caller."""
        if isinstance(job, DecisionJob):
            if job in self.waiting:
                self.waiting.remove(job)
            job.deliver(exc)
            self.leave(job)
            return
        job.handle.deliver(exc)
        self._forget(job)

    def fail_all(self, exc: BaseException) -> None:
        """Every request and run still held fails with `exc` (the loop is stopping)."""
        for job in [*self.jobs.values(), *self.deciding, *(w for w in self.waiting if isinstance(w, DecisionJob))]:
            self.fail(job, exc)

    def _finished(self, job: Job, stats: dict[str, Any]) -> None:
        self._forget(job)
        if self.request_log is not None:
            self.request_log.write(job.seq, stats)
        seq = job.seq
        self.metrics.record_finished(len(seq.prompt), job.handle.cached_tokens[job.handle.choice_of(seq.seq_id)],
                                     stats, latency=(seq.end_time or time.perf_counter()) - seq.start_time,
                                     scope=job.scope, ttft=None if seq.first_output_time is None
                                     else seq.first_output_time - seq.start_time)
