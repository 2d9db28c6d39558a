// The 8-bit KV cache's layout and quantizer (EXPERT_KV_CACHE_DTYPE=int8).
//
// A token's row of one KV head is head_dim int8 codes followed by that row's float32 scale (four
// bytes, so a row is head_dim + 4 bytes and a block of 16 tokens is one contiguous run, as in the
// float cache). The scale is per token and KV head, symmetric absmax: scale = max|x| / 127, code =
// x / scale rounded half to even. A row depends only on its own token, so a sequence's cache holds
// the same bytes whatever its chunking or batch, which keeps attention batch-invariant, and
// appending to a partly filled block never rewrites the tokens already there.
#pragma once

#include <cstdint>
#include <cstring>

#include "vec.h"

namespace expert {

constexpr int64_t kKvScaleBytes = static_cast<int64_t>(sizeof(float));

inline float kv_row_scale(const int8_t* row, int64_t head_dim) {
  float s;
  std::memcpy(&s, row + head_dim, sizeof(s));
  return s;
}

// Quantizes x[0, d) (d a multiple of kLanes) into `row`: d codes, then the scale.
inline void kv_quantize_row(const float* x, int64_t d, int8_t* row) {
  Vec m = Vec::zero();
  for (int64_t i = 0; i < d; i += kLanes) {
    const Vec v = Vec::load(x + i);
    m = Vec::max(m, Vec::max(v, Vec::zero() - v));
  }
  const float scale = hmax(m) / 127.0f;
  const Vec divisor = Vec::broadcast(scale > 0.0f ? scale : 1.0f);  // an all-zero row stays zero
  const Vec lo = Vec::broadcast(-127.0f), hi = Vec::broadcast(127.0f);
  float lanes[kLanes];
  for (int64_t i = 0; i < d; i += kLanes) {
    Vec::min(Vec::max(Vec::round(Vec::load(x + i) / divisor), lo), hi).lanes(lanes);
    for (int j = 0; j < kLanes; ++j) row[i + j] = static_cast<int8_t>(lanes[j]);
  }
  std::memcpy(row + d, &scale, sizeof(scale));
}

}  // namespace expert
