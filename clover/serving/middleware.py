"""What stands in front of the routes: the ASGI guard (request id, API key, body size, the last stop for
exceptions, request metrics) and the exception handlers that turn framework errors into OpenAI's error format.

Every error is OpenAI's `{"error": {"message", "type", "param", "code"}}`, always with a code: pydantic's
validation errors and Starlette's HTTP errors are mapped here; `APIError`s raised by the handlers pass through.
"""

from __future__ import annotations

import hmac
import json
import logging
import uuid
from typing import TYPE_CHECKING, Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from clover.serving.request_context import CLIENT_KEY, REQUEST_ID, internal_error
from clover.serving.api.protocol import APIError

if TYPE_CHECKING:
    from clover.serving.served_model import ServedModel

logger = logging.getLogger(__name__)

ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/health", "/metrics"}  # labels
PATH_ROUTES = (("/v1/models/", "/v1/models/{model}"), ("/v1/responses/", "/v1/responses/{id}"))


class RequestGuard:
    """Pure ASGI middleware in front of every route: request id, API key, body size limit, the last stop for
    exceptions, request metrics.

    The body is read here (up to the limit) and replayed to the app, so an oversized body is refused before any
    parsing, whether or not the client sent a Content-Length. Every response carries an `x-request-id` header.

    An exception that no route turned into an error response becomes a 500 here, naming the request id (the log
    line with the traceback has it too), and the middleware returns normally. It must not reach the ASGI server:
    Starlette's `ServerErrorMiddleware` sends its 500 and then re-raises, and uvicorn answers a raise by dropping
    the connection without `Connection: close`, so a client reusing the keep-alive connection (httpx, the
    `openai` client) would fail on its next, valid request."""

    def __init__(self, app: Any, server: ServedModel) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in ROUTES else next((r for prefix, r in PATH_ROUTES if path.startswith(prefix)), "other")
        request_id = f"req_{uuid.uuid4().hex}"
        REQUEST_ID.set(request_id)
        status: dict[str, int | None] = {"code": None, "left": None}

        async def send_counted(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", request_id.encode())]}
            await send(message)

        async def receive_watched() -> dict[str, Any]:
            message = await receive()
            if message["type"] == "http.disconnect":
                status["left"] = 499
            return message

        try:
            await self._guarded(scope, receive_watched, send_counted, path)
        except Exception:  # noqa: BLE001 - a bug: answered as a 500, the connection kept
            logger.exception("request %s: %s %s failed", request_id, scope.get("method"), path)
            if status["code"] is None:
                await send_error(send_counted, internal_error())
            # else the response had started: it stays incomplete, and the ASGI server closes the connection
        finally:
            # no response started: the client closed the request (499, nginx's code), or sending the 500 failed
            code = status["code"] or status["left"] or 500
            self.server.metrics.requests.labels(route, str(code)).inc()

    async def _guarded(self, scope: dict[str, Any], receive: Callable, send: Callable, path: str) -> None:
        keys = self.server.options.api_keys
        if keys:
            headers = dict(scope.get("headers") or [])
            scheme, _, token = headers.get(b"authorization", b"").strip().partition(b" ")
            # the scheme name is case-insensitive (RFC 7235 §2.1); the token is compared in constant time with
            # every key (which one matched is the request's identity: its prefix cache, drafting memory, stored
            # responses and figures: request_context.CLIENT_KEY)
            matched = [hmac.compare_digest(token.strip(), key.encode()) for key in keys]
            if scheme.lower() == b"bearer" and any(matched):
                CLIENT_KEY.set(matched.index(True))
            elif path != "/health":  # /health answers without a key (its load figures only with one)
                await send_error(send, APIError(401, "invalid or missing API key (Authorization: Bearer <key>)",
                                                 type="invalid_request_error", code="invalid_api_key"))
                return
        limit = self.server.options.max_body_bytes
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > limit:
                await send_error(send, APIError(413, f"request body larger than {limit} bytes",
                                                 code="request_too_large"))
                return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def send_error(send: Callable, error: APIError) -> None:
    payload = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


def validation_error(exc: RequestValidationError) -> APIError:
    """The first of pydantic's errors as a 400 naming the field, with an OpenAI-style code: `invalid_json`,
    `missing_required_parameter`, `invalid_type` (a string where a number belongs, ...), `invalid_unicode`
    (lone surrogates), `nesting_too_deep` (JSON values), `schema_too_large` (a response format's schema),
    `unsupported_parameter` (what this server cannot do), else `invalid_value` (out of range, unknown role, ...)."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request", code="invalid_request")
    first = errors[0]
    kind = first.get("type", "")
    if kind == "json_invalid":
        reason = first.get("ctx", {}).get("error", first.get("msg"))
        return APIError(400, f"the request body is not valid JSON: {reason}", code="invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    where = ".".join(loc) or "body"
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    code = ("missing_required_parameter" if kind == "missing"
            else kind if kind in ("invalid_unicode", "nesting_too_deep", "schema_too_large", "unsupported_parameter")
            else "invalid_type" if kind.endswith(("_type", "_parsing")) else "invalid_value")
    return APIError(400, f"{where}: {first.get('msg')}{more}", param=where if loc else None, code=code)


def http_error(exc: StarletteHTTPException) -> APIError:
    """Starlette's and FastAPI's own errors (unknown route, wrong method, a body the JSON parser refused)."""
    if exc.status_code == 400 and exc.__cause__ is not None:
        # FastAPI's "There was an error parsing the body": invalid UTF-8, an integer of more than 4300 digits,
        # nesting deeper than the parser's recursion limit. The cause says which.
        return APIError(400, f"the request body is not valid JSON: {exc.__cause__}", code="invalid_json")
    code = {404: "not_found", 405: "method_not_allowed"}.get(
        exc.status_code, "internal_error" if exc.status_code >= 500 else "invalid_request")
    return APIError(exc.status_code, str(exc.detail), code=code,
                    type="server_error" if exc.status_code >= 500 else "invalid_request_error")


def add_error_handling(app: FastAPI, server: ServedModel) -> None:
    """The exception handlers of `app`, and `RequestGuard` as its outermost middleware."""

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(validation_error(exc).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = http_error(exc)
        return JSONResponse(error.body(), status_code=error.status, headers=getattr(exc, "headers", None))

    # any other exception: a 500 from `RequestGuard`, which keeps the connection (no handler for Exception here)
    app.add_middleware(RequestGuard, server=server)
