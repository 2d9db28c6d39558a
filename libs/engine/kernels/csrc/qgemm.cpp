// Weight-only quantized linear layers: y = x @ dequantize(W)^T (+ bias), x and y in float32.
//
// Two formats, both in panels of 16 output columns like the float32 weights (gemm_tiles.h), with
// float16 scales (and minimums) per group of `group` consecutive k of a column:
//   int8: codes int8 [P][K][16];        w = q * scale          (q in [-127, 127])
//   int4: codes uint32 [P][K / 8][16];  w = q * scale + min    (q in [0, 15])
//         word [kk][j] holds k = 8 kk + b in bits 4b..4b+3 (the tensor: uint8 [P][K / 8][64]).
//   scales, mins: float16 [P][K / group][16]. A group spans all of K or divides kKC.
//
// The arithmetic, per output element and row x, is the same on every path:
//   for each group g, in order:
//     part = fused multiply-add chain of x[k] * q[k] over the group's k, from zero
//     y = fma(scale[g], part, y);  then, with minimums, y = fma(min[g], sum of x over the group, y)
// Scaling once per group instead of dequantizing every weight is what lets decode run at the
// rate the codes stream in: per weight it costs a conversion and one multiply-add.
//
// Batch invariance: few rows (decode) convert the codes in registers as they stream; more rows
// convert a [kc][16] slice once into L1 and run the float32 register tiles over each group, then
// fold it the same way. Both compute the chains above, in the same order, so a row gives the same
// bits alone or in any batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "gemm_tiles.h"

namespace expert {
namespace {

struct QuantizedPanels {
  bool int4;
  const uint8_t* codes;    // int8, or words of eight nibbles; see above
  const uint16_t* scales;  // float16 bits [P][groups][16]
  const uint16_t* mins;    // float16 bits [P][groups][16] (int4), else nullptr
  const float* xsums;      // [M][groups]: each row's sum over each group (with mins), else nullptr
  int64_t K;
  int64_t groups;          // per column: K / group
  int64_t group;

  int64_t code_bytes_per_panel() const { return (int4 ? K / 2 : K) * kNR; }
};

constexpr int64_t kInt4Step = 8;  // k per int4 word

// Sixteen int8 codes of one k, as floats (exact).
inline void int8_codes(const uint8_t* q, Vec w[2]) {
#if defined(EXPERT_VEC_AVX2)
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  w[0] = Vec{_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))};
  w[1] = Vec{_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v, v)))};
#else
  float f[kNR];
  for (int j = 0; j < kNR; ++j) f[j] = static_cast<float>(static_cast<int8_t>(q[j]));
  w[0] = Vec::load(f);
  w[1] = Vec::load(f + 8);
#endif
}

// int4 codes come as one 32-bit word per column per eight k (nibble b holds k0 + b), so that a
// vector of eight words yields eight columns' codes at k0 + b with one shift, one mask and one
// conversion: no byte shuffles.
struct Int4Words {
#if defined(EXPERT_VEC_AVX2)
  __m256i v[2];
  Int4Words() = default;
  explicit Int4Words(const uint8_t* q) {
    v[0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    v[1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32));
  }
  inline Vec code(int b, int half) const {
    return Vec{_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v[half], 4 * b), _mm256_set1_epi32(0x0F)))};
  }
#else
  uint32_t v[kNR];
  Int4Words() = default;
  explicit Int4Words(const uint8_t* q) { std::memcpy(v, q, sizeof(v)); }
  inline Vec code(int b, int half) const {
    float f[kLanes];
    for (int j = 0; j < kLanes; ++j) f[j] = static_cast<float>((v[half * kLanes + j] >> (4 * b)) & 0x0Fu);
    return Vec::load(f);
  }
#endif
};

// Each fold below computes y = fma(scale, part, y), then, with minimums, y = fma(min, sum of x
// over the group, y): written out in each kernel rather than called with arrays, so that the
// compiler keeps the chains in registers.
inline float group_sum(const QuantizedPanels& w, int64_t row, int64_t g) { return w.xsums[row * w.groups + g]; }

// Panel p's codes for k rows [kb, kb + kc), as floats [kc][16] (kb, kc multiples of 8 for int4).
void code_slice(const QuantizedPanels& w, int64_t p, int64_t kb, int64_t kc, float* buf) {
  const uint8_t* codes = w.codes + p * w.code_bytes_per_panel();
  for (int64_t k = kb; k < kb + kc; k += w.int4 ? kInt4Step : 1) {
    float* row = buf + (k - kb) * kNR;
    if (w.int4) {
      const Int4Words words(codes + (k / kInt4Step) * kNR * 4);
#pragma GCC unroll 8
      for (int b = 0; b < kInt4Step; ++b) {
        words.code(b, 0).store(row + b * kNR);
        words.code(b, 1).store(row + b * kNR + 8);
      }
    } else {
      Vec q[2];
      int8_codes(codes + k * kNR, q);
      q[0].store(row);
      q[1].store(row + 8);
    }
  }
}

