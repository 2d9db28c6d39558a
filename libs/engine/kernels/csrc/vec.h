// Eight-lane float vector used by every kernel in this directory.
//
// Why a wrapper: the kernels must give bitwise-identical results for a row whatever else is in
// the batch (batch invariance), so every reduction has one fixed order. Writing the kernels
// against this one type keeps that order explicit, and the portable fallback computes exactly
// the same lanes with std::fma, so a machine without AVX2 gets the same numbers, only slower.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define EXPERT_VEC_AVX2 1
#endif

namespace expert {

constexpr int kLanes = 8;

// IEEE float16 bits to float32 (exact; every float16 is a float32), for the portable build.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu, bits;
  if (exponent == 0x1Fu) {
    bits = sign | 0x7F800000u | (mantissa << 13);  // inf, nan
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;  // signed zero
  } else {  // subnormal: shift the mantissa up until its leading one is the implicit bit
    exponent = 113;
    while (!(mantissa & 0x400u)) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

#if defined(EXPERT_VEC_AVX2)

struct Vec {
  __m256 v;
  static inline Vec zero() { return {_mm256_setzero_ps()}; }
  static inline Vec broadcast(float x) { return {_mm256_set1_ps(x)}; }
  static inline Vec broadcast(const float* p) { return {_mm256_broadcast_ss(p)}; }
  static inline Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  inline void store(float* p) const { _mm256_storeu_ps(p, v); }
  inline Vec operator+(Vec o) const { return {_mm256_add_ps(v, o.v)}; }
  inline Vec operator-(Vec o) const { return {_mm256_sub_ps(v, o.v)}; }
  inline Vec operator*(Vec o) const { return {_mm256_mul_ps(v, o.v)}; }
  inline Vec operator/(Vec o) const { return {_mm256_div_ps(v, o.v)}; }
  static inline Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }
  static inline Vec min(Vec a, Vec b) { return {_mm256_min_ps(a.v, b.v)}; }
  // a * b + c with one rounding.
  static inline Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  static inline Vec round(Vec a) { return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
  // 2^n for integral n in [-126, 127], built in the exponent field.
  static inline Vec pow2(Vec n) {
    __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(e, 23))};
  }
  inline void lanes(float* out) const { _mm256_storeu_ps(out, v); }
  // Eight float16 values (their bits) widened to float32, exactly.
  static inline Vec load_half(const uint16_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
  }
  // Eight int8 values widened to float32, exactly (the 8-bit KV cache's codes).
  static inline Vec load_i8(const int8_t* p) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
  }
};

#else

struct Vec {
  float v[kLanes];
  static inline Vec zero() { Vec r; for (int i = 0; i < kLanes; ++i) r.v[i] = 0.f; return r; }
  static inline Vec broadcast(float x) { Vec r; for (int i = 0; i < kLanes; ++i) r.v[i] = x; return r; }
  static inline Vec broadcast(const float* p) { return broadcast(*p); }
  static inline Vec load(const float* p) { Vec r; std::memcpy(r.v, p, sizeof(r.v)); return r; }
  inline void store(float* p) const { std::memcpy(p, v, sizeof(v)); }
#define EXPERT_VEC_BINOP(op) \
  inline Vec operator op(Vec o) const { Vec r; for (int i = 0; i < kLanes; ++i) r.v[i] = v[i] op o.v[i]; return r; }
  EXPERT_VEC_BINOP(+)
  EXPERT_VEC_BINOP(-)
  EXPERT_VEC_BINOP(*)
  EXPERT_VEC_BINOP(/)
#undef EXPERT_VEC_BINOP
  static inline Vec max(Vec a, Vec b) { Vec r; for (int i = 0; i < kLanes; ++i) r.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i]; return r; }
  static inline Vec min(Vec a, Vec b) { Vec r; for (int i = 0; i < kLanes; ++i) r.v[i] = a.v[i] < b.v[i] ? a.v[i] : b.v[i]; return r; }
  static inline Vec fma(Vec a, Vec b, Vec c) { Vec r; for (int i = 0; i < kLanes; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]); return r; }
  static inline Vec round(Vec a) { Vec r; for (int i = 0; i < kLanes; ++i) r.v[i] = std::nearbyint(a.v[i]); return r; }
  static inline Vec pow2(Vec n) {
    Vec r;
    for (int i = 0; i < kLanes; ++i) {
      int32_t bits = (static_cast<int32_t>(n.v[i]) + 127) << 23;
      std::memcpy(&r.v[i], &bits, sizeof(float));
    }
    return r;
  }
  inline void lanes(float* out) const { std::memcpy(out, v, sizeof(v)); }
  static inline Vec load_half(const uint16_t* p) {
    Vec r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = half_to_float(p[i]);
    return r;
  }
  static inline Vec load_i8(const int8_t* p) {
    Vec r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = static_cast<float>(p[i]);
    return r;
  }
};

