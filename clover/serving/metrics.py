"""Prometheus metrics of one server (its own registry, so several apps can live in one process, e.g. in tests).

Names follow Prometheus conventions (`_total` is added to counters by the client library, units in the name).
The figures are the ones an operator of a block-diffusion server watches: request and token rates, tokens per
forward (how much parallel decoding buys), queue depth (backpressure), latencies, and the prefix cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from clover.serving.prefix_cache import PrefixCache

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPF_BUCKETS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("clover_requests", "HTTP requests by route and status code", ["route", "status"],
                                registry=r)
        self.prompt_tokens = Counter("clover_prompt_tokens", "prompt tokens of finished generations", registry=r)
        self.cached_prompt_tokens = Counter("clover_cached_prompt_tokens",
                                            "prompt tokens served from the prefix cache", registry=r)
        self.generation_tokens = Counter("clover_generation_tokens", "generated tokens", registry=r)
        self.forward_passes = Counter("clover_request_forward_passes",
                                      "forward passes that decided requests' tokens (summed over requests)",
                                      registry=r)
        self.engine_forwards = Counter("clover_engine_forwards", "batched model forwards run by the scheduler",
                                       registry=r)
        self.tokens_per_forward = Histogram("clover_tokens_per_forward", "tokens per forward pass, per request",
                                            buckets=TPF_BUCKETS, registry=r)
        self.batch_size = Histogram("clover_batch_size", "sequences in a batch, per denoising step",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.finished = Counter("clover_generations", "finished generations by finish reason", ["reason"],
                                registry=r)
        self.queue_depth = Gauge("clover_queue_depth", "requests waiting to join the running batch", registry=r)
        self.running = Gauge("clover_running_requests", "sequences in the running batch", registry=r)
        self.ttft = Histogram("clover_time_to_first_token_seconds", "from arrival to the first committed block",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("clover_request_latency_seconds", "from arrival to the last token",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.prefix_cache_bytes = Gauge("clover_prefix_cache_bytes", "memory held by the prefix cache", registry=r)
        self.prefix_cache_entries = Gauge("clover_prefix_cache_entries", "conversations in the prefix cache",
                                          registry=r)
        self.prefix_cache_evictions = Counter("clover_prefix_cache_evictions", "prefix cache entries evicted",
                                              registry=r)
        self.draft_memory_tokens = Gauge("clover_draft_memory_tokens",
                                         "answer tokens held by the drafting memories", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def record_finished(self, prompt_tokens: int, cached_tokens: int, stats: dict[str, Any], *, latency: float,
                        ttft: float | None) -> None:
        """One finished sequence: its tokens, forwards and finish reason (`stats`: the engine's), its latency from
        arrival to the last token and to the first committed block (None: it committed none)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_prompt_tokens.inc(cached_tokens)
        self.generation_tokens.inc(stats.get("tokens", 0))
        self.forward_passes.inc(stats.get("forward_passes", 0))
        if stats.get("forward_passes"):
            self.tokens_per_forward.observe(stats["tokens_per_forward"])
        self.finished.labels(stats.get("finish_reason") or "unknown").inc()
        self.latency.observe(latency)
        if ttft is not None:
            self.ttft.observe(ttft)

    def record_load(self, load: dict[str, int], prefix_cache: PrefixCache | None) -> None:
        """The gauges, once per scheduler iteration (`load`: sequences per stage, `Scheduler.load`)."""
        self.running.set(load["running"])
        self.queue_depth.set(load["waiting"] + load["ready"] + load["prefilling"])
        if prefix_cache is not None:
            self.prefix_cache_bytes.set(prefix_cache.memory_bytes)
            self.prefix_cache_entries.set(len(prefix_cache.entries))
