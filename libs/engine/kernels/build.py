"""Builds and loads the engine's C++ CPU kernels (torch.ops.expert_kernels).

The kernels are compiled once per machine kind with torch's cpp_extension and cached; later
loads only check that the sources are unchanged. Machines with AVX2+FMA get vector code, those
with AVX-512 VNNI besides also use it in the quantized layers' integer products, and others get a
portable build: all three compute the same values, at different speeds.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

_SOURCES = (
    "gemm.cpp",
    "qgemm.cpp",
    "norm.cpp",
    "rope_cache.cpp",
    "attention.cpp",
    "activation.cpp",
    "argmax.cpp",
    "adapters.cpp",
    "layers.cpp",
    "registration.cpp",
)
_lock = threading.Lock()
_loaded: bool | None = None
_error: str | None = None


def _isa() -> str:
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512" and torch.cpu._is_vnni_supported():
        return "avx512"
    return "avx2" if capability in ("AVX2", "AVX512") else "portable"


_CSRC = Path(__file__).resolve().parent / "csrc"


def build_dir() -> Path:
    """Where compiled kernels are cached: $EXPERT_KERNELS_DIR, else ~/.cache/expert-system/kernels.

    One folder per torch version, instruction set and source checkout, so that two checkouts (or
    a CI clone next to a work tree) never rebuild over each other's objects.
    """
    root = os.environ.get("EXPERT_KERNELS_DIR") or Path.home() / ".cache" / "expert-system" / "kernels"
    checkout = hashlib.sha1(str(_CSRC).encode()).hexdigest()[:8]
    return Path(root) / f"torch-{torch.__version__}-{_isa()}-{checkout}"


def _flags() -> list[str]:
    # fp-contract off: only the explicit fused multiply-adds in the sources may fuse, so the
    # elementwise kernels round like torch's and the reduction orders stay the written ones.
    flags = ["-O3", "-fopenmp", "-ffp-contract=off"]
    if _isa() in ("avx2", "avx512"):
        flags += ["-mavx2", "-mfma", "-mf16c"]
    if _isa() == "avx512":
        flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]
    return flags


def load(verbose: bool = False) -> bool:
    """Compile (if needed) and load the kernels; False with `load_error()` set when impossible."""
    global _loaded, _error
    with _lock:
        if _loaded is not None:
            return _loaded
        try:
            from torch.utils.cpp_extension import load as load_extension

            directory = build_dir()
            directory.mkdir(parents=True, exist_ok=True)
            sources = [str(_CSRC / name) for name in _SOURCES]
            with _builders_lock(directory):
                load_extension(
                    name=f"expert_kernels_{_isa()}",
                    sources=sources,
                    extra_cflags=_flags(),
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(directory),
                    is_python_module=False,
                    verbose=verbose,
                )
            _loaded = hasattr(torch.ops.expert_kernels, "linear")
        except Exception as exc:  # compiler missing, unsupported platform, build failure
            _error = f"{type(exc).__name__}: {exc}"
            _loaded = False
        return _loaded


@contextlib.contextmanager
def _builders_lock(directory: Path) -> Iterator[None]:
    """One build at a time in `directory`, under a lock that dies with its holder. torch's own lock
    (the file `lock`, created and deleted around a build) stays behind when a building process is
    killed (a service stopped mid-build), and every later build would wait for it forever. Every
    build here first takes this flock, which the kernel releases when its holder dies: holding it,
    a `lock` file can only be such a leftover, and goes."""
    with open(directory / "builders.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        yield


def load_error() -> str | None:
    """Why the kernels could not be loaded, if they could not."""
    return _error
