// SwiGLU activation on the fused gate/up projection: out = silu(gate) * up.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "vec.h"

namespace expert {

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat, "silu_and_mul: float32 only");
  auto x = gate_up.contiguous();
  const int64_t width = x.size(-1), d = width / 2;
  TORCH_CHECK(width % 2 == 0, "silu_and_mul: last dimension must be even");
  const int64_t rows = width == 0 ? 0 : x.numel() / width;
  auto shape = x.sizes().vec();
  shape.back() = d;
  auto out = at::empty(shape, x.options());
  const float* px = x.data_ptr<float>();
  float* po = out.data_ptr<float>();
  const Vec one = Vec::broadcast(1.0f), zero = Vec::zero();
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = px + r * width;
      const float* u = g + d;
      float* o = po + r * d;
      int64_t i = 0;
      for (; i + kLanes <= d; i += kLanes) {
        const Vec gv = Vec::load(g + i);
        (gv / (one + exp(zero - gv)) * Vec::load(u + i)).store(o + i);
      }
      for (; i < d; ++i) o[i] = g[i] / (1.0f + exp_scalar(-g[i])) * u[i];
    }
  });
  return out;
}

}  // namespace expert
