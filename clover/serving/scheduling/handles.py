"""The asyncio side of a request: the scheduler thread delivers each committed block to its request's handle
through `loop.call_soon_threadsafe`, and the event loop iterates the handle (or several, `merge`); a non-streamed
request's work is cancelled when its client disconnects (`until_disconnect`)."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable, Sequence as Seq, TypeVar

from fastapi import Request

from clover.engine.loops.loop import StreamPiece
from clover.serving.api.protocol import APIError

T = TypeVar("T")


class RequestHandle:
    """The asyncio side of a submitted request: iterate it for the engine's `StreamPiece`s of all its choices, in
    commit order (`choice(piece)`: which choice a piece belongs to).

    An engine failure arrives as the exception itself, and cancels the request's other choices first (a failed
    choice fails the request: its siblings must not decode on, holding slots). `cancel()` (e.g. when the client
    disconnects) frees the request's slots at the scheduler's next iteration. The scheduler hands it the `Outbox`
    its thread delivers through and the callable that cancels by its id (knowing neither the scheduler nor its
    policy)."""

    def __init__(self, request_id: int, seq_ids: Seq[int], event_loop: asyncio.AbstractEventLoop, outbox: Outbox,
                 cancel: Callable[[int], None]) -> None:
        self.id, self.n, self.event_loop = request_id, len(seq_ids), event_loop
        self._choices = {seq_id: choice for choice, seq_id in enumerate(seq_ids)}  # its sequences' ids -> choice
        self.outbox, self._cancel = outbox, cancel
        self.queue: asyncio.Queue[StreamPiece | BaseException] = asyncio.Queue()
        self.cached_tokens = [0] * self.n  # prompt tokens each choice took from the prefix cache
        self.remaining = self.n
        self.done = False

    def choice(self, piece: StreamPiece) -> int:
        return self._choices[piece.seq_id]

    def choice_of(self, seq_id: int) -> int:
        """Which choice the sequence `seq_id` is."""
        return self._choices[seq_id]

    def deliver(self, item: StreamPiece | BaseException) -> None:  # scheduler thread
        self.outbox.put(self, item)

    def cancel(self) -> None:
        if not self.done:
            self.done = True
            self._cancel(self.id)

    async def __aiter__(self) -> AsyncIterator[StreamPiece]:
        while self.remaining:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                self.cancel()  # before `done` is set: the siblings still running leave their batch
                raise item
            if item.finished:
                self.remaining -= 1
            yield item
        self.done = True



class Outbox:
    """What one scheduler iteration delivered, handed to each event loop in one call at its end (`flush`): one
    wake-up of the event loop per iteration, not one per request and block (16 streams: 16 wake-ups a step, each
    taking the GIL from the model thread). Scheduler thread only."""

    def __init__(self) -> None:
        self.items: list[tuple[RequestHandle, StreamPiece | BaseException]] = []

    def put(self, handle: RequestHandle, item: StreamPiece | BaseException) -> None:
        self.items.append((handle, item))

    def flush(self) -> None:
        by_event_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestHandle, StreamPiece | BaseException]]] = {}
        for handle, item in self.items:
            by_event_loop.setdefault(handle.event_loop, []).append((handle, item))
        self.items = []
        for event_loop, items in by_event_loop.items():
            try:
                event_loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the event loop is gone (shutdown)
                pass


def _put_all(items: list[tuple[RequestHandle, StreamPiece | BaseException]]) -> None:  # event loop
    for handle, item in items:
        handle.queue.put_nowait(item)


async def merge(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, StreamPiece]]:
    """Outputs of several requests as they come (one completion request with several prompts)."""
    if len(handles) == 1:
        async for out in handles[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, StreamPiece | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, handle: RequestHandle) -> None:
        try:
            async for out in handle:
                await queue.put((i, out))
        except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((i, exc))
        await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        open_ = len(handles)
        while open_:
            i, item = await queue.get()
            if item is None:
                open_ -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T]) -> asyncio.Task[T]:
    """Run `work` (a non-streamed request's) to its end, done or failed (the finished task), or cancel it when the
    client disconnects first: then a 499."""
    task = asyncio.ensure_future(work)
    watch = asyncio.create_task(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task not in done:
        raise APIError(499, "client disconnected", type="client_closed_request", code="client_closed_request")
    return task
