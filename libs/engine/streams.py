"""RequestStream: one request's outputs, as an async iterator on the event loop.

The engine thread hands outputs over with `call_soon_threadsafe`, so the decode loop never waits
for a consumer, however slow. A stream holds at most `max_pending` outputs: when a consumer falls
behind, new outputs are merged into the last one waiting (text appended for DELTA, replaced for
CUMULATIVE), so memory stays bounded without dropping or blocking anything.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

from libs.engine.outputs import RequestOutput, merge_outputs
from libs.engine.sampling_params import OutputKind

log = logging.getLogger(__name__)


class RequestStream:
    """The outputs of one request as an async iterator; ends after the finished output."""

    def __init__(
        self,
        request_id: str,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
        max_pending: int = 64,
        on_finished: Callable[[RequestOutput], None] | None = None,
    ) -> None:
        self.request_id = request_id
        self.output_kind = output_kind
        self.max_pending = max_pending
        self.on_finished = on_finished
        self._items: deque[RequestOutput | BaseException] = deque()
        self._ready = asyncio.Event()
        self.finished = False
        self.coalesced = 0  # outputs merged because the consumer was behind

    def deliver(self, item: RequestOutput | BaseException) -> None:
        """The engine's side, on the event loop: add an output, or the error that ends the stream."""
        if self.on_finished is not None and isinstance(item, RequestOutput) and item.finished:
            # On arrival, not when read: a consumer that went away (a cancelled call) never reads it.
            try:
                self.on_finished(item)
            except Exception:
                log.exception("on_finished of request %s failed", self.request_id)
        last = self._items[-1] if self._items else None
        if (
            len(self._items) >= self.max_pending
            and isinstance(item, RequestOutput)
            and isinstance(last, RequestOutput)
        ):
            self._items[-1] = merge_outputs(last, item, self.output_kind)
            self.coalesced += 1
        else:
            self._items.append(item)
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item
