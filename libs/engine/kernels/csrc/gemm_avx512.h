// The float32 linear layer's tiles with 512-bit vectors, for machines with AVX-512F.
//
// A weight panel is 16 output columns, exactly one zmm register, so one fused multiply-add does
// what two AVX2 ones do, and the 32 registers hold a bigger tile: 8 rows by 2 panels (16
// accumulators) for prefill and batched decode, where the AVX2 tile is 6 rows by 1 panel. Every
// output element is still one sequential chain of fused multiply-adds over k, started from zero
// (or from the partial sum stored at the end of the previous K block), with threads splitting
// panels, never K: the same bits as the AVX2 and portable builds, and as batch-invariant.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "gemm_tiles.h"

#define EXPERT_F32_AVX512 1

namespace expert {
namespace avx512 {

constexpr int64_t kRows = 8;    // rows per register tile
constexpr int64_t kPanels = 2;  // panels per register tile (when two full panels are left)
constexpr int64_t kBlockRows = 48;  // rows per packed block of x (a multiple of kRows)

// R rows of packed x ([kc][R]) times NP panels' slices (panel q at b + q * stride, [kc][16]),
// written or accumulated into c (R rows of NP * 16 columns, stride ldc). With `next`, each step
// also asks for the lines of the next panels' slices, so that a batched decode step's weights
// arrive from memory while these are multiplied.
template <int R, int NP>
inline void tile(bool accumulate, const float* a, const float* b, int64_t stride, int64_t kc, float* c,
                 int64_t ldc, const float* next) {
  __m512 acc[R][NP];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < NP; ++q)
      acc[r][q] = accumulate ? _mm512_loadu_ps(c + r * ldc + q * kNR) : _mm512_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    __m512 w[NP];
    for (int q = 0; q < NP; ++q) w[q] = _mm512_loadu_ps(b + q * stride + k * kNR);
    if (next != nullptr)
      for (int q = 0; q < NP; ++q) __builtin_prefetch(next + q * stride + k * kNR, 0, 2);
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(a[k * R + r]);
      for (int q = 0; q < NP; ++q) acc[r][q] = _mm512_fmadd_ps(x, w[q], acc[r][q]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < NP; ++q) _mm512_storeu_ps(c + r * ldc + q * kNR, acc[r][q]);
}

template <int NP>
inline void tile_rows(int64_t rows, bool accumulate, const float* a, const float* b, int64_t stride, int64_t kc,
                      float* c, int64_t ldc, const float* next) {
  switch (rows) {
    case 8: tile<8, NP>(accumulate, a, b, stride, kc, c, ldc, next); break;
    case 7: tile<7, NP>(accumulate, a, b, stride, kc, c, ldc, next); break;
    case 6: tile<6, NP>(accumulate, a, b, stride, kc, c, ldc, next); break;
    case 5: tile<5, NP>(accumulate, a, b, stride, kc, c, ldc, next); break;
    case 4: tile<4, NP>(accumulate, a, b, stride, kc, c, ldc, next); break;
    case 3: tile<3, NP>(accumulate, a, b, stride, kc, c, ldc, next); break;
    case 2: tile<2, NP>(accumulate, a, b, stride, kc, c, ldc, next); break;
    default: tile<1, NP>(accumulate, a, b, stride, kc, c, ldc, next); break;
  }
}

// Packs rows [mb, mb + mc) of x as [K block][row tile][k][rows in tile].
inline void pack_rows(const float* a, int64_t K, int64_t KC, int64_t mb, int64_t mc, float* apack) {
  for (int64_t kb = 0; kb < K; kb += KC) {
    const int64_t kc = std::min(KC, K - kb);
    float* base = apack + kb * mc;
    for (int64_t t = 0; t < mc; t += kRows) {
      const int64_t rows = std::min(kRows, mc - t);
      float* dst = base + t * kc;
      for (int64_t k = 0; k < kc; ++k)
        for (int64_t r = 0; r < rows; ++r) dst[k * rows + r] = a[(mb + t + r) * K + kb + k];
    }
  }
}

// y[M][N] = x[M][K] times the panels b ([P][K][16]), for M > 2: blocks of rows packed once and
// multiplied against each thread's panels two at a time (one at the end of a thread's range and
// for the zero-padded last panel, which goes through a 16-wide scratch block).
inline void linear_blocked(const float* a, const float* b, float* y, int64_t M, int64_t K, int64_t N, int64_t P) {
  const int64_t stride = K * kNR;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    const int64_t KC = k_block(K);
    std::vector<float> apack(kBlockRows * K), scratch(kBlockRows * kNR);
    for (int64_t mb = 0; mb < M; mb += kBlockRows) {
      const int64_t mc = std::min(kBlockRows, M - mb);
      pack_rows(a, K, KC, mb, mc, apack.data());
      for (int64_t pc = p0; pc < p1; pc += kNCP) {
        const int64_t pe = std::min(p1, pc + kNCP);
        for (int64_t kb = 0; kb < K; kb += KC) {
          const int64_t kc = std::min(KC, K - kb);
          const float* base = apack.data() + kb * mc;
          for (int64_t p = pc; p < pe;) {
            const bool pair = p + kPanels <= pe && (p + kPanels) * kNR <= N;
            const int64_t width = pair ? kPanels : 1;
            const bool padded = (p + 1) * kNR > N;
            float* cbase = padded ? scratch.data() : y + mb * N + p * kNR;
            const int64_t ldc = padded ? kNR : N;
            const float* bp = b + p * stride + kb * kNR;
            const float* next = p + width < P ? bp + width * stride : nullptr;
            for (int64_t t = 0; t < mc; t += kRows) {
              const int64_t rows = std::min(kRows, mc - t);
              const float* prefetch = t == 0 ? next : nullptr;
              if (pair) tile_rows<2>(rows, kb > 0, base + t * kc, bp, stride, kc, cbase + t * ldc, ldc, prefetch);
              else tile_rows<1>(rows, kb > 0, base + t * kc, bp, stride, kc, cbase + t * ldc, ldc, prefetch);
            }
            p += width;
          }
        }
        if (pe == P && P * kNR > N) {
          const int64_t p = P - 1, width = N - p * kNR;
          for (int64_t r = 0; r < mc; ++r)
            std::copy(scratch.data() + r * kNR, scratch.data() + r * kNR + width, y + (mb + r) * N + p * kNR);
        }
      }
    }
  });
}

}  // namespace avx512
}  // namespace expert

#endif
