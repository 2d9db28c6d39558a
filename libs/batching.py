"""Natural batching: calls that arrive while one is in flight go out together in the next one.

A burst of work items (sixteen jobs finishing in the same engine step, say) then costs two
round trips instead of sixteen, and a lone item goes out at once: nothing waits on a timer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Coalescer(Generic[T]):
    """`await submit(item)` returns once `flush` handled a batch holding `item` (or raises what
    that flush raised). One flush runs at a time; items submitted meanwhile form the next batch."""

    def __init__(self, flush: Callable[[list[T]], Awaitable[None]], max_batch: int = 256) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.flush = flush
        self.max_batch = max_batch
        self._pending: list[tuple[T, asyncio.Future[None]]] = []
        self._worker: asyncio.Task[None] | None = None

    async def submit(self, item: T) -> None:
        done = asyncio.get_running_loop().create_future()
        # Mark an error as seen even if the submitter was cancelled meanwhile (no warning at exit).
        done.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._pending.append((item, done))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        await asyncio.shield(done)  # a cancelled submitter does not cancel the others' flush

    async def _drain(self) -> None:
        while self._pending:
            batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
            try:
                await self.flush([item for item, _ in batch])
            except Exception as exc:  # each submitter of the batch gets the error
                for _, done in batch:
                    if not done.done():
                        done.set_exception(exc)
            else:
                for _, done in batch:
                    if not done.done():
                        done.set_result(None)
