// Splits the fused QKV projection, applies the optional per-head QK RMSNorm (Qwen3) and the
// rotary embedding (rotate-half / NeoX layout, as HF Llama and Qwen use), returns the queries and
// writes keys and values into the paged cache at each token's slot.
//
// One pass over the tokens replaces split + norm + rope + two scatter ops per layer. An int8 cache
// (kv_int8.h) gets each row quantized on its way in.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <vector>

#include "kv_int8.h"
#include "vec.h"

namespace expert {
namespace {

// Per-head RMSNorm into dst (may alias src).
inline void head_norm(const float* src, const float* w, float* dst, int64_t d, float eps) {
  Vec acc = Vec::zero();
  for (int64_t i = 0; i < d; i += kLanes) {
    const Vec v = Vec::load(src + i);
    acc = Vec::fma(v, v, acc);
  }
  const float inv = 1.0f / std::sqrt(hsum(acc) / static_cast<float>(d) + eps);
  const Vec vinv = Vec::broadcast(inv);
  for (int64_t i = 0; i < d; i += kLanes) (Vec::load(w + i) * (Vec::load(src + i) * vinv)).store(dst + i);
}

// x1*cos - x2*sin and x2*cos + x1*sin with separate roundings, as HF's rotate_half formula.
inline void rotate(const float* src, const float* cos, const float* sin, float* dst, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; i += kLanes) {
    const Vec x1 = Vec::load(src + i), x2 = Vec::load(src + half + i);
    const Vec c = Vec::load(cos + i), s = Vec::load(sin + i);
    const Vec o1 = x1 * c - x2 * s;
    const Vec o2 = x2 * c + x1 * s;
    o1.store(dst + i);
    o2.store(dst + half + i);
  }
}

}  // namespace

at::Tensor rotary_embedding_and_cache(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_sin,
                                      at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping,
                                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                      const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                                      double eps) {
  const int64_t D = head_dim, Hq = num_heads, Hkv = num_kv_heads;
  TORCH_CHECK(D % (2 * kLanes) == 0, "rotary_embedding_and_cache: head_dim must be a multiple of 16");
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && qkv.is_contiguous(), "rotary_embedding_and_cache: qkv");
  TORCH_CHECK(qkv.size(-1) == (Hq + 2 * Hkv) * D, "rotary_embedding_and_cache: qkv width");
  const bool int8_cache = k_cache.scalar_type() == at::kChar;
  const int64_t row = int8_cache ? D + kKvScaleBytes : D;  // cache elements per token row
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(1) == Hkv && k_cache.size(3) == row,
              "rotary_embedding_and_cache: cache layout must be [blocks, kv_heads, block_size, head_dim] "
              "(head_dim + 4 bytes for an int8 cache)");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() &&
                  (int8_cache || k_cache.scalar_type() == at::kFloat),
              "rotary_embedding_and_cache: caches must both be float32 or both int8");
  TORCH_CHECK(cos_sin.size(1) == D, "rotary_embedding_and_cache: cos_sin width");
  const bool has_qn = q_norm.has_value() && q_norm->defined();
  const bool has_kn = k_norm.has_value() && k_norm->defined();
  const int64_t T = qkv.numel() / ((Hq + 2 * Hkv) * D);
  const int64_t block_size = k_cache.size(2);
  auto q = at::empty({T, Hq, D}, qkv.options());
  auto pos = positions.to(at::kLong).contiguous();
  auto slots = slot_mapping.to(at::kLong).contiguous();
  const float* src = qkv.data_ptr<float>();
  const float* cs = cos_sin.data_ptr<float>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const float* qn = has_qn ? q_norm->data_ptr<float>() : nullptr;
  const float* kn = has_kn ? k_norm->data_ptr<float>() : nullptr;
  float* qo = q.data_ptr<float>();
  float* kc = int8_cache ? nullptr : k_cache.data_ptr<float>();
  float* vc = int8_cache ? nullptr : v_cache.data_ptr<float>();
  int8_t* kq = int8_cache ? k_cache.data_ptr<int8_t>() : nullptr;
  int8_t* vq = int8_cache ? v_cache.data_ptr<int8_t>() : nullptr;
  const int64_t max_pos = cos_sin.size(0);
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pp[t] >= 0 && pp[t] < max_pos, "rotary_embedding_and_cache: position out of range");
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    std::vector<float> tmp(D), rotated(D);
    for (int64_t t = t0; t < t1; ++t) {
      const float* src_row = src + t * (Hq + 2 * Hkv) * D;
      const float* cos = cs + pp[t] * D;
      const float* sin = cos + D / 2;
      for (int64_t h = 0; h < Hq; ++h) {
        const float* x = src_row + h * D;
        if (has_qn) { head_norm(x, qn, tmp.data(), D, feps); x = tmp.data(); }
        rotate(x, cos, sin, qo + (t * Hq + h) * D, D);
      }
      const int64_t slot = sp[t];
      if (slot < 0) continue;  // padding token: nothing to store
      const int64_t block = slot / block_size, offset = slot % block_size;
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t dst = ((block * Hkv + h) * block_size + offset) * row;
        const float* k = src_row + (Hq + h) * D;
        if (has_kn) { head_norm(k, kn, tmp.data(), D, feps); k = tmp.data(); }
        const float* v = src_row + (Hq + Hkv + h) * D;
        if (int8_cache) {
          rotate(k, cos, sin, rotated.data(), D);
          kv_quantize_row(rotated.data(), D, kq + dst);
          kv_quantize_row(v, D, vq + dst);
        } else {
          rotate(k, cos, sin, kc + dst, D);
          std::copy(v, v + D, vc + dst);
        }
      }
    }
  });
  return q;
}

}  // namespace expert
