"""What the middleware knows of the request being served, for the code that serves it: which API key it came with
(`CLIENT_KEY`: whose prefix cache, drafting memory, stored responses and figures it reaches) and its id
(`REQUEST_ID`: what a 500 names). Context variables: each request's task (and the worker threads it starts, which
copy its context) sees its own."""

from __future__ import annotations

from contextvars import ContextVar

from clover.serving.protocol import APIError

CLIENT_KEY: ContextVar[int | None] = ContextVar("clover_client_key", default=None)  # the key's index; None: no keys
REQUEST_ID: ContextVar[str] = ContextVar("clover_request_id", default="unknown")


def internal_error() -> APIError:
    """The 500 of a bug: it names the request id (the log line with the traceback has it too) and nothing else, so
    no exception text (paths, another request's values) reaches a client."""
    return APIError(500, f"internal server error (request id {REQUEST_ID.get()})", type="server_error",
                    code="internal_error")
