"""Driving AsyncStreams for an HTTP request: several at once, and never past the HTTP client's disconnect.

Cancelling an AsyncStream (or closing it) aborts its request in the core, so every path out of these
helpers, normal or not, leaves nothing running in the engine.
"""
from __future__ import annotations

import asyncio
import contextlib

from starlette.requests import Request

from llmserve_client.async_client import AsyncStream


class ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


async def merge(streams: list[AsyncStream]):
    """(choice index, chunk) from several streams as they arrive. Closing or cancelling it aborts every
    stream still running; the first error ends it, raised with the failed choice's index as its
    `choice_index` (so the response can name the prompt at fault)."""
    if len(streams) == 1:   # the common case needs no tasks
        try:
            async for chunk in streams[0]:
                yield 0, chunk
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncStream) -> None:
        try:
            async for chunk in stream:
                queue.put_nowait((i, chunk, None))
            queue.put_nowait((i, None, None))
        except Exception as e:      # any failure ends the merge (as it would a single stream), never a hang
            queue.put_nowait((i, None, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            i, chunk, err = await queue.get()
            if err is not None:
                err.choice_index = i
                raise err
            if chunk is None:
                running -= 1
            else:
                yield i, chunk
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            await s.aclose()


async def exhaust(merged) -> None:
    async for _ in merged:
        pass


async def until_disconnect(request: Request, awaitable):
    """Await `awaitable` unless the HTTP client disconnects first: then cancel it (which aborts the
    request in the core) and raise ClientGone."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
