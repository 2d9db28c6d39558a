// The kernels' entry points, as registration.cpp exposes them and layers.cpp calls them.
#pragma once

#include <ATen/ATen.h>

namespace expert {
at::Tensor pack_linear_weight(const at::Tensor& weight);
at::Tensor linear(const at::Tensor& input, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                  int64_t out_features);
at::Tensor quantized_linear(const at::Tensor& input, const at::Tensor& codes, const at::Tensor& scales,
                            const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& bias,
                            int64_t out_features);
at::Tensor quantized_embedding(const at::Tensor& codes, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                               const at::Tensor& ids);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
at::Tensor argmax_rows(const at::Tensor& logits);
at::Tensor rotary_embedding_and_cache(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_sin,
                                      at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping,
                                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                      const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                                      double eps);
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start_loc, double scale);
bool paged_attention_supports(int64_t head_dim);
void lora_apply(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt, int64_t col_offset,
                const at::Tensor& query_start_loc, const at::Tensor& entry_ptr, const at::Tensor& entry_row,
                const at::Tensor& entry_count, const at::Tensor& entry_scale);
void ia3_scale(at::Tensor& y, int64_t col_offset, const at::Tensor& table, const at::Tensor& query_start_loc,
               const at::Tensor& entry_ptr, const at::Tensor& entry_slot, const at::Tensor& entry_weight);

at::Tensor decoder_layers(at::Tensor x, at::Tensor residual, const at::Tensor& positions, const at::Tensor& cos_sin,
                          at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slot_mapping,
                          const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const at::Tensor& query_start_loc, const c10::List<c10::optional<at::Tensor>>& weights,
                          at::IntArrayRef out_features, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          double eps, double scale);
}  // namespace expert
