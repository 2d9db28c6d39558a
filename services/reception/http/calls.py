"""A non-streamed call that ends when its client hangs up: Starlette tells a handler nothing of a
disconnect until it reads the request again, so the call races the next `http.disconnect`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")


async def unless_disconnected(request: Request, call: Awaitable[T]) -> T | None:
    """`call`'s result, or None when the client hung up first: the call is then cancelled, which
    cancels its job (ReceptionServicer.infer). The call's own exception is raised."""
    work = asyncio.ensure_future(call)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(BaseException):
                await work
    return None if work.cancelled() else work.result()


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
