"""A step's small tensors in one buffer: written on the host with numpy, sent in one copy.

A step needs a dozen index tensors (token ids, positions, slots, block tables, sequence lengths,
adapter entries, sampling settings). Created one by one they cost a dozen allocations and
host-to-device copies per step. Here a `Layout` places them at fixed, aligned offsets of one byte
buffer; the runner fills the host side through numpy views, `send` moves the used prefix to the
device in one asynchronous copy from pinned memory, and the model reads typed views of the device
side. On the CPU the host buffer is the device buffer and nothing is copied.

**A host buffer is never rewritten before the copy that reads it has run.** An asynchronous copy
reads the pinned buffer when the stream reaches it, which may be after the host has moved on: a
step that samples nothing returns without waiting for the device, so the next step's staging would
otherwise zero and refill the buffer under a copy still queued behind the previous step's work
(wrong token ids, positions and slots for the third chunk of a long prompt on an idle server).
So the host side is two buffers used in turn, each copy records an event, and staging into a
buffer first waits for that buffer's last copy. With two buffers the wait is for the copy of two
steps ago, which a step that sampled anything has already waited past, so it costs nothing there.

Both sides grow (by doubling) when a step needs more; nothing keeps a view past its step, so a
reallocation is safe (a host buffer is replaced only after its last copy has run; the device
buffer's old storage is freed in stream order). Graph-captured steps copy the model's part into a
region of their own (`cuda_graphs.py`), which never moves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

_ALIGN = 64  # bytes: every field starts on a cache line (and on any dtype's alignment)

_NUMPY = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32}
_SIZE = {torch.int32: 4, torch.int64: 8, torch.float32: 4}
_CACHED_LAYOUTS = 64  # view sets kept per buffer (a decode step's layout repeats step after step)


@dataclass(frozen=True)
class Field:
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


@dataclass
class Layout:
    """Named fields at aligned offsets, in the order they were added."""

    fields: dict[str, Field] = field(default_factory=dict)
    nbytes: int = 0

    def add(self, name: str, dtype: torch.dtype, *shape: int) -> None:
        if name in self.fields:
            raise ValueError(f"layout field {name!r} added twice")
        offset = -(-self.nbytes // _ALIGN) * _ALIGN
        count = 1
        for n in shape:
            count *= n
        f = Field(offset, dtype, tuple(shape), count * _SIZE[dtype])
        self.fields[name] = f
        self.nbytes = offset + f.nbytes

    def copy(self) -> Layout:
        return Layout(dict(self.fields), self.nbytes)

    def before(self, name: str) -> Layout:
        """The fields placed before `name` (a layout ending where `name` starts)."""
        end = self.fields[name].offset
        return Layout({n: f for n, f in self.fields.items() if f.offset < end}, end)

    @property
    def key(self) -> tuple:
        """Equal for layouts with the same fields at the same places (their views are interchangeable)."""
        return tuple((name, f.offset, f.dtype, f.shape) for name, f in self.fields.items())

    def __contains__(self, name: str) -> bool:
        return name in self.fields

    def numpy_views(self, buffer: torch.Tensor) -> dict[str, np.ndarray]:
        """Writable numpy views of each field in a host byte buffer."""
        raw = buffer.numpy()
        return {
            name: raw[f.offset : f.offset + f.nbytes].view(_NUMPY[f.dtype]).reshape(f.shape)
            for name, f in self.fields.items()
        }

    def tensor_views(self, buffer: torch.Tensor, base: int = 0) -> dict[str, torch.Tensor]:
        """Typed tensor views of each field in a byte buffer (device or host), the layout starting
        at byte `base`."""
        return {
            name: buffer[base + f.offset : base + f.offset + f.nbytes].view(f.dtype).view(f.shape)
            for name, f in self.fields.items()
        }


class StreamCopies:
    """Host-to-device copies queued on the current CUDA stream, each with an event recorded after it."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event:
        dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return done

    def wait(self, done: torch.cuda.Event) -> None:
        done.synchronize()


HOST_BUFFERS = 2  # used in turn: one being filled while the other's copy may still be queued


class StagingBuffers:
    """Pinned host byte buffers used in turn and their device mirror (on the CPU, one buffer that is
    both). `copies` issues the host-to-device copies and waits for them: the CUDA stream's by
    default; tests pass a stream of their own that runs copies late."""

    def __init__(
        self, device: torch.device, initial_bytes: int = 1 << 16, copies: StreamCopies | None = None
    ) -> None:
        self.device = device
        self.on_host = device.type == "cpu" and copies is None
        self.copies = copies if copies is not None else (None if self.on_host else StreamCopies())
        turns = 1 if self.on_host else HOST_BUFFERS
        self._hosts = [self._host_buffer(initial_bytes) for _ in range(turns)]
        self._pending: list[object | None] = [None] * turns  # each buffer's last copy, until waited for
        self._turn = 0
        self.dev = self.host if self.on_host else torch.empty(initial_bytes, dtype=torch.uint8, device=device)
        # Views by layout key, made once per layout and buffer: building a dozen views costs more
        # host time than filling them.
        self._host_views: list[dict[tuple, dict[str, np.ndarray]]] = [{} for _ in range(turns)]
        self._dev_views: dict[tuple, dict[str, torch.Tensor]] = {}

    @property
    def host(self) -> torch.Tensor:
        """The host buffer of the step being staged."""
        return self._hosts[self._turn]

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        pin = not self.on_host and torch.cuda.is_available()
        return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)

    def stage(self, layout: Layout) -> dict[str, np.ndarray]:
        """Numpy views of `layout` in the next host buffer (grown to hold it), zeroed, once the copy
        that last read that buffer has run."""
        if not self.on_host:
            self._turn = (self._turn + 1) % len(self._hosts)
            pending = self._pending[self._turn]
            if pending is not None:
                self.copies.wait(pending)
                self._pending[self._turn] = None
        if layout.nbytes > self.host.numel():
            self._hosts[self._turn] = self._host_buffer(max(layout.nbytes, 2 * self.host.numel()))
            self._host_views[self._turn].clear()
            if self.on_host:
                self.dev = self.host
                self._dev_views.clear()
        self.host[: layout.nbytes].zero_()
        return _cached(self._host_views[self._turn], layout, lambda: layout.numpy_views(self.host))

    def send(self, layout: Layout) -> dict[str, torch.Tensor]:
        """Copy the staged prefix to the device (one asynchronous copy) and return typed views of it."""
        if not self.on_host:
            if layout.nbytes > self.dev.numel():
                self.dev = torch.empty(
                    max(layout.nbytes, 2 * self.dev.numel()), dtype=torch.uint8, device=self.device
                )
                self._dev_views.clear()
            self._pending[self._turn] = self.copies.copy(
                self.dev[: layout.nbytes], self.host[: layout.nbytes]
            )
        return _cached(self._dev_views, layout, lambda: layout.tensor_views(self.dev))


def _cached(cache: dict[tuple, dict], layout: Layout, make) -> dict:
    key = layout.key
    views = cache.get(key)
    if views is None:
        if len(cache) >= _CACHED_LAYOUTS:
            cache.pop(next(iter(cache)))  # the oldest
        views = cache[key] = make()
    return views
