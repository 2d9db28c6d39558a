// The float32 linear layer's tiles with 512-bit vectors, for machines with AVX-512F.
//
// A weight panel is 16 output columns, exactly one zmm register, so one fused multiply-add does
// what two AVX2 ones do, and the 32 registers hold a bigger tile: 8 rows by 3 panels (24
// accumulators, 3 weight vectors and a broadcast), where the AVX2 tile is 6 rows by 1 panel. Every
// output element is still one sequential chain of fused multiply-adds over k, started from zero
// (or from the partial sum stored at the end of the previous K chunk), with threads splitting
// panels, never K: the same bits as the AVX2 and portable builds, and as batch-invariant.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "gemm_tiles.h"
#include "work_runs.h"

#define EXPERT_F32_AVX512 1

namespace expert {
namespace avx512 {

constexpr int64_t kRows = 8;        // rows per register tile
constexpr int64_t kPanels = 3;      // panels per register tile (when three full panels are left)
constexpr int64_t kChunk = 192;     // k per chunk: a 3-panel slice (36 KB) stays in L1 for every row tile
constexpr int64_t kBlockRows = 48;  // rows per block of x (a multiple of kRows)
constexpr int64_t kUnroll = 4;      // k steps per prefetch step
constexpr int64_t kRunGroups = 3;   // adjacent groups a thread takes at once when rows are few...
constexpr int64_t kLongRun = 64;    // ...or up to this many, while each thread still gets 8 runs

// Asks for the lines of the chunk multiplied next (up to kPanels slices of kc lines, `stride`
// apart) into L2, `per_step` lines per call of step() (one call every kUnroll steps of the current
// chunk's tiles), so that the weights arrive from memory at the pace they are used, whatever the
// number of rows.
struct Prefetcher {
  const float* line = nullptr;  // next line to ask for
  const float* slice = nullptr;  // start of the slice being asked for
  int64_t stride = 0, kc = 0, left_in_slice = 0;
  int slices_left = 0, per_step = 0;

  void aim(const float* first, int slices, int64_t slice_stride, int64_t lines, int64_t steps) {
    line = slice = first;
    stride = slice_stride;
    kc = left_in_slice = lines;
    slices_left = slices;
    per_step = static_cast<int>((slices * lines + steps - 1) / std::max<int64_t>(steps, 1));
  }
  inline void step() {
    for (int i = 0; i < per_step && slices_left > 0; ++i) {
      __builtin_prefetch(line, 0, 2);
      line += kNR;
      if (--left_in_slice == 0) {
        slice += stride;
        line = slice;
        left_in_slice = kc;
        --slices_left;
      }
    }
  }
};

// R rows of packed x (xp: [kc][kRows], row r of step k at xp[k * kRows + r]) times NP panels'
// slices (panel q at b + q * stride, [kc][16]), written or accumulated into c (R rows of NP * 16
// columns, stride ldc). Every kUnroll steps also ask the prefetcher, if any, for its share of the
// next chunk's lines.
//
// Why packed x and steps in fours: the 8 rows read in place needed 8 row pointers, which with the
// weights' pointers and the prefetcher's state did not fit in the general registers, so every step
// reloaded some from the stack and ran the prefetcher's loop; packed, one pointer serves all 8 rows.
// One tile alone on data in L1: 174 GFLOPS against 135-161 (the core's fused multiply-add peak is
// about 183). In the engine, old and new alternating: 32-row decode steps +4.4 %, 2,048-token
// prefill steps +2.1 % (medians of 8 pairs).
template <int R, int NP>
inline void tile(bool accumulate, const float* xp, const float* b, int64_t stride, int64_t kc, float* c, int64_t ldc,
                 Prefetcher* prefetch) {
  __m512 acc[R][NP];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < NP; ++q)
      acc[r][q] = accumulate ? _mm512_loadu_ps(c + r * ldc + q * kNR) : _mm512_setzero_ps();
  // A local copy keeps the prefetcher's fields in registers: through the pointer they lived in
  // memory, a load and a store on every step (3.6 % of a 32-row decode step, median of 8 pairs).
  Prefetcher ahead = prefetch != nullptr ? *prefetch : Prefetcher{};
  auto step = [&](int64_t k) {
    __m512 w[NP];
    for (int q = 0; q < NP; ++q) w[q] = _mm512_loadu_ps(b + q * stride + k * kNR);
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(xp[k * kRows + r]);
      for (int q = 0; q < NP; ++q) acc[r][q] = _mm512_fmadd_ps(x, w[q], acc[r][q]);
    }
  };
  int64_t k = 0;
  for (; k + kUnroll <= kc; k += kUnroll) {
    ahead.step();
    for (int u = 0; u < kUnroll; ++u) step(k + u);
  }
  for (; k < kc; ++k) step(k);
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < NP; ++q) _mm512_storeu_ps(c + r * ldc + q * kNR, acc[r][q]);
  if (prefetch != nullptr) *prefetch = ahead;
}

