"""Prometheus metrics of one server (its own registry, so several apps can live in one process, e.g. in tests).

Names follow Prometheus conventions (`_total` is added to counters by the client library, units in the name).
The figures are the ones an operator of a block-diffusion server watches: request and token rates, tokens per
forward (how much parallel decoding buys), queue depth (backpressure), latencies, and the prefix cache. Those that
describe one API key's requests are that key's only (`ServerMetrics`, docs/serving.md "Security").
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Hashable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPF_BUCKETS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class KeyMetrics:
    """The figures of one API key's requests (all requests' without keys): what its prompts and answers were
    like (tokens, prefix-cache hits, forwards, finish reasons, latencies) and what the server keeps of them (its
    drafting memory, its prefix-cache entries). Only that key reads them (`ServerMetrics.render`)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.prompt_tokens = Counter("clover_prompt_tokens", "prompt tokens of finished generations", registry=r)
        self.cached_prompt_tokens = Counter("clover_cached_prompt_tokens",
                                            "prompt tokens served from the prefix cache", registry=r)
        self.generation_tokens = Counter("clover_generation_tokens", "generated tokens", registry=r)
        self.forward_passes = Counter("clover_request_forward_passes",
                                      "forward passes that decided requests' tokens (summed over requests)",
                                      registry=r)
        self.tokens_per_forward = Histogram("clover_tokens_per_forward", "tokens per forward pass, per request",
                                            buckets=TPF_BUCKETS, registry=r)
        self.finished = Counter("clover_generations", "finished generations by finish reason", ["reason"],
                                registry=r)
        self.ttft = Histogram("clover_time_to_first_token_seconds", "from arrival to the first committed block",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("clover_request_latency_seconds", "from arrival to the last token",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.draft_memory_tokens = Gauge("clover_draft_memory_tokens",
                                         "answer tokens held by the drafting memory these requests draft from",
                                         registry=r)
        self.prefix_cache_entries = Gauge("clover_prefix_cache_entries", "these requests' prompts in the prefix "
                                          "cache", registry=r)


class ServerMetrics:
    """The server's figures: those of its load and capacity (requests by route and status, batches, queue,
    forwards, the prefix cache's memory) for every key, and per API key (`KeyMetrics`, made on first use) those
    that describe a key's own requests, each shown only to that key: a count of cached prompt tokens or of
    drafting-memory tokens summed over keys would tell one client about another's prompts and answers.

    `draft_memory_tokens(scope)` and `prefix_cache_entries(scope)`: read when a key's figures are rendered."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, draft_memory_tokens: Callable[[Hashable], int] | None = None,
                 prefix_cache_entries: Callable[[Hashable], int] | None = None) -> None:
        self._draft_memory_tokens, self._prefix_cache_entries = draft_memory_tokens, prefix_cache_entries
        self._keys: dict[Hashable, KeyMetrics] = {}
        self._lock = threading.Lock()  # the scheduler thread records, the event loop renders
        r = self.registry = CollectorRegistry()
        self.requests = Counter("clover_requests", "HTTP requests by route and status code", ["route", "status"],
                                registry=r)
        self.engine_forwards = Counter("clover_engine_forwards", "batched model forwards run by the scheduler",
                                       registry=r)
        self.batch_size = Histogram("clover_batch_size", "sequences in a batch, per denoising step",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.queue_depth = Gauge("clover_queue_depth", "requests waiting to join the running batch", registry=r)
        self.running = Gauge("clover_running_requests", "sequences in the running batch", registry=r)
        self.prefix_cache_bytes = Gauge("clover_prefix_cache_bytes", "memory held by the prefix cache", registry=r)
        self.prefix_cache_evictions = Counter("clover_prefix_cache_evictions", "prefix cache entries evicted",
                                              registry=r)

    def key(self, scope: Hashable) -> KeyMetrics:
        """The figures of the key `scope` (an API key's index; None without keys)."""
        with self._lock:
            figures = self._keys.get(scope)
            if figures is None:
                figures = self._keys[scope] = KeyMetrics()
                if self._draft_memory_tokens is not None:
                    figures.draft_memory_tokens.set_function(lambda: self._draft_memory_tokens(scope))
                if self._prefix_cache_entries is not None:
                    figures.prefix_cache_entries.set_function(lambda: self._prefix_cache_entries(scope))
            return figures

    def render(self, scope: Hashable = None) -> bytes:
        """The exposition shown to the key `scope`: the server's figures and its own."""
        return generate_latest(self.registry) + generate_latest(self.key(scope).registry)

    def record_finished(self, prompt_tokens: int, cached_tokens: int, stats: dict[str, Any], *, latency: float,
                        ttft: float | None, scope: Hashable = None) -> None:
        """One finished sequence of the key `scope`: its tokens, forwards and finish reason (`stats`: the
        engine's), its latency from arrival to the last token and to the first committed block (None: it
        committed none)."""
        figures = self.key(scope)
        figures.prompt_tokens.inc(prompt_tokens)
        figures.cached_prompt_tokens.inc(cached_tokens)
        figures.generation_tokens.inc(stats.get("tokens", 0))
        figures.forward_passes.inc(stats.get("forward_passes", 0))
        if stats.get("forward_passes"):
            figures.tokens_per_forward.observe(stats["tokens_per_forward"])
        figures.finished.labels(stats.get("finish_reason") or "unknown").inc()
        figures.latency.observe(latency)
        if ttft is not None:
            figures.ttft.observe(ttft)

    def record_load(self, load: dict[str, int], prefix_cache_bytes: int | None) -> None:
        """The gauges, once per scheduler iteration (`load`: sequences per stage, `Scheduler.load`;
        `prefix_cache_bytes`: what the prefix cache holds, None without one)."""
        self.running.set(load["running"])
        self.queue_depth.set(load["waiting"] + load["ready"] + load["prefilling"])
        if prefix_cache_bytes is not None:
            self.prefix_cache_bytes.set(prefix_cache_bytes)
