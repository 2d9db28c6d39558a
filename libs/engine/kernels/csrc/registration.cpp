// Registers the kernels as torch operators under torch.ops.expert_kernels.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "kernels.h"

namespace expert {
bool supports_head_dim(int64_t head_dim) { return head_dim % 16 == 0 && paged_attention_supports(head_dim); }
}  // namespace expert

TORCH_LIBRARY(expert_kernels, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor", &expert::pack_linear_weight);
  m.def("linear(Tensor input, Tensor packed, Tensor? bias, int out_features) -> Tensor", &expert::linear);
  m.def("quantized_linear(Tensor input, Tensor codes, Tensor scales, Tensor? mins, Tensor? bias, int out_features) -> Tensor",
        &expert::quantized_linear);
  m.def("quantized_embedding(Tensor codes, Tensor scales, Tensor? mins, Tensor ids) -> Tensor",
        &expert::quantized_embedding);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &expert::rms_norm);
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()",
        &expert::fused_add_rms_norm);
  m.def("silu_and_mul(Tensor gate_up) -> Tensor", &expert::silu_and_mul);
  m.def("argmax_rows(Tensor logits) -> Tensor", &expert::argmax_rows);
  m.def(
      "rotary_embedding_and_cache(Tensor qkv, Tensor positions, Tensor cos_sin, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, Tensor slot_mapping, int num_heads, int num_kv_heads, int head_dim, "
      "Tensor? q_norm, Tensor? k_norm, float eps) -> Tensor",
      &expert::rotary_embedding_and_cache);
  m.def(
      "paged_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
      "Tensor query_start_loc, float scale) -> Tensor",
      &expert::paged_attention);
  m.def(
      "decoder_layers(Tensor x, Tensor(a!) residual, Tensor positions, Tensor cos_sin, Tensor(b!)[] k_caches, "
      "Tensor(c!)[] v_caches, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, "
      "Tensor?[] weights, int[] out_features, int num_heads, int num_kv_heads, int head_dim, float eps, "
      "float scale) -> Tensor",
      &expert::decoder_layers);
  m.def("supports_head_dim(int head_dim) -> bool", &expert::supports_head_dim);
  m.def(
      "lora_apply(Tensor(a!) y, Tensor x, Tensor a, Tensor bt, int col_offset, Tensor query_start_loc, "
      "Tensor entry_ptr, Tensor entry_row, Tensor entry_count, Tensor entry_scale) -> ()",
      &expert::lora_apply);
  m.def(
      "ia3_scale(Tensor(a!) y, int col_offset, Tensor table, Tensor query_start_loc, Tensor entry_ptr, "
      "Tensor entry_slot, Tensor entry_weight) -> ()",
      &expert::ia3_scale);
}