template <int NP>
inline void tile_rows(int64_t rows, bool accumulate, const float* xp, const float* b, int64_t stride, int64_t kc,
                      float* c, int64_t ldc, Prefetcher* prefetch) {
  switch (rows) {
    case 8: tile<8, NP>(accumulate, xp, b, stride, kc, c, ldc, prefetch); break;
    case 7: tile<7, NP>(accumulate, xp, b, stride, kc, c, ldc, prefetch); break;
    case 6: tile<6, NP>(accumulate, xp, b, stride, kc, c, ldc, prefetch); break;
    case 5: tile<5, NP>(accumulate, xp, b, stride, kc, c, ldc, prefetch); break;
    case 4: tile<4, NP>(accumulate, xp, b, stride, kc, c, ldc, prefetch); break;
    case 3: tile<3, NP>(accumulate, xp, b, stride, kc, c, ldc, prefetch); break;
    case 2: tile<2, NP>(accumulate, xp, b, stride, kc, c, ldc, prefetch); break;
    default: tile<1, NP>(accumulate, xp, b, stride, kc, c, ldc, prefetch); break;
  }
}

// Eight rows of x, 16 columns from k, transposed into out[j * kRows + r] = row r's column k + j
// (128 floats): unpacking pairs of rows, then pairs of pairs, leaves in each 128-bit lane l of
// the eight vectors four rows of one column 4l + j; two rounds of lane shuffles put the lanes in
// column order.
inline void transpose_8x16(const float* src, int64_t K, float* out) {
  __m512 r[kRows];
  for (int i = 0; i < kRows; ++i) r[i] = _mm512_loadu_ps(src + i * K);
  __m512 t[kRows];
  for (int i = 0; i < kRows; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);      // lane l: rows i, i+1 of columns 4l, 4l+1
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);  // lane l: rows i, i+1 of columns 4l+2, 4l+3
  }
  __m512 a[4], b[4];  // lane l of a[j] (b[j]): rows 0-3 (4-7) of column 4l + j
  for (int h = 0; h < 2; ++h) {
    const __m512d lo01 = _mm512_castps_pd(t[h]), lo23 = _mm512_castps_pd(t[2 + h]);
    const __m512d hi01 = _mm512_castps_pd(t[4 + h]), hi23 = _mm512_castps_pd(t[6 + h]);
    a[2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo01, lo23));
    a[2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo01, lo23));
    b[2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(hi01, hi23));
    b[2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(hi01, hi23));
  }
  __m512 lo[4], hi[4];  // lanes (a[j] l, a[j] l+1, b[j] l, b[j] l+1) for l = 0 and l = 2
  for (int j = 0; j < 4; ++j) {
    lo[j] = _mm512_shuffle_f32x4(a[j], b[j], _MM_SHUFFLE(1, 0, 1, 0));
    hi[j] = _mm512_shuffle_f32x4(a[j], b[j], _MM_SHUFFLE(3, 2, 3, 2));
  }
  // Output vector m holds columns 2m and 2m + 1 (all 8 rows of each): column 4l + j is lane l of a[j], b[j].
  for (int m = 0; m < 8; ++m) {
    const int j = 2 * (m & 1), l = (m >> 1) & 1;
    const __m512* half = m < 4 ? lo : hi;
    const __m512 v = l == 0 ? _mm512_shuffle_f32x4(half[j], half[j + 1], _MM_SHUFFLE(2, 0, 2, 0))
                            : _mm512_shuffle_f32x4(half[j], half[j + 1], _MM_SHUFFLE(3, 1, 3, 1));
    _mm512_storeu_ps(out + m * 16, v);
  }
}

// Rows [mb, mb + mc) of x (K columns) as tiles of kRows rows, each [K][kRows] (a short last tile
// leaves its unused rows as they were: no step reads them). Full tiles go through transpose_8x16:
// a block of 48 rows of 576 in 2.8 us against 6.5 element by element, which, when both threads
// packed every block (before runs), was worth 1-6 % of the 30 layers' projections at 2,048 rows.
inline void pack_block(const float* a, int64_t K, int64_t mb, int64_t mc, float* out) {
  for (int64_t t = 0; t < mc; t += kRows) {
    const int64_t rows = std::min(kRows, mc - t);
    float* tile = out + t * K;
    int64_t k0 = 0;
    if (rows == kRows)
      for (; k0 + 16 <= K; k0 += 16) transpose_8x16(a + (mb + t) * K + k0, K, tile + k0 * kRows);
    for (int64_t r = 0; r < rows; ++r) {
      const float* src = a + (mb + t + r) * K;
      for (int64_t k = k0; k < K; ++k) tile[k * kRows + r] = src[k];
    }
  }
}

