"""Continuous batching at block granularity: one background thread runs the model, the event loop awaits results.

The engine decodes a batch in lockstep, block by block (`clover.engine.engine`). The scheduler keeps that batch
running while requests come and go:

    every iteration (one thread; the model is never touched from elsewhere):
        take new work (requests' sequences, decision runs, prompt scorings) and cancellations from the inbox
        cancel:  a client that went away leaves the queue or its batch at once (`Engine.drop`), freeing its slot
        admit:   from the one waiting queue, in arrival order (first come, first served), while the oldest fits
                 under `max_running`: a run starts, a sequence starts its prefill
        prefill: one chunk of the request being prefilled (alone: its own cache; it starts from the longest
                 prefix in the prefix cache, and snapshots grid points for it on the way)
        join:    at a block boundary, prefilled requests join the running batch (`Engine.join`)
        step:    one step of all running work: a batch's denoising step (`Engine.step`; committed blocks go to
                 their requests, finished sequences leave the batch), a run's forward (`response_format`'s
                 decision run, `clover.engine.loops.decision`; echo's prompt scoring)

Prefill runs one chunk per iteration, between decode steps, so a long prompt never stalls the streams that
are already running (chunked prefill, as in vLLM / SGLang).

Options belong to requests: `threshold` and `ignore_eos` are per-row data of a running batch (the block loop
compares each row's confidences with its own threshold; EOS ends only the rows that heed it), so they never
split a batch. `block_size` and `rule` pick the loop itself (a block rule's denoising steps and exact mode's
verify forwards cannot share one forward), so requests differing in those have their own engine and batch: at
most one per (block size, rule), and an iteration steps all of them. Engines are kept in a small LRU
(`MAX_IDLE_ENGINES` without live requests beyond the default's): a client cycling through options cannot grow it.

One owner of the model: engines are created (exact mode's calibration runs real forwards) and run only on this
thread, at start (the default engine) or when a request asks for options no engine has yet (an order in the
inbox; the request's coroutine awaits it, the event loop does not stall). Every runner call, llama.cpp's
included, is made here, so no two forwards ever overlap (a gated adapter's per-forward state, llama.cpp's
context and slots are touched from one thread).

Backpressure: at most `max_running` sequences decode at once and at most `max_waiting` more wait; `submit`
raises `QueueFull` beyond that (the server answers 429). Results cross to asyncio through
`loop.call_soon_threadsafe` into per-request queues, once per iteration for all of them (`handles.Outbox`).

This module is the thread and its inbox; what each iteration does with the queues and batches is the policy,
`scheduler_policy.py`, plain code testable without threads. Metrics are recorded through `metrics.py`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections import Counter, OrderedDict
from typing import Any, Callable, Hashable, Sequence as Seq

import torch

from clover.engine import Engine
from clover.engine.loops.loop import Run
from clover.engine.request import Options
from clover.engine.loops.exact import ExactLoop
from clover.engine.runner import ModelRunner, as_runner
from clover.serving.scheduling.handles import Outbox, RequestHandle
from clover.serving.scheduling.heap import release_free_heap
from clover.serving.metrics import ServerMetrics
from clover.serving.scheduling.prefix_cache import PrefixCache
from clover.serving.request_log import RequestLog
from clover.serving.scheduling.scheduler_policy import DecisionJob, EngineKey, Job, SchedulePolicy

logger = logging.getLogger(__name__)

MAX_IDLE_ENGINES = 8  # engines kept without live requests (besides the default's): created again when asked for

Settle = Callable[[Any], None]  # delivers a result (or an exception) to an awaiting coroutine


class QueueFull(Exception):
    """The server is at capacity (running + waiting); retry later."""


class Scheduler:
    """The model's one thread: requests arrive through `submit` and runs through `decide` (any thread) into one
    inbox; each iteration hands them to the `SchedulePolicy` and runs its admit / prefill / join / step once."""

    def __init__(self, model: torch.nn.Module | ModelRunner, *, block_size: int | None = None,
                 threshold: float | None = None, rule: str | None = None,
                 eos_token_ids: Seq[int] | None = None, vocab_limit: int | None = None,
                 detokenize: Callable[[list[int]], str] | None = None, prefill_chunk: int = 256,
                 prefix_cache: PrefixCache | None = None, max_running: int = 32, max_waiting: int = 256,
                 metrics: ServerMetrics | None = None, request_log: RequestLog | None = None) -> None:
        if prefix_cache is not None and prefix_cache.grid != prefill_chunk:
            raise ValueError(f"the prefix cache grid ({prefix_cache.grid}) must equal the prefill chunk "
                             f"({prefill_chunk}): reuse is exact only on the chunk grid")
        self.runner = as_runner(model)  # one runner for every engine: they share its cache slots (llama.cpp)
        if self.runner.max_rows is not None and max_running > self.runner.max_rows:
            raise ValueError(f"max_running={max_running} exceeds the {self.runner.name} runner's "
                             f"{self.runner.max_rows} rows (its max_rows)")
        config = self.runner.config
        self.default_threshold = config.threshold if threshold is None else float(threshold)
        self.default_key = self.resolve(block_size, rule, config.block_size, config.rule)
        self.engine_options = dict(threshold=threshold, eos_token_ids=eos_token_ids, vocab_limit=vocab_limit,
                                   detokenize=detokenize, prefill_chunk=prefill_chunk)
        self.prefix_cache = prefix_cache
        self.max_running, self.max_waiting = max_running, max_waiting
        self.metrics = metrics or ServerMetrics()
        # written on the scheduler thread only (under `_lock`); read by the event loop under `_lock`
        self.engines: OrderedDict[EngineKey, Engine] = OrderedDict()  # least recently asked for first
        self._live: Counter[EngineKey] = Counter()  # sequences submitted per engine and not finished
        self.policy = SchedulePolicy(self.engines, prefix_cache, max_running, self.metrics, self._release,
                                     request_log)
        self.outbox = Outbox()  # the handles' results of an iteration, delivered at its end
        self._ids = itertools.count()
        self._lock = threading.Condition()
        self._inbox: list[Job | DecisionJob] = []  # generation and decision work alike, in arrival order
        self._orders: list[tuple[EngineKey, Settle]] = []  # engines asked for by the event loop
        self._cancelled: set[int] = set()  # ids of requests (handles) and decision runs whose clients left
        self._outstanding = 0  # sequences submitted and not finished (under _lock)
        self._stop = False
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self.error: BaseException | None = None  # set if the loop itself died (or the default engine was refused)

    def resolve(self, block_size: int | None, rule: str | None, default_block: int | None = None,
                default_rule: str | None = None) -> EngineKey:
        """The engine a request with these options runs on (None: the server's default)."""
        if default_block is None:
            default_block, default_rule = self.default_key
        return (default_block if block_size is None else int(block_size),
                default_rule if rule is None else str(rule))

    # -- called from the event loop --------------------------------------------------------------------------
    async def engine(self, block_size: int | None = None, rule: str | None = None) -> tuple[EngineKey, Engine]:
        """The engine (and its key) decoding with this block size and rule (None: the server's default). One not
        made yet is made on the scheduler thread (its calibration runs the model there), awaited here. Raises
        `ValueError` for options the engine refuses and `RuntimeError` when no loop will make it."""
        key = self.resolve(block_size, rule)
        with self._lock:
            engine = self.engines.get(key)
            if engine is not None:
                return key, engine
            if self.error is not None or self._thread is None or self._stop:
                raise RuntimeError("the scheduler is not running")
            future = _SettledFuture(loop=asyncio.get_running_loop())
            self._orders.append((key, future.settle))
            self._lock.notify()
        return key, await future

    async def submit(self, prompt: list[int], max_new_tokens: int, options: Seq[Options], *,
                     block_size: int | None = None, rule: str | None = None, scope: Hashable = None) -> RequestHandle:
        """Queue one prompt with one `RequestOptions` per choice (its drafting memory, its threshold, ...: the
        request's own, which never split a batch); `scope`: whose prefix-cache entries it reuses
        (clover.serving.scheduling.prefix_cache: an API key's own). Raises `ValueError` for a request the engine
        refuses (it names the parameter), `QueueFull` when the server is at capacity and `RuntimeError` when no loop
        will take it (not started, stopped or died: it would wait forever)."""
        key, engine = await self.engine(block_size, rule)
        seqs = engine.make_sequences([prompt] * len(options), max_new_tokens, list(options),
                                     ids=[next(self._ids) for _ in options])
        handle = RequestHandle(next(self._ids), [seq.seq_id for seq in seqs], asyncio.get_running_loop(), self.outbox,
                               self.cancel)
        self._queue([Job(handle, seq, key, engine, scope) for seq in seqs])
        return handle

    def decide(self, run: Run) -> asyncio.Future[list[Any]]:
        """Queue a decision run or a prompt scoring (its rows count against `max_running`); the future gets its
        results (decisions, or each prompt's logprobs), or the exception a step raised. Raises like `submit` when
        the server is at capacity or not running."""
        future = _SettledFuture(loop=asyncio.get_running_loop())
        job = DecisionJob(next(self._ids), run, future.settle)
        # a request that went away (its coroutine cancelled: the client left) stops its decision run
        future.add_done_callback(lambda f: self.cancel(job.id) if f.cancelled() else None)
        self._queue([job])
        return future

    def _queue(self, jobs: Seq[Job | DecisionJob]) -> None:
        """Into the inbox, within the capacity (`QueueFull` beyond it; `RuntimeError` when no loop runs)."""
        rows = sum(job.rows for job in jobs)
        with self._lock:
            if self.error is not None or self._thread is None or self._stop:
                raise RuntimeError("the scheduler is not running")
            if self._outstanding + rows > self.max_running + self.max_waiting:
                raise QueueFull(f"server at capacity ({self.max_running} running + {self.max_waiting} waiting)")
            self._outstanding += rows
            for job in jobs:
                if isinstance(job, Job):
                    self._live[job.key] += 1
            self._inbox.extend(jobs)
            self._lock.notify()

    def cancel(self, request_id: int) -> None:
        """Stop a request (a handle's id) or decision run (its job's id) whose client went away, at the next
        iteration (any thread; one already finished is left alone)."""
        with self._lock:
            self._cancelled.add(request_id)
            self._lock.notify()

    @property
    def load(self) -> dict[str, int]:
        """Sequences per stage: the policy's, the inbox counted as waiting (read from any thread)."""
        load = self.policy.load
        return {**load, "waiting": load["waiting"] + sum(job.rows for job in list(self._inbox))}

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the thread; it makes the default engine first (returns once made, raises what refused it)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="clover-scheduler", daemon=True)
            self._thread.start()
        self._started.wait()
        if self.error is not None:
            raise self.error

    def stop(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # -- the thread -------------------------------------------------------------------------------------------
    def _serve(self) -> None:
        """The thread's body: the default engine first, then iterations until stopped (or a bug kills it)."""
        try:
            try:
                self._make_engine(self.default_key)
                release_free_heap()  # what loading and the cost calibration freed, before the first request
            finally:
                self._started.set()
            while True:
                with self._lock:
                    while not (self._stop or self._inbox or self._cancelled or self._orders or self.policy.busy()):
                        self._lock.wait()
                    if self._stop:
                        break
                    new, self._inbox = self._inbox, []
                    cancelled, self._cancelled = self._cancelled, set()
                    orders, self._orders = self._orders, []
                    for job in new:  # its engine was evicted after the request got it: it is back
                        if isinstance(job, Job):
                            self.engines.setdefault(job.key, job.engine)
                for key, settle in orders:
                    try:
                        settle(self._make_engine(key))
                    except Exception as exc:  # noqa: BLE001 - options this engine refuses: that request's error
                        settle(exc)
                self.policy.add(new)
                if cancelled:
                    self.policy.cancel(cancelled)
                with torch.inference_mode():
                    self.policy.prefill_once()
                    self.policy.join_ready()
                    self.policy.step_running()
                self.outbox.flush()
                cached = None if self.prefix_cache is None else self.prefix_cache.memory_bytes
                self.metrics.record_load(self.load, cached)
                if not self.policy.busy():  # idle now: what the finished requests freed goes back to the system
                    release_free_heap()
        except BaseException as exc:  # a bug: fail every request rather than hang them
            logger.exception("scheduler loop died")
            self.error = exc
        finally:
            # under the lock, so every submit either lands in the inbox taken here or sees `_stop` and raises
            with self._lock:
                self._stop = True
                pending, self._inbox = self._inbox, []
            failure = self.error or RuntimeError("the server is shutting down")
            self.policy.add(pending)  # those that never reached it, failed with the rest
            self.policy.fail_all(failure)
            self.outbox.flush()

    def _release(self, job: Job | DecisionJob) -> None:  # it left the policy (finished, failed or cancelled)
        with self._lock:
            self._outstanding -= job.rows
            if isinstance(job, Job):
                self._live[job.key] -= 1
                if not self._live[job.key]:
                    del self._live[job.key]
                    self._evict_idle()

    def _make_engine(self, key: EngineKey) -> Engine:
        """The engine of `key`, made now if there is none (scheduler thread: exact mode's calibration runs the
        model)."""
        engine = self.engines.get(key)
        if engine is None:
            engine = Engine(self.runner, key[0], rule=key[1], **self.engine_options)
            if isinstance(engine.loop, ExactLoop):
                engine.loop.calibrate()
        with self._lock:
            self.engines[key] = engine
            self.engines.move_to_end(key)
            self._evict_idle()
        return engine

    def _evict_idle(self) -> None:
        """Keep at most `MAX_IDLE_ENGINES` engines without live requests, besides the default (under `_lock`,
        scheduler thread); the least recently asked for go first."""
        idle = [k for k in self.engines if k != self.default_key and not self._live[k]
                and k not in self.policy.batches]
        for k in idle[:max(len(idle) - MAX_IDLE_ENGINES, 0)]:
            del self.engines[k]


class _SettledFuture(asyncio.Future):
    """An asyncio future that the scheduler thread settles (`settle(result or exception)`); a future already
    done (its request went away) is left alone."""

    def settle(self, outcome: Any) -> None:  # scheduler thread
        def apply() -> None:  # event loop
            if self.done():
                return
            if isinstance(outcome, BaseException):
                self.set_exception(outcome)
            else:
                self.set_result(outcome)

        try:
            self.get_loop().call_soon_threadsafe(apply)
        except RuntimeError:  # the event loop is gone (shutdown)
            pass
