// Weight-only quantized linear layers: y = x @ dequantize(W)^T (+ bias), x and y in float32.
//
// Two formats, both in panels of 16 output columns like the float32 weights (gemm_tiles.h), with
// float16 scales (and minimums) per group of `group` consecutive inputs of a column, `group` a
// multiple of 32:
//   int8: codes int8 [P][K / 2][16][2];  w = q * scale        (q in [-127, 127])
//         a column's codes for inputs 2 kp and 2 kp + 1 sit side by side.
//   int4: codes uint32 [P][K / 8][16];   w = q * scale + min  (q in [0, 15])
//         word [kk][j] holds input 8 kk + 2 i in bits 4 i.. and input 8 kk + 2 i + 1 in bits
//         16 + 4 i.. (i < 4), so (word >> 4 i) & 0x000F000F is a column's pair of codes as two
//         16-bit lanes. The tensor is uint8 [P][K / 8][64].
//   scales, mins: float16 [P][K / group][16].
//
// The products are integer. Each row of x is rounded to 16-bit integers in blocks of 32 inputs,
// x[k] ~ xq[k] * step[b] with step = max |x| / 32767 over the block: an error of at most 2^-16 of
// the block's largest value, far below the weights' own rounding (2^-8 of the group's range for
// int8, 2^-4 for int4). Then, per output element and row:
//   for each block b of 32 inputs, in order (group g holds the block):
//     isum = sum of xq[k] * q[k] over the block               exact, in 32-bit integers
//     y = fma(scale[g] * step[b], float(isum), y)
//     with minimums: y = fma(min[g], step[b] * float(sum of xq over the block), y)
// One AVX2 multiply-add of 16-bit pairs (vpmaddwd) does 16 products and 8 sums; with AVX-512 VNNI
// one vpdpwssd does a panel's 32 products and accumulates them. Converting each code to float
// and multiplying took about three times the instructions per weight and bound decode by them.
//
// Batch invariance: integer sums are exact, so how a path blocks them cannot change them; the
// fold over blocks is the same sequence of float operations on every path. Few rows (decode)
// convert the codes in registers as they stream; more rows convert a [kc][16] slice once into cache
// and run integer register tiles over it. A row gives the same bits alone or in any batch, and the
// AVX-512, AVX2 and portable (plain integer loops, std::fma) builds give the same bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "gemm_tiles.h"

namespace expert {
namespace {

constexpr int64_t kBlock = 32;               // inputs per block of x (one step each)
constexpr int64_t kBlockPairs = kBlock / 2;  // the same block in pairs of inputs
constexpr int64_t kInt4Step = 8;             // inputs per int4 word
constexpr float kXMax = 32767.0f;

// Two 16-bit values in one 32-bit lane, the low half first: how x and the codes pair inputs.
inline int32_t pair_of(int32_t lo, int32_t hi) {
  return static_cast<int32_t>((static_cast<uint32_t>(lo) & 0xFFFFu) | (static_cast<uint32_t>(hi) << 16));
}

// Sixteen 32-bit lanes, one per column of a panel. As weights or x they hold pairs of 16-bit
// values (the low half first), as accumulators 32-bit sums. With AVX-512 VNNI one instruction
// multiplies and accumulates a whole panel (vpdpwssd); AVX2 takes two madd + add; the portable
// build loops. Integer sums are exact, so all three give the same numbers.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__) && defined(EXPERT_VEC_AVX2)
#define EXPERT_QUANT_AVX512 1
#endif

#if defined(EXPERT_QUANT_AVX512)
struct IPanel {
  __m512i v;
  static inline IPanel zero() { return {_mm512_setzero_si512()}; }
  static inline IPanel broadcast(const int32_t* p) { return {_mm512_set1_epi32(*p)}; }
  static inline IPanel load(const int32_t* p) { return {_mm512_loadu_si512(p)}; }
  inline void store(int32_t* p) const { _mm512_storeu_si512(p, v); }
  // acc + (w.lo * x.lo + w.hi * x.hi) per lane.
  static inline IPanel madd(IPanel w, IPanel x, IPanel acc) { return {_mm512_dpwssd_epi32(acc.v, w.v, x.v)}; }
};

// The int8 codes of a panel for one pair of inputs (32 bytes), as pairs of 16-bit lanes.
inline IPanel int8_pairs(const uint8_t* q) {
  return {_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)))};
}

