"""A step's small tensors in one buffer: written on the host with numpy, sent in one copy.

A step needs a dozen index tensors (token ids, positions, slots, block tables, sequence lengths,
adapter entries, sampling settings). Created one by one they cost a dozen allocations and
host-to-device copies per step. Here a `Layout` places them at fixed, aligned offsets of one byte
buffer; the runner fills the host side through numpy views, `send` moves the used prefix to the
device in one asynchronous copy from pinned memory, and the model reads typed views of the device
side. On the CPU the host buffer is the device buffer and nothing is copied.

Both buffers grow (by doubling) when a step needs more; nothing keeps a view past its step, so a
reallocation is safe. Graph-captured steps copy the model's part into a region of their own
(`cuda_graphs.py`), which never moves. The host buffer is rewritten only after the previous step's
sampled tokens came back, which waits for every copy issued before them.
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


class StagingBuffers:
    """A pinned host byte buffer and its device mirror (the same buffer on the CPU)."""

    def __init__(self, device: torch.device, initial_bytes: int = 1 << 16) -> None:
        self.device = device
        self.on_host = device.type == "cpu"
        self.host = self._host_buffer(initial_bytes)
        self.dev = self.host if self.on_host else torch.empty(initial_bytes, dtype=torch.uint8, device=device)
        # Views by layout key, made once per layout and buffer: building a dozen views costs more
        # host time than filling them.
        self._host_views: dict[tuple, dict[str, np.ndarray]] = {}
        self._dev_views: dict[tuple, dict[str, torch.Tensor]] = {}

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        pin = not self.on_host and torch.cuda.is_available()
        return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)

    def stage(self, layout: Layout) -> dict[str, np.ndarray]:
        """Numpy views of `layout` in the host buffer (grown to hold it), zeroed."""
        if layout.nbytes > self.host.numel():
            self.host = self._host_buffer(max(layout.nbytes, 2 * self.host.numel()))
            self._host_views.clear()
            if self.on_host:
                self.dev = self.host
                self._dev_views.clear()
        self.host[: layout.nbytes].zero_()
        return _cached(self._host_views, layout, lambda: layout.numpy_views(self.host))

    def send(self, layout: Layout) -> dict[str, torch.Tensor]:
        """Copy the staged prefix to the device (one asynchronous copy) and return typed views of it."""
        if not self.on_host:
            if layout.nbytes > self.dev.numel():
                self.dev = torch.empty(
                    max(layout.nbytes, 2 * self.dev.numel()), dtype=torch.uint8, device=self.device
                )
                self._dev_views.clear()
            self.dev[: layout.nbytes].copy_(self.host[: layout.nbytes], non_blocking=True)
        return _cached(self._dev_views, layout, lambda: layout.tensor_views(self.dev))


def _cached(cache: dict[tuple, dict], layout: Layout, make) -> dict:
    key = layout.key
    views = cache.get(key)
    if views is None:
        if len(cache) >= _CACHED_LAYOUTS:
            cache.pop(next(iter(cache)))  # the oldest
        views = cache[key] = make()
    return views