// Rows [row0, row0 + R) (R = 1 or 2) over NP adjacent panels, full K, converting the codes in
// registers as they stream. The accumulators are locals so that they stay in registers.
template <int R, int NP, bool kInt4>
void tile_stream(const float* a, int64_t lda, int64_t row0, const QuantizedPanels& w, int64_t p, float* c,
                 int64_t ldc) {
  Vec y[R][NP][2];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NP; ++i) y[r][i][0] = y[r][i][1] = Vec::zero();
  const int64_t panel_bytes = w.code_bytes_per_panel();
  const uint8_t* codes = w.codes + p * panel_bytes;
  for (int64_t g = 0; g < w.groups; ++g) {
    Vec part[R][NP][2];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < NP; ++i) part[r][i][0] = part[r][i][1] = Vec::zero();
    const int64_t k0 = g * w.group, k1 = k0 + w.group;
    if constexpr (kInt4) {
      for (int64_t k = k0; k < k1; k += kInt4Step) {
        // Panel by panel, so that only one panel's words are live: x is broadcast again for each
        // (a load), which keeps every accumulator in a register.
        for (int i = 0; i < NP; ++i) {
          const Int4Words words(codes + i * panel_bytes + (k / kInt4Step) * kNR * 4);
#pragma GCC unroll 8
          for (int b = 0; b < kInt4Step; ++b) {
            const Vec q0 = words.code(b, 0), q1 = words.code(b, 1);
            for (int r = 0; r < R; ++r) {
              const Vec x = Vec::broadcast(a + r * lda + k + b);
              part[r][i][0] = Vec::fma(x, q0, part[r][i][0]);
              part[r][i][1] = Vec::fma(x, q1, part[r][i][1]);
            }
          }
        }
      }
    } else {
      for (int64_t k = k0; k < k1; ++k) {
        Vec x[R];
        for (int r = 0; r < R; ++r) x[r] = Vec::broadcast(a + r * lda + k);
        for (int i = 0; i < NP; ++i) {
          Vec q[2];
          int8_codes(codes + i * panel_bytes + k * kNR, q);
          for (int r = 0; r < R; ++r) {
            part[r][i][0] = Vec::fma(x[r], q[0], part[r][i][0]);
            part[r][i][1] = Vec::fma(x[r], q[1], part[r][i][1]);
          }
        }
      }
    }
    for (int i = 0; i < NP; ++i) {  // the fold
      const uint16_t* sr = w.scales + ((p + i) * w.groups + g) * kNR;
      const Vec s0 = Vec::load_half(sr), s1 = Vec::load_half(sr + 8);
      for (int r = 0; r < R; ++r) {
        y[r][i][0] = Vec::fma(s0, part[r][i][0], y[r][i][0]);
        y[r][i][1] = Vec::fma(s1, part[r][i][1], y[r][i][1]);
      }
      if constexpr (kInt4) {
        const uint16_t* mr = w.mins + ((p + i) * w.groups + g) * kNR;
        const Vec m0 = Vec::load_half(mr), m1 = Vec::load_half(mr + 8);
        for (int r = 0; r < R; ++r) {
          const Vec xs = Vec::broadcast(group_sum(w, row0 + r, g));
          y[r][i][0] = Vec::fma(m0, xs, y[r][i][0]);
          y[r][i][1] = Vec::fma(m1, xs, y[r][i][1]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NP; ++i) {
      y[r][i][0].store(c + r * ldc + i * kNR);
      y[r][i][1].store(c + r * ldc + i * kNR + 8);
    }
}

template <int R, int NP>
inline void tile_stream(const float* a, int64_t lda, int64_t row0, const QuantizedPanels& w, int64_t p, float* c,
                        int64_t ldc) {
  if (w.int4) tile_stream<R, NP, true>(a, lda, row0, w, p, c, ldc);
  else tile_stream<R, NP, false>(a, lda, row0, w, p, c, ldc);
}

// Panels per streaming tile: four independent streams for one row; two for two rows, which
// keeps the accumulators (rows x panels x 2 vectors) within the sixteen registers.
constexpr int kStreamPanels = 4;

void linear_stream(const float* a, const QuantizedPanels& w, float* y, int64_t M, int64_t N, int64_t P) {
  const int64_t K = w.K;
  at::parallel_for(0, P, kStreamPanels, [&](int64_t p0, int64_t p1) {
    float scratch[2 * kNR];
    int64_t p = p0;
    for (; p + kStreamPanels <= p1 && (p + kStreamPanels) * kNR <= N; p += kStreamPanels) {
      if (M == 1) {
        tile_stream<1, kStreamPanels>(a, K, 0, w, p, y + p * kNR, N);
      } else {
        tile_stream<2, kStreamPanels / 2>(a, K, 0, w, p, y + p * kNR, N);
        tile_stream<2, kStreamPanels / 2>(a, K, 0, w, p + 2, y + (p + 2) * kNR, N);
      }
    }
    for (; p < p1; ++p) {
      const bool padded = (p + 1) * kNR > N;  // the zero-padded last panel goes through scratch
      float* out = padded ? scratch : y + p * kNR;
      const int64_t ldc = padded ? kNR : N;
      if (M == 1) tile_stream<1, 1>(a, K, 0, w, p, out, ldc);
      else tile_stream<2, 1>(a, K, 0, w, p, out, ldc);
      if (padded)
        for (int64_t r = 0; r < M; ++r) std::copy(scratch + r * kNR, scratch + r * kNR + (N - p * kNR), y + r * N + p * kNR);
    }
  });
}

// R rows of y times the groups of a code slice that starts at k = kb (a packed [kc][R], b the codes
// as floats [kc][16]): each group's chains in registers, folded into c as tile_stream folds them.
template <int R>
void tile_groups(const QuantizedPanels& w, int64_t p, int64_t kb, int64_t kc, int64_t row0, const float* a,
                 const float* b, float* c, int64_t ldc) {
  for (int64_t k0 = kb; k0 < kb + kc; k0 += w.group) {
    const int64_t g = k0 / w.group;
    const float* ap = a + (k0 - kb) * R;
    const float* bp = b + (k0 - kb) * kNR;
    Vec part[R][2];
    for (int r = 0; r < R; ++r) part[r][0] = part[r][1] = Vec::zero();
    for (int64_t k = 0; k < w.group; ++k) {
      const Vec b0 = Vec::load(bp + k * kNR), b1 = Vec::load(bp + k * kNR + 8);
      for (int r = 0; r < R; ++r) {
        const Vec av = Vec::broadcast(ap + k * R + r);
        part[r][0] = Vec::fma(av, b0, part[r][0]);
        part[r][1] = Vec::fma(av, b1, part[r][1]);
      }
    }
    // the fold
    const uint16_t* sr = w.scales + (p * w.groups + g) * kNR;
    const Vec s0 = Vec::load_half(sr), s1 = Vec::load_half(sr + 8);
    for (int r = 0; r < R; ++r) {
      Vec y0 = g == 0 ? Vec::zero() : Vec::load(c + r * ldc);
      Vec y1 = g == 0 ? Vec::zero() : Vec::load(c + r * ldc + 8);
      y0 = Vec::fma(s0, part[r][0], y0);
      y1 = Vec::fma(s1, part[r][1], y1);
      if (w.mins != nullptr) {
        const uint16_t* mr = w.mins + (p * w.groups + g) * kNR;
        const Vec xs = Vec::broadcast(group_sum(w, row0 + r, g));
        y0 = Vec::fma(Vec::load_half(mr), xs, y0);
        y1 = Vec::fma(Vec::load_half(mr + 8), xs, y1);
      }
      y0.store(c + r * ldc);
      y1.store(c + r * ldc + 8);
    }
  }
}

inline void tile_groups_rows(int64_t rows, const QuantizedPanels& w, int64_t p, int64_t kb, int64_t kc, int64_t row0,
                             const float* a, const float* b, float* c, int64_t ldc) {
  switch (rows) {
    case 6: tile_groups<6>(w, p, kb, kc, row0, a, b, c, ldc); break;
    case 5: tile_groups<5>(w, p, kb, kc, row0, a, b, c, ldc); break;
    case 4: tile_groups<4>(w, p, kb, kc, row0, a, b, c, ldc); break;
    case 3: tile_groups<3>(w, p, kb, kc, row0, a, b, c, ldc); break;
    case 2: tile_groups<2>(w, p, kb, kc, row0, a, b, c, ldc); break;
    default: tile_groups<1>(w, p, kb, kc, row0, a, b, c, ldc); break;
  }
}

// The quantized panels as linear_blocked's kernel: slices are the codes as floats, and each
// group's chains are folded into y as in tile_stream. A group spans the whole K (int8 per
// channel) or divides the K block.
struct QuantizedKernel {
  const QuantizedPanels& w;

  const float* slice(int64_t p, int64_t kb, int64_t kc, float* buf) const {
    code_slice(w, p, kb, kc, buf);
    return buf;
  }

  void tile(int64_t p, int64_t kb, int64_t kc, int64_t row0, int64_t rows, const float* a, const float* b, float* c,
            int64_t ldc) const {
    if (w.groups > 1) {
      tile_groups_rows(rows, w, p, kb, kc, row0, a, b, c, ldc);
      return;
    }
    // One group spanning K: its chains run through y across the K blocks, as the float32 layer's
    // do, and are folded onto zero after the last block.
    tile_packed_rows(rows, kb > 0, a, b, kc, c, ldc);
    if (kb + kc < w.K) return;
    const Vec s0 = Vec::load_half(w.scales + p * kNR), s1 = Vec::load_half(w.scales + p * kNR + 8);
    for (int64_t r = 0; r < rows; ++r) {
      Vec y0 = Vec::fma(s0, Vec::load(c + r * ldc), Vec::zero());
      Vec y1 = Vec::fma(s1, Vec::load(c + r * ldc + 8), Vec::zero());
      if (w.mins != nullptr) {
        const Vec xs = Vec::broadcast(group_sum(w, row0 + r, 0));
        y0 = Vec::fma(Vec::load_half(w.mins + p * kNR), xs, y0);
        y1 = Vec::fma(Vec::load_half(w.mins + p * kNR + 8), xs, y1);
      }
      y0.store(c + r * ldc);
      y1.store(c + r * ldc + 8);
    }
  }
};

}  // namespace

at::Tensor quantized_linear(const at::Tensor& input, const at::Tensor& codes, const at::Tensor& scales,
                            const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& bias,
                            int64_t out_features) {
  TORCH_CHECK(input.scalar_type() == at::kFloat, "quantized_linear: the input must be float32");
  const bool int4 = codes.scalar_type() == at::kByte;
  TORCH_CHECK(int4 || codes.scalar_type() == at::kChar, "quantized_linear: codes must be int8 or uint8 (int4)");
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == (int4 ? 4 * kNR : kNR) && codes.is_contiguous(),
              "quantized_linear: codes are not packed in panels of 16");
  const bool has_mins = mins.has_value() && mins->defined();
  TORCH_CHECK(int4 == has_mins, "quantized_linear: int4 weights need minimums, int8 weights have none");
  const int64_t P = codes.size(0), K = int4 ? kInt4Step * codes.size(1) : codes.size(1), N = out_features;
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.dim() == 3 && scales.size(0) == P &&
                  scales.size(2) == kNR && scales.is_contiguous(),
              "quantized_linear: scales must be float16 [P][groups][16]");
  const int64_t groups = scales.size(1);
  TORCH_CHECK(groups > 0 && K % groups == 0, "quantized_linear: ", K, " features are not whole groups");
  const int64_t group = K / groups;
  TORCH_CHECK(groups == 1 || kKC % group == 0, "quantized_linear: a group of ", group,
              " features neither spans K nor divides ", kKC);
  TORCH_CHECK(!int4 || group % kInt4Step == 0, "quantized_linear: int4 groups must be multiples of 8");
  if (has_mins)
    TORCH_CHECK(mins->scalar_type() == at::kHalf && mins->sizes() == scales.sizes() && mins->is_contiguous(),
                "quantized_linear: mins must match the scales");
  TORCH_CHECK(input.size(-1) == K, "quantized_linear: input has ", input.size(-1), " features, weight expects ", K);
  TORCH_CHECK(N > (P - 1) * kNR && N <= P * kNR, "quantized_linear: out_features does not match the panels");
  auto x = input.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y.view([&] { auto s = input.sizes().vec(); s.back() = N; return s; }());
  const float* a = x.data_ptr<float>();
  // Each row's sum over each group, in k order, for the minimums' term.
  std::vector<float> sums(has_mins ? M * groups : 0);
  for (int64_t r = 0; r < (has_mins ? M : 0); ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float total = 0.0f;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) total += a[r * K + k];
      sums[r * groups + g] = total;
    }
  const QuantizedPanels w{int4,
                          static_cast<const uint8_t*>(codes.data_ptr()),
                          reinterpret_cast<const uint16_t*>(scales.data_ptr()),
                          has_mins ? reinterpret_cast<const uint16_t*>(mins->data_ptr()) : nullptr,
                          has_mins ? sums.data() : nullptr,
                          K,
                          groups,
                          group};
  float* c = y.data_ptr<float>();
  if (M <= 2) linear_stream(a, w, c, M, N, P);
  else linear_blocked(a, c, M, K, N, P, QuantizedKernel{w});
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  auto shape = input.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

}  // namespace expert
