"""Where the engine's host memory lives, and giving freed memory back to the operating system.

Loading reads each weight as a float32 tensor before quantizing or packing it, then frees it. glibc
keeps freed heap pages for reuse rather than returning them, so after a quantized load the process
would keep hundreds of MB it no longer uses resident. `trim()` asks glibc to return them.

`WeightArena` places the packed weights one after another, in the order the forward pass reads
them, in memory backed by transparent huge pages where the kernel allows it. A decode step then
reads one long sequential stream instead of a few hundred scattered tensors: fewer TLB misses and
longer runs for the hardware prefetchers (measured in docs/engine.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import sys

import torch


def trim() -> bool:
    """Return free heap pages to the OS (glibc's malloc_trim); False where there is no glibc."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):  # musl and others have no malloc_trim
        return False


HUGE_PAGE = 2 << 20
_ALIGN = 64  # every tensor starts on a cache line


class WeightArena:
    """Bump allocator of host tensors in chunks of anonymous memory advised for huge pages.

    A tensor copied in keeps its chunk alive (torch.frombuffer holds the mapping), so the arena
    itself can be dropped once loading is done. Unused tails of a chunk are never touched and so
    never resident.
    """

    def __init__(self, chunk_bytes: int = 64 << 20) -> None:
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None
        self._used = 0

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of CPU tensor `t` in the arena (contiguous, 64-byte aligned)."""
        nbytes = t.numel() * t.element_size()
        if nbytes == 0 or t.device.type != "cpu":
            return t.contiguous()
        if self._chunk is None or self._used + nbytes > self._chunk.numel():
            self._chunk = huge_page_bytes(max(self.chunk_bytes, nbytes))
            self._used = 0
        view = self._chunk[self._used : self._used + nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        self._used += -(-nbytes // _ALIGN) * _ALIGN
        return view


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """`nbytes` of zeroed host memory (uint8), advised for transparent huge pages and starting on one.

    Pages become resident when first touched, not before.
    """
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # room to start on a huge page
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # huge pages disabled: ordinary pages, same layout
            region.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    skip = -whole.data_ptr() % HUGE_PAGE
    return whole[skip : skip + nbytes]


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor in huge-page memory (see huge_page_bytes)."""
    count = 1
    for n in shape:
        count *= n
    element = torch.empty((), dtype=dtype).element_size()
    return huge_page_bytes(count * element).view(dtype).view(shape)
