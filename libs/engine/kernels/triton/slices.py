"""What the adapter kernels share: up to three slices of a fused projection in one launch, the
token blocks, and the checks on the step's CSR entries.

A fused output (q | k | v, gate | up) has one pool, one entry list and one column range per part.
A launch takes each per-slice tensor as its own argument, three times (missing slices repeat the
first, never read), and a program picks its slice's with `pick`: plain pointer arguments keep the
launch free of any device-side pointer table, which would have to be built and copied per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import torch
import triton
import triton.language as tl

MAX_SLICES = 3  # q, k and v: the most parts a fused projection has
FLOATS = (torch.float32, torch.bfloat16, torch.float16)

T = TypeVar("T")


@triton.jit
def pick(s, v0, v1, v2):
    """Slice s's value of a pointer passed once per slice (s is 0, 1 or 2)."""
    v = v0
    if s == 1:
        v = v1
    if s == 2:
        v = v2
    return v


@triton.jit
def pick_int(s, v0, v1, v2):
    """Slice s's value of an integer passed once per slice (a select: integers that equal 1 are
    constants to Triton, so an `if` would join a constant with a variable)."""
    return tl.where(s == 0, v0, tl.where(s == 1, v1, v2))


def block_m(max_query_len: int) -> int:
    """Tokens per program: 16 for decode (the dot's minimum), up to 64 for prefill."""
    return min(64, max(16, triton.next_power_of_2(max_query_len)))


def per_slice(values: Sequence[T]) -> list[T]:
    """`values` padded to MAX_SLICES with the first (the padding is never read)."""
    return list(values) + [values[0]] * (MAX_SLICES - len(values))


def check_slices(name: str, count: int) -> None:
    if not 1 <= count <= MAX_SLICES:
        raise ValueError(f"{name}: {count} slices; a launch takes 1 to {MAX_SLICES}")


def check_csr(name: str, query_start_loc: torch.Tensor, entries: Any, lora: bool) -> None:
    """The CSR entries of one slice (libs/engine/adapters/batch.py's Entries) in the kernels' types."""
    ints = [query_start_loc, entries.entry_ptr, entries.index] + ([entries.count] if lora else [])
    if any(t.dtype != torch.int32 for t in ints) or entries.scale.dtype != torch.float32:
        raise ValueError(f"{name}: query_start_loc, entry_ptr, index and count must be int32, scale float32")
    if entries.entry_ptr.shape[0] < query_start_loc.shape[0]:
        raise ValueError(f"{name}: entry_ptr has {entries.entry_ptr.shape[0]} rows, query_start_loc more")
    if entries.scale.shape != entries.index.shape or (lora and entries.count.shape != entries.index.shape):
        raise ValueError(f"{name}: index, count and scale must have one length")


def check_rows(name: str, **tensors: torch.Tensor) -> None:
    for field, t in tensors.items():
        if t.dtype not in FLOATS:
            raise ValueError(f"{name}: {field} has dtype {t.dtype}, not float32 / bfloat16 / float16")
        if t.dim() != 2 or t.stride(1) != 1:
            raise ValueError(f"{name}: {field} must be 2-D with a contiguous last dimension")


def check_columns(name: str, width: int, col_offset: int, n: int) -> None:
    if col_offset < 0 or col_offset + n > width:
        raise ValueError(f"{name}: columns [{col_offset}, {col_offset + n}) are outside y")


def check_same_dtype(name: str, field: str, tensors: Sequence[torch.Tensor]) -> None:
    # One pointer type per argument position: a program picks among the slices' pointers.
    if len({t.dtype for t in tensors}) > 1:
        raise ValueError(f"{name}: every slice's {field} must have one dtype")


def output_blocks(widths: Sequence[int], block_n: int) -> tuple[int, list[int]]:
    """(total, first) for slices of `widths` output columns in blocks of `block_n`: the grid's
    flat block count and the first flat block of each of MAX_SLICES slices (the total for a slice
    that is absent, so no program maps to it)."""
    first, total = [], 0
    for width in widths:
        first.append(total)
        total += triton.cdiv(width, block_n)
    return total, first + [total] * (MAX_SLICES - len(first))