#endif

// Sum of the eight lanes in one fixed tree order: ((0+4)+(2+6)) + ((1+5)+(3+7)).
inline float hsum(Vec a) {
  float l[kLanes];
  a.lanes(l);
  float s04 = l[0] + l[4], s15 = l[1] + l[5], s26 = l[2] + l[6], s37 = l[3] + l[7];
  return (s04 + s26) + (s15 + s37);
}

// hsum of eight vectors at once: lane j of the result is hsum(a[j]), bitwise (the same tree), for
// eight dot products in about a tenth of the instructions of eight hsum calls.
inline Vec hsum8(const Vec a[8]) {
#if defined(EXPERT_VEC_AVX2)
  // p_i = x_i + x_{i+4} for two vectors at a time: [p(a[j]) | p(a[j + 4])]
  __m256 p[4];
  for (int j = 0; j < 4; ++j)
    p[j] = _mm256_add_ps(_mm256_permute2f128_ps(a[j].v, a[j + 4].v, 0x20),
                         _mm256_permute2f128_ps(a[j].v, a[j + 4].v, 0x31));
  // (p0 + p2), (p1 + p3) for pairs of vectors
  const __m256 q01 = _mm256_add_ps(_mm256_shuffle_ps(p[0], p[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(p[0], p[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 q23 = _mm256_add_ps(_mm256_shuffle_ps(p[2], p[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(p[2], p[3], _MM_SHUFFLE(3, 2, 3, 2)));
  // (p0 + p2) + (p1 + p3)
  return {_mm256_add_ps(_mm256_shuffle_ps(q01, q23, _MM_SHUFFLE(2, 0, 2, 0)),
                        _mm256_shuffle_ps(q01, q23, _MM_SHUFFLE(3, 1, 3, 1)))};
#else
  float sums[kLanes];
  for (int j = 0; j < kLanes; ++j) sums[j] = hsum(a[j]);
  return Vec::load(sums);
#endif
}

inline float hmax(Vec a) {
  float l[kLanes];
  a.lanes(l);
  float m = l[0];
  for (int i = 1; i < kLanes; ++i) m = l[i] > m ? l[i] : m;
  return m;
}

// exp(x) to about one ulp: x = n ln2 + r with |r| <= ln2/2, a degree-6 polynomial for e^r,
// then scaling by 2^n. Inputs below -87 flush towards zero; the kernels only pass x <= 88.
inline Vec exp(Vec x) {
  const Vec hi = Vec::broadcast(88.0f), lo = Vec::broadcast(-87.3365478515625f);
  x = Vec::min(Vec::max(x, lo), hi);
  Vec n = Vec::round(x * Vec::broadcast(1.44269504088896341f));
  Vec r = Vec::fma(n, Vec::broadcast(-0.693359375f), x);
  r = Vec::fma(n, Vec::broadcast(2.12194440e-4f), r);
  Vec p = Vec::broadcast(1.9875691500e-4f);
  p = Vec::fma(p, r, Vec::broadcast(1.3981999507e-3f));
  p = Vec::fma(p, r, Vec::broadcast(8.3334519073e-3f));
  p = Vec::fma(p, r, Vec::broadcast(4.1665795894e-2f));
  p = Vec::fma(p, r, Vec::broadcast(1.6666665459e-1f));
  p = Vec::fma(p, r, Vec::broadcast(5.0000001201e-1f));
  p = Vec::fma(p, r * r, r + Vec::broadcast(1.0f));
  return p * Vec::pow2(n);
}

// Scalar twin of exp(Vec) for tails, computing the same steps as one lane.
inline float exp_scalar(float x) {
  float l[kLanes];
  exp(Vec::broadcast(x)).lanes(l);
  return l[0];
}

}  // namespace expert