// One work item of linear_tiled: rows [mb, mb + mc) of y times the group of `width` panels from
// panel p, over all of K in chunks of kChunk; xpack holds the block's rows packed by pack_block.
// The tiles' steps ask for the lines of the chunk multiplied next: this group's next chunk, then,
// in the last chunk, the first chunk of `next` (the first panel of the group this thread
// multiplies next, next_width panels wide), if there is one.
// A zero-padded last panel is computed into `scratch` (kBlockRows rows of 16) and copied out.
inline void multiply_group(const float* xpack, const float* b, float* y, int64_t K, int64_t N, int64_t mb, int64_t mc,
                           int64_t p, int64_t width, const float* next, int64_t next_width, float* scratch) {
  const int64_t stride = K * kNR, tiles = (mc + kRows - 1) / kRows;
  const bool padded = (p + 1) * kNR > N;
  float* cbase = padded ? scratch : y + mb * N + p * kNR;
  const int64_t ldc = padded ? kNR : N;
  for (int64_t kb = 0; kb < K; kb += kChunk) {
    const int64_t kc = std::min(kChunk, K - kb);
    const int64_t steps = tiles * std::max<int64_t>(1, kc / kUnroll);
    Prefetcher prefetch;
    Prefetcher* ahead = &prefetch;
    if (kb + kc < K) prefetch.aim(b + p * stride + (kb + kc) * kNR, width, stride, std::min(kChunk, K - kb - kc), steps);
    else if (next != nullptr) prefetch.aim(next, next_width, stride, std::min(kChunk, K), steps);
    else ahead = nullptr;
    const float* bp = b + p * stride + kb * kNR;
    for (int64_t t = 0; t < mc; t += kRows) {
      const int64_t rows = std::min(kRows, mc - t);
      float* c = cbase + t * ldc;
      const float* xp = xpack + t * K + kb * kRows;
      if (width == 3) tile_rows<3>(rows, kb > 0, xp, bp, stride, kc, c, ldc, ahead);
      else if (width == 2) tile_rows<2>(rows, kb > 0, xp, bp, stride, kc, c, ldc, ahead);
      else tile_rows<1>(rows, kb > 0, xp, bp, stride, kc, c, ldc, ahead);
    }
  }
  if (padded)
    for (int64_t r = 0; r < mc; ++r) std::copy(scratch + r * kNR, scratch + r * kNR + (N - p * kNR), y + (mb + r) * N + p * kNR);
}

// The panels in groups of up to kPanels: (first panel, width), the zero-padded last panel alone.
inline std::vector<std::pair<int64_t, int64_t>> panel_groups(int64_t N, int64_t P) {
  std::vector<std::pair<int64_t, int64_t>> groups;
  for (int64_t p = 0; p < P;) {
    int64_t width = std::min(kPanels, P - p);
    while (width > 1 && (p + width) * kNR > N) --width;  // the padded panel goes alone
    groups.emplace_back(p, width);
    p += width;
  }
  return groups;
}

// How many consecutive items a thread takes from the shared counter at once (see linear_tiled).
inline int64_t items_per_run(int64_t blocks, int64_t groups, int64_t threads) {
  if (blocks >= 4 * threads) return groups;  // whole blocks of rows
  const int64_t items = blocks * groups;
  const int64_t adjacent = std::min(kRunGroups, items / (2 * threads));  // still two runs per thread
  return std::max<int64_t>({1, adjacent, std::min(kLongRun, items / (8 * threads))});
}

