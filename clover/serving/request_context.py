"""What the middleware knows of the request being served, for the code that serves it: which API key it came with
(`CLIENT_KEY`: whose prefix cache, drafting memory, stored responses and figures it reaches) and its id
(`REQUEST_ID`: what a 500 names), and the field its grammar follows (`GRAMMAR_PARAM`: what a schema the grammar
engine gives up on is named by). Context variables: each request's task (and the worker threads it starts, which
copy its context) sees its own.

What a request that fails past its checks is told, in our words and never an exception's text: `request_failure`
(its schema too complex to follow: a 400 naming the field; anything else: our bug, a 500 naming the request id) and
`unavailable` (a scheduler that stopped: a 503)."""

from __future__ import annotations

from contextvars import ContextVar

from clover.engine.constraints.grammar import GrammarTooComplex
from clover.serving.api.protocol import APIError

CLIENT_KEY: ContextVar[int | None] = ContextVar("clover_client_key", default=None)  # the key's index; None: no keys
REQUEST_ID: ContextVar[str] = ContextVar("clover_request_id", default="unknown")
GRAMMAR_PARAM: ContextVar[str] = ContextVar("clover_grammar_param", default="response_format")


def internal_error() -> APIError:
    """The 500 of a bug: it names the request id (the log line with the traceback has it too) and nothing else, so
    no exception text (paths, another request's values) reaches a client."""
    return APIError(500, f"internal server error (request id {REQUEST_ID.get()})", type="server_error",
                    code="internal_error")


def request_failure(exc: BaseException) -> APIError:
    """The error of a request whose generation raised `exc`: a schema the grammar engine gave up following is the
    client's (a 400 naming the field, `GRAMMAR_PARAM`), anything else a bug (`internal_error`)."""
    if isinstance(exc, GrammarTooComplex):
        param = GRAMMAR_PARAM.get()
        return APIError(400, f"{param}: {exc}", param=param, code="unsupported_schema")
    return internal_error()


def unavailable() -> APIError:
    """The 503 of a scheduler that stopped (shut down, or died of a bug: the log has it, not the client)."""
    return APIError(503, f"the server is not taking requests: its scheduler has stopped (request id "
                         f"{REQUEST_ID.get()})", type="server_error", code="unavailable")
