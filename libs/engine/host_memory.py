"""Giving freed host memory back to the operating system.

Loading reads each weight as a float32 tensor before quantizing or packing it, then frees it. glibc
keeps freed heap pages for reuse rather than returning them, so after a quantized load the process
would keep hundreds of MB it no longer uses resident. `trim()` asks glibc to return them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys


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
