// The register tiles and the blocked (GotoBLAS-style) driver shared by the float32 and the
// quantized linear layers.
//
// Weights are laid out in panels of 16 output columns, [P][K][16]. A tile computes sequential
// chains of fused multiply-adds over k, started from zero or from the partial sums it stored
// before (exactly), and threads split the panels, never K. So a row's result depends only on that
// row and the weights, never on the other rows of the batch.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vec.h"

namespace expert {

constexpr int64_t kNR = 16;    // output columns per panel (two vectors)
constexpr int64_t kMR = 6;     // rows per register tile: 12 accumulators + 2 weights + 1 broadcast
constexpr int64_t kMaxKC = 1536;  // longest K block: one panel slice is at most 96 KB, resident in L2
constexpr int64_t kMC = 48;    // rows per packed block of x
constexpr int64_t kNCP = 32;   // panels per column chunk: keeps the block of y in L2

// Register tile for packed x: a is [kc][R], b is [kc][16]; c is R rows of 16 with stride ldc. With
// `next`, each step also asks for one line of the next panel's slice into L2, so that the weights
// a 32-row decode step streams from memory arrive while this slice is multiplied.
template <int R>
inline void tile_packed(bool accumulate, const float* a, const float* b, int64_t kc, float* c, int64_t ldc,
                        const float* next = nullptr) {
  Vec c0[R], c1[R];
  for (int r = 0; r < R; ++r) {
    c0[r] = accumulate ? Vec::load(c + r * ldc) : Vec::zero();
    c1[r] = accumulate ? Vec::load(c + r * ldc + 8) : Vec::zero();
  }
  for (int64_t k = 0; k < kc; ++k) {
    const Vec b0 = Vec::load(b + k * kNR), b1 = Vec::load(b + k * kNR + 8);
    if (next != nullptr) __builtin_prefetch(next + k * kNR, 0, 2);
    for (int r = 0; r < R; ++r) {
      const Vec av = Vec::broadcast(a + k * R + r);
      c0[r] = Vec::fma(av, b0, c0[r]);
      c1[r] = Vec::fma(av, b1, c1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    c0[r].store(c + r * ldc);
    c1[r].store(c + r * ldc + 8);
  }
}

inline void tile_packed_rows(int64_t rows, bool accumulate, const float* a, const float* b, int64_t kc, float* c,
                             int64_t ldc, const float* next = nullptr) {
  switch (rows) {
    case 6: tile_packed<6>(accumulate, a, b, kc, c, ldc, next); break;
    case 5: tile_packed<5>(accumulate, a, b, kc, c, ldc, next); break;
    case 4: tile_packed<4>(accumulate, a, b, kc, c, ldc, next); break;
    case 3: tile_packed<3>(accumulate, a, b, kc, c, ldc, next); break;
    case 2: tile_packed<2>(accumulate, a, b, kc, c, ldc, next); break;
    default: tile_packed<1>(accumulate, a, b, kc, c, ldc, next); break;
  }
}

// The K block for K elements: all of K when it fits kMaxKC, else equal blocks, multiples of 16 (the
// quantized layers' block of 16 pairs). Whole panels make each thread's weight stream one
// sequential read, which the hardware prefetcher follows; blocks of 256 (16 KB slices, for L1)
// broke it into 16 KB runs and measured 10-17 % slower, at 32 rows and at 256 (docs/engine.md).
inline int64_t k_block(int64_t K) {
  const int64_t blocks = (K + kMaxKC - 1) / kMaxKC;
  return ((K + blocks - 1) / blocks + 15) / 16 * 16;
}

// y[M][N] = a[M][K] times the panels, for larger M (prefill, big batches). T is the element of x
// and of the weight slices: float, or int32 for the quantized layers (two 16-bit values per
// element, so K counts pairs there). `kernel` supplies panel slices and multiplies them:
//   kernel.slice(p, kb, kc, buf) -> const T*: panel p's rows [kb, kb + kc) as [kc][16], a
//     pointer into float32 panels or `buf` (k_block(K) * 16 elements) filled by converting codes. It is
//     asked once per panel, K block and block of rows, so converting costs 1/rows of the multiplies.
//   kernel.tile(p, kb, kc, row, rows, a, b, c, ldc): rows [row, row + rows) of y times the slice,
//     a packed as [kc][rows], written or accumulated into c.
template <class T, class Kernel>
void linear_blocked(const T* a, float* y, int64_t M, int64_t K, int64_t N, int64_t P, const Kernel& kernel) {
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    std::vector<T> apack(kMC * K);
    std::vector<float> scratch(kMC * kNR);
    const int64_t KC = k_block(K);
    std::vector<T> wbuf(KC * kNR);
    for (int64_t mb = 0; mb < M; mb += kMC) {
      const int64_t mc = std::min(kMC, M - mb);
      // Pack rows [mb, mb+mc) of x as [k block][row tile][k][rows in tile].
      for (int64_t kb = 0; kb < K; kb += KC) {
        const int64_t kc = std::min(KC, K - kb);
        T* base = apack.data() + kb * mc;
        for (int64_t t = 0; t < mc; t += kMR) {
          const int64_t rows = std::min(kMR, mc - t);
          T* dst = base + t * kc;
          for (int64_t k = 0; k < kc; ++k)
            for (int64_t r = 0; r < rows; ++r) dst[k * rows + r] = a[(mb + t + r) * K + kb + k];
        }
      }
      for (int64_t pc = p0; pc < p1; pc += kNCP) {
        const int64_t pe = std::min(p1, pc + kNCP);
        for (int64_t kb = 0; kb < K; kb += KC) {
          const int64_t kc = std::min(KC, K - kb);
          const T* base = apack.data() + kb * mc;
          for (int64_t p = pc; p < pe; ++p) {
            const bool padded = (p + 1) * kNR > N;
            float* cbase = padded ? scratch.data() : y + mb * N + p * kNR;
            const int64_t ldc = padded ? kNR : N;
            const T* bp = kernel.slice(p, kb, kc, wbuf.data());
            for (int64_t t = 0; t < mc; t += kMR) {
              const int64_t rows = std::min(kMR, mc - t);
              kernel.tile(p, kb, kc, mb + t, rows, base + t * kc, bp, cbase + t * ldc, ldc);
            }
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

}  // namespace expert
