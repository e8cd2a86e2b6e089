"""OpenAI's Responses API (`POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`) over the chat path.

A request is translated into a chat request (`responses_protocol.to_chat`: its input after the conversation of
`previous_response_id`), which runs as any chat request does (`chat.start_chat`: the chat template, tool
calls, forced calls and JSON formats by grammar, reasoning, cancellation when the client leaves); its answer's
deltas become output items and stream events (`responses_format.py`). A finished response with `store` (the
default) is kept in `ServedModel.stored` (`response_store.py`: bounded, in memory), with its whole conversation, for
a later `previous_response_id` and `GET`.

Status: `completed`, or `incomplete` with `incomplete_details.reason` `max_output_tokens` when the length limit
(`max_output_tokens`, else the context) cut the answer; a failure during a stream is an `error` event and
`response.failed`. Errors before the answer starts are 4xx as for chat, naming the Responses field.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from clover.serving.chat import ChatRun, start_chat
from clover.serving.grammar_route import route
from clover.engine.loops.loop import StreamPiece
from clover.serving.api.protocol import APIError
from clover.serving.request_context import CLIENT_KEY, REQUEST_ID, request_failure
from clover.serving.api.responses_format import EventStream, OutputItems, usage
from clover.serving.api.responses_protocol import ResponsesRequest, ResponsesToolChoice, input_messages, to_chat

if TYPE_CHECKING:
    from clover.serving.served_model import ServedModel

logger = logging.getLogger(__name__)

# chat fields named in errors -> the Responses fields they came from (longest first)
RENAMED = (("response_format.json_schema.schema", "text.format.schema"), ("response_format", "text.format"),
           ("max_completion_tokens", "max_output_tokens"), ("messages", "input"))


def _renamed(exc: APIError) -> APIError:
    """A chat-path error naming the Responses field (`param`, and a field reference in the message: `name=` or
    `name:`)."""
    message, param = exc.message, exc.param
    for old, new in RENAMED:
        if param is not None and (param == old or param.startswith(old + ".")):
            param = new + param[len(old):]
        message = re.sub(rf"\b{re.escape(old)}(?=[=:])", new, message)
    return APIError(exc.status, message, code=exc.code, type=exc.type, param=param)


def not_stored(response_id: str, status: int, param: str | None, code: str) -> APIError:
    return APIError(status, f"no stored response with id {response_id!r}: it was not stored (store: false), was "
                            "evicted (the server keeps the most recently used responses up to --responses-store-mb), "
                            "or the server restarted", param=param, code=code)


async def create_response(server: ServedModel, req: ResponsesRequest, request: Request) -> Response:
    server.check_model(req.model)
    previous: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        stored = server.stored.get(req.previous_response_id, CLIENT_KEY.get())
        if stored is None:
            raise not_stored(req.previous_response_id, 400, "previous_response_id", "previous_response_not_found")
        previous = stored[1]
    conversation = previous + input_messages(req.input)
    chat = to_chat(req, conversation)
    try:
        run = await start_chat(server, chat, route(chat))
    except APIError as exc:
        raise _renamed(exc) from None
    answer = ResponseAnswer(server, req, run, conversation)
    if req.stream:
        return StreamingResponse(answer.events(), media_type="text/event-stream")
    try:
        await server.collect(request, run.handle, lambda _, out: answer.push(out))
    except APIError as exc:
        raise _renamed(exc) from None
    return JSONResponse(answer.finish()[1])


class ResponseAnswer:
    """One response as its chat run's blocks arrive: its output items, then its body (stored when asked)."""

    def __init__(self, server: ServedModel, req: ResponsesRequest, run: ChatRun,
                 conversation: list[dict[str, Any]]) -> None:
        self.server, self.req, self.run, self.conversation = server, req, run, conversation
        self.choice = run.choices[0]
        self.items = OutputItems()
        self.id, self.created = f"resp_{uuid.uuid4().hex}", int(time.time())
        self.store = req.store and server.stored.capacity > 0

    def push(self, piece: StreamPiece) -> list[dict[str, Any]]:
        delta = self.choice.push_output(piece)
        return self.items.push(delta, [c["id"] for c in self.choice.tool_calls], self.choice.cut_calls)

    def finish(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """(the events closing the output, the final body), the response stored when asked."""
        status = "incomplete" if self.choice.finish_reason == "length" else "completed"
        events = self.items.finish(status)
        reasoning = len(self.server.tokenizer.encode(self.choice.reasoning)) if self.choice.reasoning else 0
        body = self.body(status, usage(self.run.prompt_tokens, self.choice.tokens,
                                       max(self.run.handle.cached_tokens), reasoning))
        if self.store and not self.server.stored.put(self.id, body, self.conversation + [self.choice.message()],
                                                     CLIENT_KEY.get()):
            body = {**body, "store": False}  # larger than the whole store: not kept
        return events, body

    def body(self, status: str, usage: dict[str, Any] | None = None,
             error: dict[str, Any] | None = None) -> dict[str, Any]:
        req, server = self.req, self.server
        text_format = req.text_format()
        choice = req.tool_choice or "auto"
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": server.options.served_model_name, "output": self.items.items if status != "in_progress" else [],
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "previous_response_id": req.previous_response_id, "store": self.store, "background": False,
            "temperature": self.run.options.sampling.temperature, "top_p": self.run.options.sampling.top_p,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "tool_choice": choice.model_dump() if isinstance(choice, ResponsesToolChoice) else choice,
            "tools": [t.model_dump(exclude_none=True) for t in req.tools],
            "text": {"format": text_format.echo() if text_format is not None else {"type": "text"}},
            "reasoning": req.reasoning.model_dump() if req.reasoning is not None else None,
            "truncation": "disabled", "metadata": req.metadata or {}, "usage": usage,
        }

    async def events(self) -> AsyncIterator[str]:
        """The streamed response (`responses_format` module docstring); a client that leaves cancels the run."""
        stream = EventStream()
        for kind in ("response.created", "response.in_progress"):
            yield stream.event({"type": kind, "response": self.body("in_progress")})
        try:
            async for out in self.run.handle:
                for event in self.push(out):
                    yield stream.event(event)
            events, body = self.finish()
            for event in events:
                yield stream.event(event)
            yield stream.event({"type": f"response.{body['status']}", "response": body})
        except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
            logger.exception("request %s: generation failed", REQUEST_ID.get())
            error = _renamed(request_failure(exc))
            code = error.code if error.status < 500 else "server_error"  # the Responses API's code for ours
            yield stream.event({"type": "error", "code": code, "message": error.message, "param": error.param})
            yield stream.event({"type": "response.failed", "response": self.body(
                "failed", error={"code": code, "message": error.message})})
        finally:
            self.run.handle.cancel()  # no-op when finished; frees the slot when the client went away


def stored_response(server: ServedModel, response_id: str) -> dict[str, Any]:
    """`GET /v1/responses/{id}`: a stored response's body."""
    stored = server.stored.get(response_id, CLIENT_KEY.get())
    if stored is None:
        raise not_stored(response_id, 404, None, "response_not_found")
    return stored[0]


def delete_response(server: ServedModel, response_id: str) -> dict[str, Any]:
    """`DELETE /v1/responses/{id}`: the response forgotten."""
    if not server.stored.delete(response_id, CLIENT_KEY.get()):
        raise not_stored(response_id, 404, None, "response_not_found")
    return {"id": response_id, "object": "response", "deleted": True}
