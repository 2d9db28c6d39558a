// The decoder layers of one forward step in one call: the same kernels, in the same order, as the
// model's Python loop (libs/engine/models/decoder.py), so the results are bitwise the same.
//
// Why: at batch 1 a step makes about eight kernel calls per layer, and going back to Python
// between them cost about 0.9 ms per token on the default model (30 layers); one call saves about
// 0.5 ms of it, a tenth of an int8 decode step. The loop is used for steps without experts; with
// experts the Python loop runs, which applies them between the kernels.
#include <ATen/ATen.h>

#include "kernels.h"

namespace expert {
namespace {

// Per layer, `weights` holds kLayerSlots entries (None where a layer has no such tensor):
//   input_norm, q_norm, k_norm, post_norm, then for qkv, o, gate_up, down: weight, scales, mins, bias
// and `out_features` the four projections' output sizes. A projection with scales is quantized.
constexpr int64_t kNorms = 4, kLinearSlots = 4, kLinears = 4;
constexpr int64_t kLayerSlots = kNorms + kLinears * kLinearSlots;

at::Tensor project(const at::Tensor& x, const c10::List<c10::optional<at::Tensor>>& weights, int64_t base,
                   int64_t out_features) {
  const c10::optional<at::Tensor> weight = weights.get(base), scales = weights.get(base + 1);
  const c10::optional<at::Tensor> mins = weights.get(base + 2), bias = weights.get(base + 3);
  if (scales.has_value()) return quantized_linear(x, *weight, *scales, mins, bias, out_features);
  return linear(x, *weight, bias, out_features);
}

}  // namespace

// x: the first layer's normed input [T, H]; residual: its residual stream [T, H], updated in place.
// Returns the last layer's output (before the final norm).
at::Tensor decoder_layers(at::Tensor x, at::Tensor residual, const at::Tensor& positions, const at::Tensor& cos_sin,
                          at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slot_mapping,
                          const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const at::Tensor& query_start_loc, const c10::List<c10::optional<at::Tensor>>& weights,
                          at::IntArrayRef out_features, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          double eps, double scale) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(v_caches.size()) == layers, "decoder_layers: one K and one V cache per layer");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kLayerSlots &&
                  static_cast<int64_t>(out_features.size()) == layers * kLinears,
              "decoder_layers: expected ", kLayerSlots, " weight slots and ", kLinears, " sizes per layer");
  for (int64_t n = 0; n < layers; ++n) {
    const int64_t w = n * kLayerSlots, linear0 = w + kNorms;
    const int64_t* sizes = out_features.data() + n * kLinears;
    if (n > 0) fused_add_rms_norm(x, residual, *weights.get(w), eps);
    at::Tensor k_cache = k_caches[n], v_cache = v_caches[n];
    const at::Tensor qkv = project(x, weights, linear0, sizes[0]);
    const at::Tensor q = rotary_embedding_and_cache(qkv, positions, cos_sin, k_cache, v_cache, slot_mapping, num_heads,
                                                    num_kv_heads, head_dim, weights.get(w + 1), weights.get(w + 2), eps);
    const at::Tensor attended = paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale);
    x = project(attended, weights, linear0 + kLinearSlots, sizes[1]);
    fused_add_rms_norm(x, residual, *weights.get(w + 3), eps);
    const at::Tensor gate_up = project(x, weights, linear0 + 2 * kLinearSlots, sizes[2]);
    x = project(silu_and_mul(gate_up), weights, linear0 + 3 * kLinearSlots, sizes[3]);
  }
  return x;
}

}  // namespace expert