// A panel's int4 words for eight inputs.
struct Int4Words {
  __m512i v;
  explicit Int4Words(const uint8_t* q) : v(_mm512_loadu_si512(q)) {}
  // The codes for inputs 2 i and 2 i + 1.
  inline IPanel pairs(int i) const {
    return {_mm512_and_si512(_mm512_srli_epi32(v, 4 * i), _mm512_set1_epi32(0x000F000F))};
  }
};
#elif defined(EXPERT_VEC_AVX2)
struct IPanel {
  __m256i v[2];
  static inline IPanel zero() { return {{_mm256_setzero_si256(), _mm256_setzero_si256()}}; }
  static inline IPanel broadcast(const int32_t* p) { const __m256i x = _mm256_set1_epi32(*p); return {{x, x}}; }
  static inline IPanel load(const int32_t* p) {
    return {{_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8))}};
  }
  inline void store(int32_t* p) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v[0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 8), v[1]);
  }
  static inline IPanel madd(IPanel w, IPanel x, IPanel acc) {
    return {{_mm256_add_epi32(acc.v[0], _mm256_madd_epi16(w.v[0], x.v[0])),
             _mm256_add_epi32(acc.v[1], _mm256_madd_epi16(w.v[1], x.v[1]))}};
  }
};

inline IPanel int8_pairs(const uint8_t* q) {
  return {{_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))),
           _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)))}};
}

struct Int4Words {
  __m256i v[2];
  explicit Int4Words(const uint8_t* q) {
    v[0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    v[1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32));
  }
  inline IPanel pairs(int i) const {
    const __m256i mask = _mm256_set1_epi32(0x000F000F);
    return {{_mm256_and_si256(_mm256_srli_epi32(v[0], 4 * i), mask),
             _mm256_and_si256(_mm256_srli_epi32(v[1], 4 * i), mask)}};
  }
};
#else
struct IPanel {
  int32_t v[kNR];
  static inline IPanel zero() { IPanel r; for (int l = 0; l < kNR; ++l) r.v[l] = 0; return r; }
  static inline IPanel broadcast(const int32_t* p) { IPanel r; for (int l = 0; l < kNR; ++l) r.v[l] = *p; return r; }
  static inline IPanel load(const int32_t* p) { IPanel r; std::memcpy(r.v, p, sizeof(r.v)); return r; }
  inline void store(int32_t* p) const { std::memcpy(p, v, sizeof(v)); }
  static inline int32_t lo(int32_t pair) { return static_cast<int16_t>(static_cast<uint32_t>(pair) & 0xFFFFu); }
  static inline int32_t hi(int32_t pair) { return static_cast<int16_t>(static_cast<uint32_t>(pair) >> 16); }
  static inline IPanel madd(IPanel w, IPanel x, IPanel acc) {
    for (int l = 0; l < kNR; ++l) acc.v[l] += lo(w.v[l]) * lo(x.v[l]) + hi(w.v[l]) * hi(x.v[l]);
    return acc;
  }
};

inline IPanel int8_pairs(const uint8_t* q) {
  IPanel r;
  for (int l = 0; l < kNR; ++l) r.v[l] = pair_of(static_cast<int8_t>(q[2 * l]), static_cast<int8_t>(q[2 * l + 1]));
  return r;
}

struct Int4Words {
  uint32_t v[kNR];
  explicit Int4Words(const uint8_t* q) { std::memcpy(v, q, sizeof(v)); }
  inline IPanel pairs(int i) const {
    IPanel r;
    for (int l = 0; l < kNR; ++l) r.v[l] = static_cast<int32_t>((v[l] >> (4 * i)) & 0x000F000Fu);
    return r;
  }
};
#endif

