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
        decide:  one forward of every running decision run (`response_format`, `clover.engine.decision`)
        cancel:  a client that went away leaves the batch at once (`Engine.drop`), freeing its slot

Prefill runs one chunk per iteration, between decode steps, so a long prompt never stalls the streams that
are already running (chunked prefill, as in vLLM / SGLang). Requests with different `block_size`, `threshold`,
`rule` or `ignore_eos` cannot share a lockstep batch: each combination has its own engine and batch, and an
iteration steps all of them.

Backpressure: at most `max_running` sequences decode at once and at most `max_waiting` more wait; `submit`
raises `QueueFull` beyond that (the server answers 429). Results cross to asyncio through
`loop.call_soon_threadsafe` into a per-request queue (`handles.py`).

This module is the thread and its inbox; what each iteration does with the queues and batches is the policy,
`scheduler_policy.py`, plain code testable without threads. Metrics are recorded through `metrics.py`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from typing import Any, Callable, Sequence as Seq

import torch

from clover.engine import Engine, SamplingParams
from clover.engine.decision import Decision, DecisionRun
from clover.runners.base import ModelRunner
from clover.runners.torch_runner import as_runner
from clover.serving.handles import RequestHandle
from clover.serving.metrics import ServerMetrics
from clover.serving.prefix_cache import PrefixCache
from clover.serving.scheduler_policy import DecisionJob, EngineKey, Job, SchedulePolicy

logger = logging.getLogger(__name__)


class QueueFull(Exception):
    """The server is at capacity (running + waiting); retry later."""


class Scheduler:
    """The model's one thread: requests arrive through `submit` (any thread) into an inbox; each iteration hands
    them to the `SchedulePolicy` and runs its admit / join / step once."""

    def __init__(self, model: torch.nn.Module | ModelRunner, *, block_size: int | None = None,
                 threshold: float | None = None, rule: str | None = None,
                 eos_token_ids: Seq[int] | None = None, vocab_limit: int | None = None,
                 detokenize: Callable[[list[int]], str] | None = None, prefill_chunk: int = 256,
                 prefix_cache: PrefixCache | None = None, max_running: int = 32, max_waiting: int = 256,
                 metrics: ServerMetrics | None = None) -> None:
        if prefix_cache is not None and prefix_cache.grid != prefill_chunk:
            raise ValueError(f"the prefix cache grid ({prefix_cache.grid}) must equal the prefill chunk "
                             f"({prefill_chunk}): reuse is exact only on the chunk grid")
        self.runner = as_runner(model)  # one runner for every engine: they share its cache slots (llama.cpp)
        if self.runner.max_rows is not None and max_running > self.runner.max_rows:
            raise ValueError(f"max_running={max_running} exceeds the {self.runner.name} runner's "
                             f"{self.runner.max_rows} rows (its max_rows)")
        self.defaults = (block_size, threshold, rule)
        self.engine_options = dict(eos_token_ids=eos_token_ids, vocab_limit=vocab_limit,
                                   detokenize=detokenize, prefill_chunk=prefill_chunk)
        self.prefix_cache = prefix_cache
        self.max_running, self.max_waiting = max_running, max_waiting
        self.metrics = metrics or ServerMetrics()
        self.engines: dict[EngineKey, Engine] = {}
        self._keys: dict[tuple[Any, ...], EngineKey] = {}  # options as asked -> the engine's resolved settings
        self.policy = SchedulePolicy(self.engines, prefix_cache, max_running, self.metrics, self._release)
        self._ids = itertools.count()
        self._lock = threading.Condition()
        self._inbox: list[Job] = []
        self._decision_inbox: list[DecisionJob] = []
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
        asked = (self.defaults[0] if block_size is None else int(block_size),
                 self.defaults[1] if threshold is None else float(threshold),
                 self.defaults[2] if rule is None else str(rule), bool(ignore_eos))
        with self._lock:
            if asked not in self._keys:
                options = {**self.engine_options, **({"eos_token_ids": []} if ignore_eos else {})}
                engine = Engine(self.runner, asked[0], asked[1], asked[2], **options)
                # the settings the engine resolved (None: the model's defaults) are its key: a request naming the
                # defaults shares the default requests' engine and batches
                key = (engine.block_size, engine.threshold, engine.rule.name, bool(ignore_eos))
                self.engines.setdefault(key, engine)
                self._keys[asked] = key
            key = self._keys[asked]
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
                self._inbox.append(Job(handle, choice, seq, key, now))
            self._lock.notify()
        return handle

    def decide(self, run: DecisionRun) -> asyncio.Future[list[Decision]]:
        """Queue a decision run (its rows count against `max_running`); the future gets its decisions, or the
        exception a step raised. Raises like `submit` when the server is at capacity or not running."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[Decision]] = loop.create_future()

        def settle(outcome: list[Decision] | BaseException) -> None:  # event loop
            if future.done():  # the request went away
                return
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

        def deliver(outcome: list[Decision] | BaseException) -> None:  # scheduler thread
            try:
                loop.call_soon_threadsafe(settle, outcome)
            except RuntimeError:  # the event loop is gone (shutdown)
                pass

        job = DecisionJob(run, deliver)
        with self._lock:
            if self.error is not None or self._thread is None or self._stop:
                raise RuntimeError("the scheduler is not running")
            if self._outstanding + job.rows > self.max_running + self.max_waiting:
                raise QueueFull(f"server at capacity ({self.max_running} running + {self.max_waiting} waiting)")
            self._outstanding += job.rows
            self._decision_inbox.append(job)
            self._lock.notify()
        return future

    def cancel(self, handle: RequestHandle) -> None:
        with self._lock:
            self._cancelled.add(handle.id)
            self._lock.notify()

    @property
    def load(self) -> dict[str, int]:
        """Sequences per stage: the policy's, the inbox counted as waiting (read from any thread)."""
        load = self.policy.load
        return {**load, "waiting": load["waiting"] + len(self._inbox) + sum(d.rows for d in list(self._decision_inbox))}

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
    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while not (self._stop or self._inbox or self._decision_inbox or self._cancelled
                               or self.policy.busy()):
                        self._lock.wait()
                    if self._stop:
                        break
                    new, self._inbox = self._inbox, []
                    decisions, self._decision_inbox = self._decision_inbox, []
                    cancelled, self._cancelled = self._cancelled, set()
                self.policy.add(new, decisions)
                if cancelled:
                    self.policy.cancel(cancelled)
                with torch.inference_mode():
                    self.policy.prefill_once()
                    self.policy.join_ready()
                    self.policy.step_batches()
                    self.policy.step_decisions()
                self.metrics.record_load(self.load, self.prefix_cache)
        except BaseException as exc:  # a bug: fail every request rather than hang them
            logger.exception("scheduler loop died")
            self.error = exc
        finally:
            # under the lock, so every submit either lands in the inbox taken here or sees `_stop` and raises
            with self._lock:
                self._stop = True
                pending, self._inbox = self._inbox, []
                pending_decisions, self._decision_inbox = self._decision_inbox, []
            failure = self.error or RuntimeError("the server is shutting down")
            for job in list(self.policy.jobs.values()):
                self.policy.fail(job, failure)
            for decision in [*self.policy.deciding, *self.policy.decisions_waiting, *pending_decisions]:
                self.policy.end_decision(decision, failure)
            for job in pending:  # never reached the policy
                job.handle._deliver(failure)
                self._release(job)

    def _release(self, job: Job | DecisionJob) -> None:  # it left the policy (finished, failed or cancelled)
        with self._lock:
            self._outstanding -= job.rows
