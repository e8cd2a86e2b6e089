"""Continuous batching at block granularity: one background thread runs the model, the event loop awaits results.

The engine decodes a batch in lockstep, block by block (`clover.engine.engine`). The scheduler keeps that batch
running while requests come and go:

    every iteration (one thread; the model is never touched from elsewhere):
        take new requests and cancellations from the inbox
        prefill: one chunk of the request being prefilled (alone: its own cache; it starts from the longest
                 prefix in the prefix cache, and snapshots grid points for it on the way)
        join:    at a block boundary, prefilled requests join the running batch (`Engine.join`)
        step:    one denoising step of every running batch (`Engine.step`); committed blocks go to their
                 requests, finished sequences leave the batch
        cancel:  a client that went away leaves the batch at once (`Engine.drop`), freeing its slot

Prefill runs one chunk per iteration, between decode steps, so a long prompt never stalls the streams that
are already running (chunked prefill, as in vLLM / SGLang). Requests with different `block_size`, `threshold`,
`rule` or `ignore_eos` cannot share a lockstep batch: each combination has its own engine and batch, and an
iteration steps all of them.

Backpressure: at most `max_running` sequences decode at once and at most `max_waiting` more wait; `submit`
raises `QueueFull` beyond that (the server answers 429). Results cross to asyncio through
`loop.call_soon_threadsafe` into a per-request queue.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence as Seq

import torch

from clover.engine import Engine, SamplingParams
from clover.engine.engine import Batch, Prefill
from clover.engine.sequence import Sequence
from clover.model.cache import RecurrentSnapshot
from clover.serving.handles import Output, RequestHandle
from clover.serving.metrics import ServerMetrics
from clover.serving.prefix_cache import PrefixCache

logger = logging.getLogger(__name__)


EngineKey = tuple[int, float, str, bool]  # (block_size, threshold, rule, ignore_eos)


class QueueFull(Exception):
    """The server is at capacity (running + waiting); retry later."""


@dataclass
class _Job:
    """One sequence (one choice of one request) on its way through the scheduler."""

    handle: RequestHandle
    choice: int
    seq: Sequence
    key: "EngineKey"  # which engine / batch
    arrival: float
    prefill: Prefill | None = None
    states: dict[int, RecurrentSnapshot] = field(default_factory=dict)  # prefix-cache snapshots taken so far


class Scheduler:
    def __init__(self, model: torch.nn.Module, *, block_size: int, threshold: float, rule: str = "threshold",
                 eos_token_ids: Seq[int] | None = None, vocab_limit: int | None = None,
                 detokenize: Callable[[list[int]], str] | None = None, prefill_chunk: int = 256,
                 prefix_cache: PrefixCache | None = None, max_running: int = 32, max_waiting: int = 256,
                 metrics: ServerMetrics | None = None) -> None:
        if prefix_cache is not None and prefix_cache.grid != prefill_chunk:
            raise ValueError(f"the prefix cache grid ({prefix_cache.grid}) must equal the prefill chunk "
                             f"({prefill_chunk}): reuse is exact only on the chunk grid")
        self.model = model
        self.defaults = (block_size, threshold, rule)
        self.engine_options = dict(eos_token_ids=eos_token_ids, vocab_limit=vocab_limit,
                                   detokenize=detokenize, prefill_chunk=prefill_chunk)
        self.prefix_cache = prefix_cache
        self.max_running, self.max_waiting = max_running, max_waiting
        self.metrics = metrics or ServerMetrics()
        self.engines: dict[EngineKey, Engine] = {}
        self.batches: dict[EngineKey, Batch] = {}
        self.ready: list[tuple[_Job, Batch]] = []  # prefilled, waiting for their batch's next block boundary
        self.waiting: deque[_Job] = deque()
        self.prefilling: _Job | None = None
        self.jobs: dict[int, _Job] = {}  # by Sequence.index, every job not finished
        self._ids = itertools.count()
        self._lock = threading.Condition()
        self._inbox: list[_Job] = []
        self._cancelled: set[int] = set()
        self._outstanding = 0  # sequences submitted and not finished (under _lock)
        self._stop = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # set if the loop itself died

    # -- called from the event loop --------------------------------------------------------------------------
    def engine(self, block_size: int | None = None, threshold: float | None = None, rule: str | None = None,
               ignore_eos: bool = False) -> tuple[EngineKey, Engine]:
        """The engine (and its key) decoding with these options (None: the server's default); created on first
        use."""
        key = (self.defaults[0] if block_size is None else int(block_size),
               self.defaults[1] if threshold is None else float(threshold),
               self.defaults[2] if rule is None else str(rule), bool(ignore_eos))
        with self._lock:
            if key not in self.engines:
                options = {**self.engine_options, **({"eos_token_ids": []} if ignore_eos else {})}
                self.engines[key] = Engine(self.model, key[0], key[1], key[2], **options)
            return key, self.engines[key]

    def submit(self, prompt: list[int], max_new_tokens: int, sampling: Seq[SamplingParams], *,
               block_size: int | None = None, threshold: float | None = None, rule: str | None = None,
               ignore_eos: bool = False) -> RequestHandle:
        """Queue one prompt with one `SamplingParams` per choice. Raises `ValueError` for a request the engine
        refuses (it names the parameter), `QueueFull` when the server is at capacity and `RuntimeError` when no
        loop will take it (not started, stopped or died: it would wait forever). `ignore_eos`: generate exactly
        `max_new_tokens` (benchmarks)."""
        key, engine = self.engine(block_size, threshold, rule, ignore_eos)
        seqs = engine.make_sequences([prompt] * len(sampling), max_new_tokens, list(sampling))
        handle = RequestHandle(self, next(self._ids), len(seqs), asyncio.get_running_loop())
        now = time.perf_counter()
        with self._lock:
            if self.error is not None or self._thread is None or self._stop:
                raise RuntimeError("the scheduler is not running")
            if self._outstanding + len(seqs) > self.max_running + self.max_waiting:
                raise QueueFull(f"server at capacity ({self.max_running} running + {self.max_waiting} waiting)")
            self._outstanding += len(seqs)
            for choice, seq in enumerate(seqs):
                seq.index = next(self._ids)
                self._inbox.append(_Job(handle, choice, seq, key, now))
            self._lock.notify()
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        with self._lock:
            self._cancelled.add(handle.id)
            self._lock.notify()

    @property
    def load(self) -> dict[str, int]:
        """Sequences per stage (read from any thread: containers are copied by C calls, never iterated in Python
        while the scheduler thread may change them)."""
        running = sum(len(b.seqs) for b in list(self.batches.values()))
        return {"running": running, "waiting": len(self.waiting) + len(self._inbox),
                "prefilling": int(self.prefilling is not None), "ready": len(self.ready)}

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="clover-scheduler", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # -- the loop (scheduler thread) --------------------------------------------------------------------------
    def _busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self.ready or self.batches)

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while not (self._stop or self._inbox or self._cancelled or self._busy()):
                        self._lock.wait()
                    if self._stop:
                        break
                    new, self._inbox = self._inbox, []
                    cancelled, self._cancelled = self._cancelled, set()
                for job in new:
                    self.jobs[job.seq.index] = job
                    self.waiting.append(job)
                if cancelled:
                    self._cancel(cancelled)
                with torch.inference_mode():
                    self._prefill_once()
                    self._join_ready()
                    self._step_batches()
                self._gauges()
        except BaseException as exc:  # a bug: fail every request rather than hang them
            logger.exception("scheduler loop died")
            self.error = exc
        finally:
            # under the lock, so every submit either lands in the inbox taken here or sees `_stop` and raises
            with self._lock:
                self._stop = True
                pending, self._inbox = self._inbox, []
            failure = self.error or RuntimeError("the server is shutting down")
            for job in list(self.jobs.values()) + pending:
                self._fail(job, failure)

    def _running_count(self) -> int:
        return sum(len(b.seqs) for b in self.batches.values()) + len(self.ready) + (self.prefilling is not None)

    def _prefill_once(self) -> None:
        if self.prefilling is None:
            if not self.waiting or self._running_count() >= self.max_running:
                return
            self.prefilling = self.waiting.popleft()
        job = self.prefilling
        engine = self.engines[job.key]
        try:  # lookup and begin_prefill too: what one request makes them raise must not kill the loop
            if job.prefill is None:
                reuse = self.prefix_cache.lookup(job.seq.prompt) if self.prefix_cache is not None else None
                if reuse is not None:
                    job.handle.cached_tokens[job.choice] = reuse.length
                    job.states = dict(reuse.states)
                job.prefill = engine.begin_prefill(job.seq, reuse.cache if reuse else None)
            batch = engine.prefill_step(job.prefill)
        except Exception as exc:  # noqa: BLE001 - this request's failure, not the server's
            logger.exception("prefill failed")
            self.prefilling = None
            self._fail(job, exc)
            return
        done, total = job.prefill.done, len(job.seq.prompt)
        if self.prefix_cache is not None and self.prefix_cache.wants_snapshot(done, total):
            job.states[done] = job.prefill.cache.snapshot_recurrent()
        if batch is None:
            return
        self.prefilling = None
        if self.prefix_cache is not None:
            before = self.prefix_cache.stats.evictions
            self.prefix_cache.insert(job.seq.prompt, job.prefill.cache, job.states)
            self.metrics.prefix_cache_evictions.inc(self.prefix_cache.stats.evictions - before)
        job.prefill, job.states = None, {}
        self.ready.append((job, batch))

    def _join_ready(self) -> None:
        keep = []
        for job, new in self.ready:
            engine = self.engines[job.key]
            current = self.batches.get(job.key)
            if current is None or engine.at_block_boundary(current):
                self.batches[job.key] = engine.join(current, new)
            else:
                keep.append((job, new))
        self.ready = keep

    def _step_batches(self) -> None:
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
                    if seq.index in self.jobs:
                        self._fail(self.jobs[seq.index], exc)
                continue
            self.metrics.engine_forwards.inc(engine.counters.forwards - forwards)
            if batch is None:
                del self.batches[key]
            else:
                self.batches[key] = batch
            for piece in events:
                job = self.jobs.get(piece.index)
                if job is None:
                    continue
                job.handle._deliver(Output(job.choice, piece.token_ids, piece.finished, piece.finish_reason,
                                           piece.stats))
                if piece.finished:
                    self._finished(job, piece.stats or {})

    def _cancel(self, request_ids: set[int]) -> None:
        gone = {i for i, job in self.jobs.items() if job.handle.id in request_ids}
        if not gone:
            return
        self.waiting = deque(j for j in self.waiting if j.seq.index not in gone)
        if self.prefilling is not None and self.prefilling.seq.index in gone:
            self.prefilling = None
        self.ready = [(j, b) for j, b in self.ready if j.seq.index not in gone]
        for key in list(self.batches):
            batch = self.engines[key].drop(self.batches[key], gone)
            if batch is None:
                del self.batches[key]
            else:
                self.batches[key] = batch
        for i in gone:
            self._forget(self.jobs[i])

    def _forget(self, job: _Job) -> None:
        self.jobs.pop(job.seq.index, None)
        with self._lock:
            self._outstanding -= 1

    def _fail(self, job: _Job, exc: BaseException) -> None:
        job.handle._deliver(exc)
        self._forget(job)

    def _finished(self, job: _Job, stats: dict[str, Any]) -> None:
        self._forget(job)
        m = self.metrics
        m.prompt_tokens.inc(len(job.seq.prompt))
        m.cached_prompt_tokens.inc(job.handle.cached_tokens[job.choice])
        m.generation_tokens.inc(stats.get("tokens", 0))
        m.forward_passes.inc(stats.get("forward_passes", 0))
        if stats.get("forward_passes"):
            m.tokens_per_forward.observe(stats["tokens_per_forward"])
        m.finished.labels(stats.get("finish_reason") or "unknown").inc()
        end = job.seq.end_time or time.perf_counter()
        m.latency.observe(end - job.arrival)
        if job.seq.first_output_time is not None:
            m.ttft.observe(job.seq.first_output_time - job.arrival)

    def _gauges(self) -> None:
        load = self.load
        self.metrics.running.set(load["running"])
        self.metrics.queue_depth.set(load["waiting"] + load["ready"] + load["prefilling"])
        if self.prefix_cache is not None:
            self.metrics.prefix_cache_bytes.set(self.prefix_cache.memory_bytes)
            self.metrics.prefix_cache_entries.set(len(self.prefix_cache.entries))