// Sixteen floats, one per column of a panel: a zmm register with AVX-512, two Vecs otherwise.
// The folds run on these; lane by lane the operations are the same everywhere.
#if defined(EXPERT_QUANT_AVX512)
struct FPanel {
  __m512 v;
  static inline FPanel zero() { return {_mm512_setzero_ps()}; }
  static inline FPanel broadcast(float x) { return {_mm512_set1_ps(x)}; }
  static inline FPanel load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static inline FPanel load_half(const uint16_t* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  static inline FPanel of(IPanel a) { return {_mm512_cvtepi32_ps(a.v)}; }
  inline void store(float* p) const { _mm512_storeu_ps(p, v); }
  inline FPanel operator*(FPanel o) const { return {_mm512_mul_ps(v, o.v)}; }
  static inline FPanel fma(FPanel a, FPanel b, FPanel c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
};
#else
struct FPanel {
  Vec v[2];
  static inline FPanel zero() { return {{Vec::zero(), Vec::zero()}}; }
  static inline FPanel broadcast(float x) { return {{Vec::broadcast(x), Vec::broadcast(x)}}; }
  static inline FPanel load(const float* p) { return {{Vec::load(p), Vec::load(p + kLanes)}}; }
  static inline FPanel load_half(const uint16_t* p) { return {{Vec::load_half(p), Vec::load_half(p + kLanes)}}; }
  static inline FPanel of(const IPanel& a) {
#if defined(EXPERT_VEC_AVX2)
    return {{Vec{_mm256_cvtepi32_ps(a.v[0])}, Vec{_mm256_cvtepi32_ps(a.v[1])}}};
#else
    float f[kNR];
    for (int l = 0; l < kNR; ++l) f[l] = static_cast<float>(a.v[l]);
    return load(f);
#endif
  }
  inline void store(float* p) const { v[0].store(p); v[1].store(p + kLanes); }
  inline FPanel operator*(const FPanel& o) const { return {{v[0] * o.v[0], v[1] * o.v[1]}}; }
  static inline FPanel fma(const FPanel& a, const FPanel& b, const FPanel& c) {
    return {{Vec::fma(a.v[0], b.v[0], c.v[0]), Vec::fma(a.v[1], b.v[1], c.v[1])}};
  }
};
#endif

// x as 16-bit integers in blocks of 32 inputs (see the top of the file).
struct QuantizedRows {
  std::vector<int32_t> pairs;  // [M][K / 2]: xq[2 kp] in the low half, xq[2 kp + 1] in the high half
  std::vector<float> step;     // [M][blocks]
  std::vector<float> total;    // [M][blocks]: step * the sum of xq over the block (for minimums)
  int64_t blocks;

  const int32_t* row(int64_t r) const { return pairs.data() + r * blocks * kBlockPairs; }
  float step_of(int64_t r, int64_t b) const { return step[r * blocks + b]; }
  float total_of(int64_t r, int64_t b) const { return total[r * blocks + b]; }
};

// Plain scalar code shared by every build, so each path and instruction set sees the same integers.
QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t blocks = K / kBlock;
  QuantizedRows q{std::vector<int32_t>(M * K / 2), std::vector<float>(M * blocks), std::vector<float>(M * blocks),
                  blocks};
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < blocks; ++b) {
        const float* xb = x + r * K + b * kBlock;
        float amax = 0.0f;
        bool finite = true;
        for (int64_t k = 0; k < kBlock; ++k) {
          const float magnitude = std::fabs(xb[k]);
          finite = finite && magnitude <= std::numeric_limits<float>::max();  // false for inf and nan
          amax = std::max(amax, magnitude);
        }
        int32_t codes[kBlock] = {};
        float step = 0.0f;
        if (!finite) {
          step = std::numeric_limits<float>::quiet_NaN();  // inf or nan in the block: y is nan, as in float
        } else if (amax > 0.0f) {
          step = amax / kXMax;
          const float inverse = kXMax / amax;
          for (int64_t k = 0; k < kBlock; ++k)
            codes[k] = static_cast<int32_t>(std::clamp(std::nearbyint(xb[k] * inverse), -kXMax, kXMax));
        }
        int32_t sum = 0;
        int32_t* out = q.pairs.data() + (r * K + b * kBlock) / 2;
        for (int64_t k = 0; k < kBlock; k += 2) {
          sum += codes[k] + codes[k + 1];
          out[k / 2] = pair_of(codes[k], codes[k + 1]);
        }
        q.step[r * blocks + b] = step;
        q.total[r * blocks + b] = step * static_cast<float>(sum);
      }
  });
  return q;
}

struct QuantizedPanels {
  bool int4;
  const uint8_t* codes;    // see the top of the file
  const uint16_t* scales;  // float16 bits [P][groups][16]
  const uint16_t* mins;    // float16 bits [P][groups][16] (int4), else nullptr
  int64_t K;
  int64_t groups;          // per column: K / group
  int64_t group;

