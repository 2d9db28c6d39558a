"""Top-p's cut-off without sorting the vocabulary, in Triton.

Top-p keeps a row's most likely tokens while the mass strictly before a token (in descending order)
is below `wanted` = top_p x the row's mass; ties at the cut-off value are all kept. The cut-off is
thus the smallest probability c in the row with S(c) < wanted, where S(c) is the mass of the tokens
strictly more likely than c: S falls as c grows, so that c is found by bisection, and because a
non-negative float32's bit pattern orders like its value, bisecting the 31 bits of c finds it
exactly in at most 31 passes over the row, each a masked sum. A sort of the whole vocabulary (what
the sampler's device path did before, to avoid a host sync) costs far more at 128 k-token vocabularies
and launches several kernels; this is one launch, one program per row (FlashInfer's sampling
kernels search a threshold in the same spirit).

The sums are float32 in block order, not the sorted cumulative sum of the torch path, so a row
whose mass sits within rounding of `wanted` at the boundary may keep one token more or less.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # vocabulary entries per load
BISECTIONS = 31  # the bits of a non-negative float32 below the sign


@triton.jit
def _top_p_cutoff_kernel(
    probs_ptr, stride, wanted_ptr, max_ptr, out_ptr, V, BLOCK: tl.constexpr, STEPS: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    wanted = tl.load(wanted_ptr + row)
    lo = tl.zeros([1], dtype=tl.int32)
    # S(max) = 0 < wanted: the row's largest probability always qualifies.
    hi = tl.load(max_ptr + row + tl.zeros([1], dtype=tl.int64)).to(tl.int32, bitcast=True)
    for _ in range(STEPS):
        mid = lo + (hi - lo) // 2
        threshold = mid.to(tl.float32, bitcast=True)
        above = tl.zeros([1], dtype=tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            p = tl.load(probs_ptr + row * stride + cols, mask=cols < V, other=0.0)
            above += tl.sum(tl.where(p > threshold, p, 0.0), axis=0)
        qualifies = above < wanted
        hi = tl.where(qualifies, mid, hi)
        lo = tl.where(qualifies, lo, mid + 1)
    tl.store(out_ptr + row + tl.arange(0, 1), hi.to(tl.float32, bitcast=True))


def top_p_cutoff(probs: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
    """[S] float32: per row of probs [S, V] (non-negative float32, zeros for tokens already
    filtered out), the smallest probability whose strictly larger neighbours hold less than
    wanted[row]. Keeping the tokens at or above it is top-p; one launch, no host sync."""
    if probs.dtype != torch.float32 or probs.dim() != 2 or probs.stride(1) != 1:
        raise ValueError("top_p_cutoff: probs must be a row-major [S, V] float32 tensor")
    s, v = probs.shape
    out = torch.empty(s, dtype=torch.float32, device=probs.device)
    if s:
        row_max = probs.amax(dim=-1).contiguous()
        _top_p_cutoff_kernel[(s,)](
            probs,
            probs.stride(0),
            wanted.float().contiguous(),
            row_max,
            out,
            v,
            BLOCK=BLOCK,
            STEPS=BISECTIONS,
        )
    return out
