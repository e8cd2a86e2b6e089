"""Clover's OpenAI-compatible server: continuous batching at block granularity, prefix reuse, tool calls.

    from clover.serving import create_app, ServerOptions
    app = create_app("checkpoints/clover-smol", options=ServerOptions(api_key="secret"))

Roles: `app` (routes), `served_model` (options, model and scheduler, what the routes share), `locked_tokenizer`
(the tokenizer behind a lock), `chat` / `completions` (each route's request flow), `middleware` (request ids, auth,
errors), `request_context` (the calling key and request id), `draft_memories` (whose answers draft whose),
`structured` (response_format by decision mode), `grammar_route` (response_format and forced tool calls by
grammar), `responses` / `response_store` (the Responses API over the chat flow), `metrics` (Prometheus),
`request_log` (--record-requests); `api` (the wire: `protocol` request models, error format, request -> engine
options; `openai_format` response bodies, SSE; `responses_protocol` / `responses_format` the Responses API's),
`scheduling` (continuous batching: `scheduler` the batch's background thread, `scheduler_policy` admit / join /
step / drop, `handles` the asyncio side, `prefix_cache` reused prompt prefixes, `prefix_blocks` the KV blocks its
entries share, `heap` free heap memory given back when idle), `vllm` (Clover checkpoints on vLLM's server);
reasoning / tool calls are parsed by `clover.assistant_output`. Semantics and measured figures: docs/serving.md.
"""

from typing import Any

__all__ = ["ServerOptions", "create_app"]


def __getattr__(name: str) -> Any:  # lazy: the parser and protocol modules do not need FastAPI or the engine
    if name in __all__:
        from clover.serving import app  # deferred: FastAPI and the engine, for the app only

        return getattr(app, name)
    raise AttributeError(f"module 'clover.serving' has no attribute {name!r}")
