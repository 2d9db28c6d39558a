// RMSNorm, plain and fused with the residual add, one row at a time in a fixed order.
//
// Matches the Llama/Qwen definition in float32: y = w * (x * (1 / sqrt(mean(x^2) + eps))).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "vec.h"

namespace expert {
namespace {

// Sum of squares over one row: eight lane accumulators over full vectors, then the tail.
inline float sum_squares(const float* x, int64_t d) {
  Vec acc = Vec::zero();
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) {
    const Vec v = Vec::load(x + i);
    acc = Vec::fma(v, v, acc);
  }
  float s = hsum(acc);
  for (; i < d; ++i) s = std::fma(x[i], x[i], s);
  return s;
}

inline void normalize_row(const float* x, const float* w, float* out, int64_t d, float eps) {
  const float inv = 1.0f / std::sqrt(sum_squares(x, d) / static_cast<float>(d) + eps);
  const Vec vinv = Vec::broadcast(inv);
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) (Vec::load(w + i) * (Vec::load(x + i) * vinv)).store(out + i);
  for (; i < d; ++i) out[i] = w[i] * (x[i] * inv);
}

void check_rows(const at::Tensor& x, const at::Tensor& w, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, name, ": float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), name, ": contiguous tensors only");
  TORCH_CHECK(x.size(-1) == w.numel(), name, ": weight size ", w.numel(), " != hidden size ", x.size(-1));
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  auto input = x.contiguous();
  check_rows(input, weight, "rms_norm");
  auto out = at::empty_like(input);
  const int64_t d = input.size(-1), rows = d == 0 ? 0 : input.numel() / d;
  const float* px = input.data_ptr<float>();
  const float* pw = weight.data_ptr<float>();
  float* po = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) normalize_row(px + r * d, pw, po + r * d, d, static_cast<float>(eps));
  });
  return out;
}

// residual <- x + residual; x <- rms_norm(residual). Both updated in place, like vLLM's op.
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, weight, "fused_add_rms_norm");
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes(), "fused_add_rms_norm: residual shape");
  const int64_t d = x.size(-1), rows = d == 0 ? 0 : x.numel() / d;
  float* px = x.data_ptr<float>();
  float* pr = residual.data_ptr<float>();
  const float* pw = weight.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* xr = px + r * d;
      float* rr = pr + r * d;
      int64_t i = 0;
      for (; i + kLanes <= d; i += kLanes) (Vec::load(xr + i) + Vec::load(rr + i)).store(rr + i);
      for (; i < d; ++i) rr[i] = xr[i] + rr[i];
      normalize_row(rr, pw, xr, d, static_cast<float>(eps));
    }
  });
}

}  // namespace expert