  int64_t code_bytes_per_panel() const { return (int4 ? K / 2 : K) * kNR; }
  const uint8_t* panel(int64_t p) const { return codes + p * code_bytes_per_panel(); }
  // Bytes of codes per pair of inputs (int8), or per word of eight inputs (int4), of a panel.
  static constexpr int64_t kInt8PairBytes = 2 * kNR;
  static constexpr int64_t kInt4WordBytes = 4 * kNR;
  const uint16_t* scale_row(int64_t p, int64_t block) const { return scales + (p * groups + block * kBlock / group) * kNR; }
  const uint16_t* min_row(int64_t p, int64_t block) const { return mins + (p * groups + block * kBlock / group) * kNR; }
};

// Rows [row0, row0 + R) (R = 1 or 2) of panel p, full K, converting the codes in registers as
// they stream. One panel at a time: each thread then reads its panels as one sequential stream,
// which measured faster than interleaving several panels (docs/engine.md).
template <int R, bool kInt4>
void tile_stream(const QuantizedRows& x, int64_t row0, const QuantizedPanels& w, int64_t p, float* c, int64_t ldc) {
  FPanel y[R];
  for (int r = 0; r < R; ++r) y[r] = FPanel::zero();
  const int32_t* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = x.row(row0 + r);
  const uint8_t* codes = w.panel(p);
  for (int64_t b = 0; b < x.blocks; ++b) {
    IPanel acc[R];
    for (int r = 0; r < R; ++r) acc[r] = IPanel::zero();
    const int64_t kp0 = b * kBlockPairs;
    if constexpr (kInt4) {
      for (int64_t kp = kp0; kp < kp0 + kBlockPairs; kp += kInt4Step / 2) {
        const Int4Words words(codes + kp / (kInt4Step / 2) * QuantizedPanels::kInt4WordBytes);
#pragma GCC unroll 4
        for (int j = 0; j < kInt4Step / 2; ++j) {
          const IPanel q = words.pairs(j);
          for (int r = 0; r < R; ++r) acc[r] = IPanel::madd(q, IPanel::broadcast(xr[r] + kp + j), acc[r]);
        }
      }
    } else {
      for (int64_t kp = kp0; kp < kp0 + kBlockPairs; ++kp) {
        const IPanel q = int8_pairs(codes + kp * QuantizedPanels::kInt8PairBytes);
        for (int r = 0; r < R; ++r) acc[r] = IPanel::madd(q, IPanel::broadcast(xr[r] + kp), acc[r]);
      }
    }
    // the fold
    const FPanel scale = FPanel::load_half(w.scale_row(p, b));
    for (int r = 0; r < R; ++r)
      y[r] = FPanel::fma(scale * FPanel::broadcast(x.step_of(row0 + r, b)), FPanel::of(acc[r]), y[r]);
    if constexpr (kInt4) {
      const FPanel min = FPanel::load_half(w.min_row(p, b));
      for (int r = 0; r < R; ++r) y[r] = FPanel::fma(min, FPanel::broadcast(x.total_of(row0 + r, b)), y[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r].store(c + r * ldc);
}

template <int R>
inline void tile_stream(const QuantizedRows& x, int64_t row0, const QuantizedPanels& w, int64_t p, float* c,
                        int64_t ldc) {
  if (w.int4) tile_stream<R, true>(x, row0, w, p, c, ldc);
  else tile_stream<R, false>(x, row0, w, p, c, ldc);
}

void linear_stream(const QuantizedRows& x, const QuantizedPanels& w, float* y, int64_t M, int64_t N, int64_t P) {
  at::parallel_for(0, P, 4, [&](int64_t p0, int64_t p1) {
    float scratch[2 * kNR];
    for (int64_t p = p0; p < p1; ++p) {
      const bool padded = (p + 1) * kNR > N;  // the zero-padded last panel goes through scratch
      float* out = padded ? scratch : y + p * kNR;
      const int64_t ldc = padded ? kNR : N;
      if (M == 1) tile_stream<1>(x, 0, w, p, out, ldc);
      else tile_stream<2>(x, 0, w, p, out, ldc);
      if (padded)
        for (int64_t r = 0; r < M; ++r) std::copy(scratch + r * kNR, scratch + r * kNR + (N - p * kNR), y + r * N + p * kNR);
    }
  });
}

// Panel p's codes for input pairs [kb, kb + kc), as pairs of 16-bit values [kc][16] (kb and kc
// multiples of the block).
void code_slice(const QuantizedPanels& w, int64_t p, int64_t kb, int64_t kc, int32_t* buf) {
  const uint8_t* codes = w.panel(p);
  if (w.int4) {
    for (int64_t kp = kb; kp < kb + kc; kp += kInt4Step / 2) {
      const Int4Words words(codes + kp / (kInt4Step / 2) * QuantizedPanels::kInt4WordBytes);
      int32_t* out = buf + (kp - kb) * kNR;
#pragma GCC unroll 4
      for (int j = 0; j < kInt4Step / 2; ++j) words.pairs(j).store(out + j * kNR);
    }
  } else {
    for (int64_t kp = kb; kp < kb + kc; ++kp) {
      int8_pairs(codes + kp * QuantizedPanels::kInt8PairBytes).store(buf + (kp - kb) * kNR);
    }
  }
}

// R rows of y times a code slice that starts at input pair kb (a packed [kc][R] pairs, b [kc][16]
// pairs): each block's integer sums in registers, folded as tile_stream folds them into y, which
// stays in registers across the slice (from c, or zero at the first slice).
template <int R>
void tile_blocks(const QuantizedRows& x, const QuantizedPanels& w, int64_t p, int64_t kb, int64_t kc, int64_t row0,
                 const int32_t* a, const int32_t* b, float* c, int64_t ldc) {
  FPanel y[R];
  for (int r = 0; r < R; ++r) y[r] = kb == 0 ? FPanel::zero() : FPanel::load(c + r * ldc);
  for (int64_t kp0 = kb; kp0 < kb + kc; kp0 += kBlockPairs) {
    const int64_t block = kp0 / kBlockPairs;
    const int32_t* ap = a + (kp0 - kb) * R;
    const int32_t* bp = b + (kp0 - kb) * kNR;
    IPanel acc[R];
    for (int r = 0; r < R; ++r) acc[r] = IPanel::zero();
    for (int64_t kp = 0; kp < kBlockPairs; ++kp) {
      const IPanel q = IPanel::load(bp + kp * kNR);
      for (int r = 0; r < R; ++r) acc[r] = IPanel::madd(q, IPanel::broadcast(ap + kp * R + r), acc[r]);
    }
    // the fold
    const FPanel scale = FPanel::load_half(w.scale_row(p, block));
    for (int r = 0; r < R; ++r)
      y[r] = FPanel::fma(scale * FPanel::broadcast(x.step_of(row0 + r, block)), FPanel::of(acc[r]), y[r]);
    if (w.mins != nullptr) {
      const FPanel min = FPanel::load_half(w.min_row(p, block));
      for (int r = 0; r < R; ++r) y[r] = FPanel::fma(min, FPanel::broadcast(x.total_of(row0 + r, block)), y[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r].store(c + r * ldc);
}

// The quantized panels as linear_blocked's kernel, over input pairs.
struct QuantizedKernel {
  const QuantizedRows& x;
  const QuantizedPanels& w;

  const int32_t* slice(int64_t p, int64_t kb, int64_t kc, int32_t* buf) const {
    code_slice(w, p, kb, kc, buf);
    return buf;
  }

  void tile(int64_t p, int64_t kb, int64_t kc, int64_t row0, int64_t rows, const int32_t* a, const int32_t* b,
            float* c, int64_t ldc) const {
    switch (rows) {
      case 6: tile_blocks<6>(x, w, p, kb, kc, row0, a, b, c, ldc); break;
      case 5: tile_blocks<5>(x, w, p, kb, kc, row0, a, b, c, ldc); break;
      case 4: tile_blocks<4>(x, w, p, kb, kc, row0, a, b, c, ldc); break;
      case 3: tile_blocks<3>(x, w, p, kb, kc, row0, a, b, c, ldc); break;
      case 2: tile_blocks<2>(x, w, p, kb, kc, row0, a, b, c, ldc); break;
      default: tile_blocks<1>(x, w, p, kb, kc, row0, a, b, c, ldc); break;
    }
  }
};

// The panels of a quantized weight, after checking that the tensors are laid out as above.
QuantizedPanels panels_of(const char* op, const at::Tensor& codes, const at::Tensor& scales,
                          const c10::optional<at::Tensor>& mins) {
  const bool int4 = codes.scalar_type() == at::kByte;
  TORCH_CHECK(int4 || codes.scalar_type() == at::kChar, op, ": codes must be int8 or uint8 (int4)");
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == (int4 ? 4 * kNR : 2 * kNR) && codes.is_contiguous(), op,
              ": codes are not packed in panels of 16");
  const bool has_mins = mins.has_value() && mins->defined();
  TORCH_CHECK(int4 == has_mins, op, ": int4 weights need minimums, int8 weights have none");
  const int64_t P = codes.size(0), K = (int4 ? kInt4Step : 2) * codes.size(1);
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.dim() == 3 && scales.size(0) == P &&
                  scales.size(2) == kNR && scales.is_contiguous(),
              op, ": scales must be float16 [P][groups][16]");
  const int64_t groups = scales.size(1);
  TORCH_CHECK(groups > 0 && K % groups == 0, op, ": ", K, " features are not whole groups");
  const int64_t group = K / groups;
  TORCH_CHECK(group % kBlock == 0, op, ": groups of ", group, " features are not multiples of ", kBlock);
  if (has_mins)
    TORCH_CHECK(mins->scalar_type() == at::kHalf && mins->sizes() == scales.sizes() && mins->is_contiguous(), op,
                ": mins must match the scales");
  return {int4,
          static_cast<const uint8_t*>(codes.data_ptr()),
          reinterpret_cast<const uint16_t*>(scales.data_ptr()),
          has_mins ? reinterpret_cast<const uint16_t*>(mins->data_ptr()) : nullptr,
          K,
          groups,
          group};
}

}  // namespace

at::Tensor quantized_linear(const at::Tensor& input, const at::Tensor& codes, const at::Tensor& scales,
                            const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& bias,
                            int64_t out_features) {
  TORCH_CHECK(input.scalar_type() == at::kFloat, "quantized_linear: the input must be float32");
  const QuantizedPanels w = panels_of("quantized_linear", codes, scales, mins);
  const int64_t P = codes.size(0), K = w.K, N = out_features;
  TORCH_CHECK(input.size(-1) == K, "quantized_linear: input has ", input.size(-1), " features, weight expects ", K);
  TORCH_CHECK(N > (P - 1) * kNR && N <= P * kNR, "quantized_linear: out_features does not match the panels");
  auto x = input.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y.view([&] { auto s = input.sizes().vec(); s.back() = N; return s; }());
  const QuantizedRows rows = quantize_rows(x.data_ptr<float>(), M, K);
  float* c = y.data_ptr<float>();
  if (M <= 2) linear_stream(rows, w, c, M, N, P);
  else linear_blocked(rows.pairs.data(), c, M, K / 2, N, P, QuantizedKernel{rows, w});
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  auto shape = input.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

// Rows `ids` of a quantized weight as float32: the lookup into a tied, quantized LM head. Each value
// is float(q) * scale, plus min for int4, rounded after each step as quant.dequantize does.
at::Tensor quantized_embedding(const at::Tensor& codes, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                               const at::Tensor& ids) {
  const QuantizedPanels w = panels_of("quantized_embedding", codes, scales, mins);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "quantized_embedding: ids must be int64 [T]");
  auto rows = ids.contiguous();
  const int64_t T = rows.size(0), K = w.K, N = codes.size(0) * kNR;
  const int64_t* pid = rows.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pid[t] >= 0 && pid[t] < N, "quantized_embedding: id ", pid[t], " is outside the table");
  auto out = at::empty({T, K}, codes.options().dtype(at::kFloat));
  float* po = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t p = pid[t] / kNR, lane = pid[t] % kNR;
    const uint8_t* panel = w.panel(p);
    for (int64_t k = 0; k < K; ++k) {
      int32_t q;
      if (w.int4) {  // word k / 8 of the column; input 2 i + h at bits 4 i + 16 h
        uint32_t word;
        std::memcpy(&word, panel + (k / kInt4Step) * QuantizedPanels::kInt4WordBytes + lane * 4, sizeof(word));
        const int64_t i = (k % kInt4Step) / 2, h = k % 2;
        q = static_cast<int32_t>((word >> (4 * i + 16 * h)) & 0xFu);
      } else {  // pair k / 2 of the column, the low input first
        q = static_cast<int8_t>(panel[(k / 2) * QuantizedPanels::kInt8PairBytes + lane * 2 + k % 2]);
      }
      const int64_t at = (p * w.groups + k / w.group) * kNR + lane;
      float v = static_cast<float>(q) * half_to_float(w.scales[at]);
      if (w.mins != nullptr) v = v + half_to_float(w.mins[at]);
      po[t * K + k] = v;
    }
  }
  return out;
}

}  // namespace expert
