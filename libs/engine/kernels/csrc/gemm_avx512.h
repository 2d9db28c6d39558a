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

// Packs rows [mb, mb + mc) of x as [K block][row tile][k][rows in tile], tiles of `height` rows.
inline void pack_rows(const float* a, int64_t K, int64_t KC, int64_t mb, int64_t mc, float* apack,
                      int64_t height = kRows) {
  for (int64_t kb = 0; kb < K; kb += KC) {
    const int64_t kc = std::min(KC, K - kb);
    float* base = apack + kb * mc;
    for (int64_t t = 0; t < mc; t += height) {
      const int64_t rows = std::min(height, mc - t);
      float* dst = base + t * kc;
      for (int64_t k = 0; k < kc; ++k)
        for (int64_t r = 0; r < rows; ++r) dst[k * rows + r] = a[(mb + t + r) * K + kb + k];
    }
  }
}

// The batched decode step (3 to kBlockRows rows) reads every weight from memory once and uses it
// for a few rows, so it runs at the pace of memory and arithmetic together only if the two
// overlap. Here a register tile is 16 rows by one panel: each weight vector loaded feeds 16 fused
// multiply-adds, a panel's K is taken in chunks of kStreamKC so that the chunk (12 KB) and the
// rows' chunk stay in L1 for the second and third row tiles, and the first row tile asks for the
// line kStreamAhead lines further on in the thread's weights, which are one sequential stream
// ([P][K][16], panels in order), one line per line it reads. On the 2-core machine, a 32-row
// product over 440 MB of weights measured about 180 GFLOPS this way against 155 for 8-row by
// 2-panel tiles over whole-K slices (a stand-alone copy of both loops, 2 threads), and the default
// model's 32-row decode step 78 ms against 85 (the two paths alternating step by step in one
// engine). Chunks of 96 to 576 and prefetch distances of 64 to 128 lines measured the same.
constexpr int64_t kStreamRows = 16;
constexpr int64_t kStreamKC = 192;
constexpr int64_t kStreamAhead = 64;

// R rows of packed x ([kc][R]) times one panel's slice ([kc][16]), written or accumulated into c
// (R rows of 16, stride ldc); with `ahead`, step k also asks for the line at ahead + k * 16 into L2.
template <int R>
inline void stream_tile(bool accumulate, const float* a, const float* b, int64_t kc, float* c, int64_t ldc,
                        const float* ahead) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = accumulate ? _mm512_loadu_ps(c + r * ldc) : _mm512_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 w = _mm512_loadu_ps(b + k * kNR);
    if (ahead != nullptr) __builtin_prefetch(ahead + k * kNR, 0, 2);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(a[k * R + r]), w, acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(c + r * ldc, acc[r]);
}

template <int R = kStreamRows>
inline void stream_tile_rows(int64_t rows, bool accumulate, const float* a, const float* b, int64_t kc, float* c,
                             int64_t ldc, const float* ahead) {
  if constexpr (R > 1) {
    if (rows < R) return stream_tile_rows<R - 1>(rows, accumulate, a, b, kc, c, ldc, ahead);
  }
  stream_tile<R>(accumulate, a, b, kc, c, ldc, ahead);
}

// y[M][N] = x[M][K] times the panels b ([P][K][16]) for 3 <= M <= kBlockRows. Chains continue
// across K chunks through y (or the padded panel's scratch), stored and reloaded exactly: the same
// bits as linear_blocked.
inline void linear_rows(const float* a, const float* b, float* y, int64_t M, int64_t K, int64_t N, int64_t P) {
  const int64_t stride = K * kNR;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> apack(M * K), scratch(M * kNR);
    pack_rows(a, K, kStreamKC, 0, M, apack.data(), kStreamRows);
    const float* end = b + p1 * stride;  // this thread's weights end here
    for (int64_t p = p0; p < p1; ++p) {
      const bool padded = (p + 1) * kNR > N;
      float* cbase = padded ? scratch.data() : y + p * kNR;
      const int64_t ldc = padded ? kNR : N;
      for (int64_t kb = 0; kb < K; kb += kStreamKC) {
        const int64_t kc = std::min(kStreamKC, K - kb);
        const float* bp = b + p * stride + kb * kNR;
        const float* ahead = bp + (kStreamAhead + kc) * kNR <= end ? bp + kStreamAhead * kNR : nullptr;
        const float* base = apack.data() + kb * M;
        for (int64_t t = 0; t < M; t += kStreamRows)
          stream_tile_rows(std::min(kStreamRows, M - t), kb > 0, base + t * kc, bp, kc, cbase + t * ldc, ldc,
                           t == 0 ? ahead : nullptr);
      }
      if (padded)
        for (int64_t r = 0; r < M; ++r)
          std::copy(scratch.data() + r * kNR, scratch.data() + r * kNR + (N - p * kNR), y + r * N + p * kNR);
    }
  });
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
