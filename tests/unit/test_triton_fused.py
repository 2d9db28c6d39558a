"""The fused Triton kernels (libs/engine/kernels/triton/fused.py) against the torch reference operators.

Without a GPU they run on CPU tensors under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1). The interpreter truncates float32 -> bfloat16 where a GPU rounds to nearest, so
there bfloat16 results may sit one ulp further from torch's than on a GPU; float16 rounds the same.
"""

from __future__ import annotations

import pytest
import torch

from libs.engine.kernels.reference import HeadLayout, TorchOps
from libs.engine.kernels.triton import fused
from libs.engine.models.rope import cos_sin_table

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETED = DEVICE.type == "cpu"
HALF_DTYPES = [torch.bfloat16, torch.float16]
EPS = 1e-6

ref = TorchOps()


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=DEVICE, dtype=dtype)


def _weight(n: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    # Norm weights near 1, as trained checkpoints have them.
    return (1.0 + _randn(n, seed=seed, scale=0.2)).to(dtype)


def _ulps(got: torch.Tensor, expected: torch.Tensor) -> int:
    """The largest distance in units in the last place between two 16-bit float tensors whose elements
    pair up by sign (the bit patterns of same-signed floats are ordered as their values)."""
    assert got.dtype == expected.dtype and got.element_size() == 2
    return int((got.view(torch.int16).int() - expected.view(torch.int16).int()).abs().max())


def _assert_rounded_alike(got: torch.Tensor, expected: torch.Tensor, max_ulps: int) -> None:
    """Bit-identical but for a few elements (float32 reduction order, a GPU's approximate rsqrt/exp),
    and those within max_ulps."""
    differ = (got.view(torch.int16) != expected.view(torch.int16)).float().mean().item()
    assert differ <= 0.005, f"{differ:.1%} of the elements differ"
    assert _ulps(got, expected) <= max_ulps


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 -> dtype as the kernels' backend converts: to nearest, but the interpreter truncates to
    bfloat16 (then the float32 value with its low 16 bits cleared converts exactly)."""
    if INTERPRETED and dtype == torch.bfloat16:
        return (x.float().view(torch.int32) & -65536).view(torch.float32).to(dtype)
    return x.to(dtype)


def _norm_ulps(dtype: torch.dtype) -> int:
    """How far RMSNorm may land from torch's: one ulp from the float32 reduction order, one more from
    a GPU's approximate rsqrt, or from the interpreter truncating to bfloat16 twice."""
    return 1 if INTERPRETED and dtype == torch.float16 else 3


@pytest.mark.parametrize("hidden", [576, 960, 1536, 2048, 4096, 8192, 14336])
def test_rms_norm_matches_torch_in_float32(hidden):
    x, w = _randn(3, hidden, seed=hidden), _weight(hidden, hidden + 1, torch.float32)
    torch.testing.assert_close(fused.rms_norm(x, w, EPS), ref.rms_norm(x, w, EPS), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("hidden", [576, 960, 4096])
def test_rms_norm_in_half_precision_rounds_where_torch_does(dtype, hidden):
    x, w = _randn(8, hidden, seed=hidden, dtype=dtype), _weight(hidden, hidden + 1, dtype)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    # The normalised value rounded to the dtype, then its product with the weight rounded.
    expected = _round(_round(h, dtype).float() * w.float(), dtype)
    got = fused.rms_norm(x, w, EPS)
    assert got.dtype == dtype and got.shape == x.shape
    _assert_rounded_alike(got, expected, max_ulps=1 if INTERPRETED else 2)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_rms_norm_in_half_precision_is_within_ulps_of_torch(dtype):
    x, w = _randn(8, 960, seed=12, dtype=dtype), _weight(960, 13, dtype)
    assert _ulps(fused.rms_norm(x, w, EPS), ref.rms_norm(x, w, EPS)) <= _norm_ulps(dtype)


def test_rms_norm_reads_strided_rows():
    wide = _randn(5, 1000, seed=1)
    x = wide[:, 100:676]  # [5, 576], row stride 1000
    w = _weight(576, 2, torch.float32)
    got = fused.rms_norm(x, w, EPS)
    assert got.is_contiguous()
    torch.testing.assert_close(got, ref.rms_norm(x, w, EPS), rtol=1e-5, atol=1e-5)


def test_rms_norm_of_no_rows_is_empty():
    x = torch.empty(0, 576, device=DEVICE)
    assert fused.rms_norm(x, _weight(576, 0, torch.float32), EPS).shape == (0, 576)


@pytest.mark.parametrize("hidden", [960, 2048])
def test_add_rms_norm_matches_torch_in_float32(hidden):
    x, r, w = _randn(4, hidden, seed=1), _randn(4, hidden, seed=2), _weight(hidden, 3, torch.float32)
    expected_x, expected_r = ref.add_rms_norm(x, r, w, EPS)
    got_x, got_r = fused.add_rms_norm(x.clone(), r.clone(), w, EPS)
    torch.testing.assert_close(got_r, expected_r, rtol=0, atol=0)
    torch.testing.assert_close(got_x, expected_x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_add_rms_norm_normalises_the_sum_rounded_to_the_dtype(dtype):
    x, r = _randn(6, 1536, seed=4, dtype=dtype), _randn(6, 1536, seed=5, dtype=dtype)
    w = _weight(1536, 6, dtype)
    got_x, got_r = fused.add_rms_norm(x.clone(), r.clone(), w, EPS)
    assert torch.equal(got_r, _round(x.float() + r.float(), dtype))
    # Normalised from that rounded residual: as close to torch as rms_norm of the residual is.
    expected_x, _ = ref.add_rms_norm(x, r, w, EPS)
    assert _ulps(got_x, ref.rms_norm(got_r, w, EPS)) <= _norm_ulps(dtype)
    assert _ulps(got_x, expected_x) <= _norm_ulps(dtype) + 1


def test_add_rms_norm_updates_x_and_residual_in_place():
    wide = _randn(4, 2 * 576, seed=7)
    x, r = wide[:, :576], _randn(4, 576, seed=8)  # x with strided rows
    w = _weight(576, 9, torch.float32)
    expected_x, expected_r = ref.add_rms_norm(x.clone(), r.clone(), w, EPS)
    untouched = wide[:, 576:].clone()
    got_x, got_r = fused.add_rms_norm(x, r, w, EPS)
    assert got_x is x and got_r is r
    torch.testing.assert_close(r, expected_r, rtol=0, atol=0)
    torch.testing.assert_close(x, expected_x, rtol=1e-5, atol=1e-5)
    assert torch.equal(wide[:, 576:], untouched)


@pytest.mark.parametrize("intermediate", [77, 1536, 14336])
def test_silu_and_mul_matches_torch_in_float32(intermediate):
    x = _randn(3, 2 * intermediate, seed=intermediate, scale=3.0)
    got = fused.silu_and_mul(x)
    assert got.shape == (3, intermediate) and got.is_contiguous()
    torch.testing.assert_close(got, ref.silu_and_mul(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_silu_and_mul_in_half_precision_rounds_once(dtype):
    x = _randn(4, 2 * 1536, seed=10, dtype=dtype, scale=3.0)
    gate, up = x.float().chunk(2, dim=-1)
    got = fused.silu_and_mul(x)
    _assert_rounded_alike(got, _round(torch.nn.functional.silu(gate) * up, dtype), max_ulps=1)
    # torch rounds silu(gate) before the product as well.
    assert _ulps(got, ref.silu_and_mul(x)) <= 2


def test_silu_and_mul_reads_strided_rows():
    wide = _randn(3, 3 * 960, seed=11)
    x = wide[:, 960:]  # [3, 2 * 960], row stride 3 * 960
    torch.testing.assert_close(fused.silu_and_mul(x), ref.silu_and_mul(x), rtol=1e-5, atol=1e-6)


# rope_and_cache: T tokens at positions beyond the first block, written to shuffled slots of random
# caches (so a write to the wrong slot shows) with some slots -1.

_ROPE_TOL = {  # (rtol, atol): torch rounds cos/sin and each product to the dtype, the kernel only the sum
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 4e-2),
    torch.float16: (2e-3, 5e-3),
}


def _rope_case(
    *,
    heads: HeadLayout,
    dtype: torch.dtype = torch.float32,
    block_size: int = 4,
    tokens: int = 7,
    qk_norm: bool = False,
    index_dtype: torch.dtype = torch.int64,
    seed: int = 0,
) -> dict:
    hq, hkv, d = heads.num_heads, heads.num_kv_heads, heads.head_dim
    num_blocks = -(-2 * tokens // block_size) + 1
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[1] = slots[tokens - 2] = -1
    return {
        "qkv": _randn(tokens, (hq + 2 * hkv) * d, seed=seed + 1, dtype=dtype),
        "positions": torch.randint(0, 200, (tokens,), generator=g).to(device=DEVICE, dtype=index_dtype),
        "cos_sin": cos_sin_table({"rope_type": "default", "rope_theta": 10000.0}, d, 256).to(DEVICE),
        "k_cache": _randn(num_blocks, hkv, block_size, d, seed=seed + 2, dtype=dtype),
        "v_cache": _randn(num_blocks, hkv, block_size, d, seed=seed + 3, dtype=dtype),
        "slot_mapping": slots.to(device=DEVICE, dtype=index_dtype),
        "q_norm": _weight(d, seed + 4, dtype) if qk_norm else None,
        "k_norm": _weight(d, seed + 5, dtype) if qk_norm else None,
        "heads": heads,
    }


def _run_both(case: dict) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(q, k_cache, v_cache) from the kernel and from the reference, each on its own cache copies."""
    heads = case["heads"]
    k_ref, v_ref = case["k_cache"].clone(), case["v_cache"].clone()
    k_got, v_got = case["k_cache"].clone(), case["v_cache"].clone()
    args = (case["qkv"], case["positions"], case["cos_sin"])
    q_ref = ref.rope_and_cache(
        *args, k_ref, v_ref, case["slot_mapping"].long(), heads, case["q_norm"], case["k_norm"], EPS
    )
    q_got = fused.rope_and_cache(
        *args,
        k_got,
        v_got,
        case["slot_mapping"],
        heads.num_heads,
        heads.num_kv_heads,
        heads.head_dim,
        case["q_norm"],
        case["k_norm"],
        EPS,
    )
    return (q_got, k_got, v_got), (q_ref, k_ref, v_ref)


def _assert_rope_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    rtol, atol = _ROPE_TOL[expected.dtype]
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, *HALF_DTYPES])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_rope_and_cache_rotates_q_like_torch(dtype, head_dim):
    case = _rope_case(heads=HeadLayout(4, 2, head_dim), dtype=dtype, seed=head_dim)
    (q, _, _), (q_ref, _, _) = _run_both(case)
    assert q.shape == (7, 4, head_dim) and q.dtype == dtype and q.is_contiguous()
    _assert_rope_close(q, q_ref)


@pytest.mark.parametrize("dtype", [torch.float32, *HALF_DTYPES])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_rope_and_cache_writes_rotated_k_and_raw_v_at_their_slots(dtype, block_size):
    case = _rope_case(heads=HeadLayout(4, 2, 32), dtype=dtype, block_size=block_size, seed=block_size)
    (_, k, v), (_, k_ref, v_ref) = _run_both(case)
    _assert_rope_close(k, k_ref)
    assert torch.equal(v, v_ref)


def test_rope_and_cache_writes_nothing_for_slot_minus_one():
    case = _rope_case(heads=HeadLayout(4, 2, 32), tokens=9, seed=3)
    case["slot_mapping"][:] = -1
    case["slot_mapping"][4] = 5
    (_, k, v), _ = _run_both(case)
    # Only slot 5 (block 1, offset 1) changed; the rest of both caches is bit-identical.
    changed = torch.zeros(case["k_cache"].shape[0], 4, dtype=torch.bool, device=DEVICE)
    changed[1, 1] = True
    for got, before in ((k, case["k_cache"]), (v, case["v_cache"])):
        same = (got == before).all(dim=-1).all(dim=1)  # [blocks, block_size]
        assert torch.equal(same, ~changed)


@pytest.mark.parametrize("dtype", [torch.float32, *HALF_DTYPES])
def test_rope_and_cache_normalises_q_and_k_per_head_before_rotating(dtype):
    case = _rope_case(heads=HeadLayout(4, 2, 64), dtype=dtype, qk_norm=True, seed=20)
    (q, k, v), (q_ref, k_ref, v_ref) = _run_both(case)
    _assert_rope_close(q, q_ref)
    _assert_rope_close(k, k_ref)
    assert torch.equal(v, v_ref)


@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (6, 2), (8, 1)])
def test_rope_and_cache_handles_each_head_layout(hq, hkv):
    case = _rope_case(heads=HeadLayout(hq, hkv, 32), seed=30 + hq, qk_norm=True)
    for got, expected in zip(*_run_both(case), strict=True):
        _assert_rope_close(got, expected)


def test_rope_and_cache_takes_int32_positions_and_slots():
    case = _rope_case(heads=HeadLayout(4, 2, 32), index_dtype=torch.int32, seed=40)
    for got, expected in zip(*_run_both(case), strict=True):
        _assert_rope_close(got, expected)


def test_rope_and_cache_writes_into_strided_cache_views():
    case = _rope_case(heads=HeadLayout(4, 2, 32), seed=50)
    (q_want, k_want, v_want), _ = _run_both(case)
    # One layer's caches as views of a [blocks, 2, Hkv, block_size, D] pool.
    pool = torch.stack([case["k_cache"], case["v_cache"]], dim=1)
    k_view, v_view = pool[:, 0], pool[:, 1]
    heads = case["heads"]
    q = fused.rope_and_cache(
        case["qkv"],
        case["positions"],
        case["cos_sin"],
        k_view,
        v_view,
        case["slot_mapping"],
        heads.num_heads,
        heads.num_kv_heads,
        heads.head_dim,
        None,
        None,
        EPS,
    )
    assert torch.equal(q, q_want) and torch.equal(pool[:, 0], k_want) and torch.equal(pool[:, 1], v_want)