// y[M][N] = x[M][K] times the panels b ([P][K][16]), for M > 2: a batched decode step, the LM
// head, a prefill chunk. The work is items of (block of up to kBlockRows rows, group of up to 3
// panels), in order of row block then group, which the threads take in runs of consecutive items
// from a shared counter (work_runs.h). An item runs the group's K in chunks of kChunk: the
// chunk's 36 KB of weights come from memory (or L3) once and stay in L1 while every row tile of
// the block multiplies them, while the tiles' steps ask for the lines of the next chunk into L2:
// the group's next chunk, or the first chunk of the item this thread takes next. A thread claims
// that item before it multiplies the current one; asking for the next group in order instead sent
// about half the asks to the core that did not need them (the other thread took that group) and
// left the thread's own next item unasked: claiming ahead made the 30 layers' projections 5-15 %
// faster at 8 to 64 rows (stand-alone copies of the loop, 2 threads, medians of 20-40
// interleaved pairs) and in the engine 32-request decode 8.5 % faster (median of 10 interleaved
// pairs). With the next item known, asking in every block of rows, not only the first (which
// reads the weights from memory; later ones find them in L3), made 2,048-token prefill steps
// 3.9-6.2 % shorter (medians of 10 and 12 pairs).
//
// Why runs (items_per_run): taken one at a time, the two threads' items alternated, so both
// threads packed every block of rows and wrote neighbouring columns of the same rows of y, and
// each one's weights stream broke off at every group. With many blocks, a run is a whole block:
// each thread packs its blocks once and writes its own rows, and the 30 layers' projections at
// 2,048 rows ran in 1,864 ms against 2,280 (stand-alone copies of the loop, 2 threads, 2 pairs;
// two single-threaded processes, one per core, reach the same total). With few blocks (a decode
// step), a run is 3 adjacent groups, whose weights lie one after the other: 32 rows in 41.5-44.8 ms
// against 47.0-50.9 one item at a time, 64 and 128 rows 9-11 % faster (4 pairs); at 256 rows the
// two kinds of runs are even, at 512 whole blocks are 5 % faster than 3 groups. Where there are
// many groups (the LM head's 1,024), runs grow up to kLongRun while each thread still gets 8: the
// LM head at 32 rows, its weights streamed from memory, reached 193 GFLOPS against 167 with runs
// of 3 (3 pairs), and 32-request decode steps took 1.8 % less time (median of 8 pairs).
//
// Why a counter, not a fixed split of the panels: on this 2-core machine one core is now and then
// slower than the other for a while, and with a fixed half each the step waits for the slower
// one; taking items as they come, the 2,048-row projections ran 5.4-13 % faster (two runs of 21
// interleaved pairs), a 32-row decode step the same within the noise, the whole 32-request run
// 4.5 % faster (median of 6 pairs). Two single-threaded processes, one per core, each ran at
// their one-thread speed, so the cores do not slow each other.
//
// Each thread packs a block of rows once (pack_block) and keeps it while the items it takes stay
// in that block; an earlier version packed per item, anew for every 3 panels, and that cost 5-8 %
// of the narrow projections. Chains continue across chunks through y (or the scratch), stored and
// reloaded exactly, and an item computes its outputs alone, so every output element is one
// sequential chain of fused multiply-adds whatever thread computes it: the same bits as the other
// builds.
//
// Why this shape, measured on the 2-core machine (stand-alone copies of the loops, 2 threads,
// interleaved runs): for 32 rows over the default model's 30 layers of weights from memory,
// 8 x 3 tiles with chunks of 192 and the next chunk's lines spread over all the tiles' steps took
// 27.9-36.6 ms against 34.1-39.9 for the 16 x 1 tiles that prefetched from the first row tile only
// (the same 8 x 3 tiles without prefetching: 39.6; chunks of 128, 144 and 256, 4 x 6 tiles: 1-10 %
// slower); at 2,048 rows, 8 x 3 over chunks of 192 reached 188-220 GFLOPS against 169-196 for
// 8 x 2 tiles over whole-K slices, whose 2 x K x 64 bytes of weights did not fit in L1.
inline void linear_tiled(const float* a, const float* b, float* y, int64_t M, int64_t K, int64_t N, int64_t P) {
  const std::vector<std::pair<int64_t, int64_t>> groups = panel_groups(N, P);
  const int64_t G = static_cast<int64_t>(groups.size()), blocks = (M + kBlockRows - 1) / kBlockRows, items = G * blocks;
  const int64_t run = items_per_run(blocks, G, at::get_num_threads());
  parallel_runs(items, run, [&](const auto& next_run) {
    const int64_t block = std::min(kBlockRows, M);
    std::vector<float> scratch(block * kNR);
    // The packed rows live with the thread, so that a call neither allocates nor zeroes them
    // (pack_block writes every value a tile reads); they only grow.
    thread_local std::vector<float> xpack;
    xpack.resize(std::max<size_t>(xpack.size(), (block + kRows - 1) / kRows * kRows * K));
    int64_t packed = -1;  // the row block xpack holds
    int64_t run_at = 0, run_end = 0;  // the rest of the run this thread holds
    auto take = [&](int64_t& item) {
      if (run_at >= run_end && !next_run(run_at, run_end)) return false;
      item = run_at++;
      return true;
    };
    int64_t item, following;
    bool have = take(item);
    while (have) {
      const bool more = take(following);  // known now, so this item can ask for its weights
      const int64_t mb = item / G * kBlockRows, g = item % G, mc = std::min(kBlockRows, M - mb);
      const auto [p, width] = groups[g];
      if (packed != mb) pack_block(a, K, mb, mc, xpack.data()), packed = mb;
      const auto [np, nwidth] = more ? groups[following % G] : std::pair<int64_t, int64_t>{0, 0};
      multiply_group(xpack.data(), b, y, K, N, mb, mc, p, width, more ? b + np * K * kNR : nullptr, nwidth,
                     scratch.data());
      item = following;
      have = more;
    }
  });
}

}  // namespace avx512
}  // namespace expert

#endif
