"""Compile the engine's Triton kernels for a Hopper GPU (sm_90) with Triton's own compiler and
ptxas, no GPU needed: `python -m tests.helpers.triton_compile` prints one line per variant and
exits non-zero if any fails. It must run without TRITON_INTERPRET (the interpreter replaces the
kernels with Python functions), so tests run it in a subprocess.

The variants are those the engine launches on the default GPU dtype (bfloat16) for the shapes of
Llama-3.2-1B, Llama-3-8B and SmolLM2-135M, plus float32 attention (single pass and split over keys)
and a float32 adapter pool: the interpreter accepts some programs the GPU compiler refuses (dot
shapes, layouts, types), and this is where those show.
"""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from libs.engine.kernels.triton import (
    attention,
    fused,
    ia3,
    lora,
    lora_expand,
    lora_shrink,
    sampling,
    split_kv,
)
from libs.engine.kernels.triton.slices import MAX_SLICES

HOPPER = GPUTarget("cuda", 90, 32)


def variants():
    """(kernel, {argument: type}, {constexpr: value}) for each variant; unnamed arguments are i32."""
    for dtype in ("bf16", "fp32"):
        p = "*" + dtype
        for head_dim, group in ((64, 4), (128, 4), (64, 3)):
            group_p = triton.next_power_of_2(group)
            for block_m in (16, 64):
                yield (
                    attention._paged_attention_kernel,
                    {"q_ptr": p, "k_ptr": p, "v_ptr": p, "out_ptr": p, "qk_scale": "fp32"}
                    | {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32"},
                    {
                        "HEAD_DIM": head_dim,
                        "BLOCK_D": head_dim,
                        "GROUP": group,
                        "GROUP_P": group_p,
                        "BLOCK_Q": block_m // group_p,
                        "BLOCK_M": block_m,
                        "BLOCK_N": 32 if dtype == "fp32" else 64,
                        "BLOCK_SIZE": 16,
                        "IEEE": dtype == "fp32",
                        "DOT_UPCAST": False,
                    },
                )
        yield from _split_kv_variants(dtype)
    p = "*bf16"
    for width in (576, 2048, 4096):
        block = {"BLOCK": triton.next_power_of_2(width)}
        yield fused._rms_norm_kernel, {"x_ptr": p, "w_ptr": p, "out_ptr": p, "eps": "fp32"}, block
        yield fused._add_rms_norm_kernel, {"x_ptr": p, "r_ptr": p, "w_ptr": p, "eps": "fp32"}, block
    yield fused._silu_and_mul_kernel, {"x_ptr": p, "out_ptr": p}, {"BLOCK": 1024}
    for heads, kv_heads, head_dim, qk_norm in ((32, 8, 64, False), (32, 8, 128, False), (9, 3, 64, True)):
        yield (
            fused._rope_and_cache_kernel,
            {"qkv_ptr": p, "q_out_ptr": p, "k_cache_ptr": p, "v_cache_ptr": p, "q_norm_ptr": p}
            | {"k_norm_ptr": p, "pos_ptr": "*i64", "slot_ptr": "*i64", "cos_sin_ptr": "*fp32", "eps": "fp32"},
            {
                "NUM_HEADS": heads,
                "NUM_KV_HEADS": kv_heads,
                "HEAD_DIM": head_dim,
                "BLOCK_SIZE": 16,
                "HAS_Q_NORM": qk_norm,
                "HAS_K_NORM": qk_norm,
                "BLOCK_HQ": triton.next_power_of_2(heads),
                "BLOCK_HKV": triton.next_power_of_2(kv_heads),
                "BLOCK_HALF": head_dim // 2,
            },
        )
    slices = {f"{name}{i}_ptr": "*i32" for name in ("entry_ptr", "index", "count") for i in range(MAX_SLICES)}
    weights = {f"scale{i}_ptr": "*fp32" for i in range(MAX_SLICES)}
    for pool, ieee in (("*bf16", False), ("*fp32", True)):
        a = {f"a{i}_ptr": pool for i in range(MAX_SLICES)}
        bt = {f"bt{i}_ptr": pool for i in range(MAX_SLICES)}
        tables = {f"table{i}_ptr": pool for i in range(MAX_SLICES)}
        for block_m in (16, 64):
            yield (
                lora_shrink._lora_shrink_kernel,
                slices | a | {"h_ptr": "*fp32", "x_ptr": p, "qsl_ptr": "*i32"},
                {"IEEE": ieee, "PAGE": 8, "BLOCK_M": block_m, "BLOCK_R": 16, "BLOCK_K": lora.BLOCK_K},
            )
            yield (
                lora_expand._lora_expand_kernel,
                slices | weights | bt | {"y_ptr": p, "h_ptr": "*fp32", "qsl_ptr": "*i32"},
                {"PAGE": 8, "BLOCK_M": block_m, "BLOCK_R": 16, "BLOCK_N": lora.BLOCK_N},
            )
        yield (
            ia3._ia3_kernel,
            slices | weights | tables | {"y_ptr": p, "qsl_ptr": "*i32"},
            {"BLOCK_M": 16, "BLOCK_N": ia3.BLOCK_N},
        )
    yield (
        sampling._top_p_cutoff_kernel,
        {"probs_ptr": "*fp32", "wanted_ptr": "*fp32", "max_ptr": "*fp32", "out_ptr": "*fp32"},
        {"BLOCK": sampling.BLOCK, "STEPS": sampling.BISECTIONS},
    )


def _split_kv_variants(dtype: str):
    """The decode split over keys: its partial and combine kernels, for the head shapes above."""
    p = "*" + dtype
    block_n = 32 if dtype == "fp32" else 64
    for head_dim, group in ((64, 4), (128, 4), (64, 3)):
        yield (
            split_kv._partial_kernel,
            {
                "q_ptr": p,
                "k_ptr": p,
                "v_ptr": p,
                "partial_ptr": "*fp32",
                "stats_ptr": "*fp32",
                "qk_scale": "fp32",
            }
            | {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32"},
            {
                "HEAD_DIM": head_dim,
                "BLOCK_D": head_dim,
                "GROUP": group,
                "BLOCK_M": 16,
                "BLOCK_N": block_n,
                "BLOCK_SIZE": 16,
                "IEEE": dtype == "fp32",
                "DOT_UPCAST": False,
            },
        )
        yield (
            split_kv._combine_kernel,
            {"partial_ptr": "*fp32", "stats_ptr": "*fp32", "out_ptr": p}
            | {"seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32"},
            {"HEAD_DIM": head_dim, "BLOCK_D": head_dim, "BLOCK_S": split_kv.MAX_SPLITS, "BLOCK_N": block_n},
        )


def main() -> int:
    failed = 0
    for kernel, types, constants in variants():
        signature = {
            name: types.get(name, "constexpr" if name in constants else "i32") for name in kernel.arg_names
        }
        try:
            triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants), target=HOPPER)
            print(f"ok   {kernel.__name__} {constants}")
        except Exception as exc:  # every variant is tried; the failures are listed
            failed += 1
            print(f"FAIL {kernel.__name__} {constants}: {type(exc).__name__}: {exc}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
