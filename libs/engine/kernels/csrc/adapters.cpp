// Per-request adapters inside one heterogeneous batch: LoRA deltas and IA³ scaling.
//
// Sequence b owns tokens [query_start_loc[b], query_start_loc[b+1]) and a list of entries
// [entry_ptr[b], entry_ptr[b+1]) — one per expert of that request that touches this module. No
// weights are merged and no per-adapter sub-batches are formed: every token applies its own
// request's experts, in the request's order, with one fixed order of operations per token, so the
// result for a token does not depend on what else is in the batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <vector>

#include "vec.h"

namespace expert {
namespace {

constexpr int64_t kMaxRank = 256;

struct Span {
  int32_t seq, begin, end;  // tokens [begin, end) of sequence seq
};

// Work items: chunks of at most 16 tokens of sequences that have entries.
std::vector<Span> spans(const int32_t* qsl, const int32_t* entry_ptr, int64_t num_seqs) {
  std::vector<Span> out;
  for (int64_t b = 0; b < num_seqs; ++b) {
    if (entry_ptr[b + 1] == entry_ptr[b]) continue;
    for (int32_t t = qsl[b]; t < qsl[b + 1]; t += 16)
      out.push_back({static_cast<int32_t>(b), t, std::min<int32_t>(qsl[b + 1], t + 16)});
  }
  return out;
}

inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc = Vec::zero();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc = Vec::fma(Vec::load(a + i), Vec::load(b + i), acc);
  float s = hsum(acc);
  for (; i < n; ++i) s = std::fma(a[i], b[i], s);
  return s;
}

// y += c * v over n floats.
inline void axpy(float c, const float* v, float* y, int64_t n) {
  const Vec vc = Vec::broadcast(c);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) Vec::fma(vc, Vec::load(v + i), Vec::load(y + i)).store(y + i);
  for (; i < n; ++i) y[i] = std::fma(c, v[i], y[i]);
}

void check_csr(const at::Tensor& qsl, const at::Tensor& entry_ptr, const char* name) {
  TORCH_CHECK(qsl.scalar_type() == at::kInt && entry_ptr.scalar_type() == at::kInt && qsl.is_contiguous() &&
                  entry_ptr.is_contiguous() && qsl.numel() == entry_ptr.numel(),
              name, ": query_start_loc and entry_ptr must be int32 [B + 1]");
}

}  // namespace

// y[t, col_offset : col_offset + out] += sum_e scale_e * bt[rows_e]^T (a[rows_e] x_t)
// a: [rows, in] (LoRA A), bt: [rows, out] (LoRA B transposed, already scaled by alpha / r).
void lora_apply(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt, int64_t col_offset,
                const at::Tensor& query_start_loc, const at::Tensor& entry_ptr, const at::Tensor& entry_row,
                const at::Tensor& entry_count, const at::Tensor& entry_scale) {
  check_csr(query_start_loc, entry_ptr, "lora_apply");
  TORCH_CHECK(y.is_contiguous() && x.is_contiguous() && a.is_contiguous() && bt.is_contiguous() &&
                  y.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat,
              "lora_apply: contiguous float32 tensors only");
  const int64_t in = a.size(1), out = bt.size(1), width = y.size(1);
  TORCH_CHECK(x.size(1) == in && col_offset >= 0 && col_offset + out <= width, "lora_apply: shape mismatch");
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* ptr = entry_ptr.data_ptr<int32_t>();
  const int32_t* rows = entry_row.data_ptr<int32_t>();
  const int32_t* counts = entry_count.data_ptr<int32_t>();
  const float* scales = entry_scale.data_ptr<float>();
  for (int64_t e = 0; e < entry_row.numel(); ++e)
    TORCH_CHECK(rows[e] >= 0 && counts[e] >= 0 && counts[e] <= kMaxRank && rows[e] + counts[e] <= a.size(0),
                "lora_apply: entry ", e, " is outside the pool");
  const std::vector<Span> work = spans(qsl, ptr, query_start_loc.numel() - 1);
  const float* px = x.data_ptr<float>();
  const float* pa = a.data_ptr<float>();
  const float* pb = bt.data_ptr<float>();
  float* py = y.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(work.size()), 1, [&](int64_t w0, int64_t w1) {
    float u[kMaxRank];
    for (int64_t w = w0; w < w1; ++w) {
      const Span& s = work[w];
      for (int32_t t = s.begin; t < s.end; ++t) {
        const float* xt = px + t * in;
        float* yt = py + t * width + col_offset;
        for (int32_t e = ptr[s.seq]; e < ptr[s.seq + 1]; ++e) {
          for (int32_t k = 0; k < counts[e]; ++k) u[k] = scales[e] * dot(pa + (rows[e] + k) * in, xt, in);
          for (int32_t k = 0; k < counts[e]; ++k) axpy(u[k], pb + (rows[e] + k) * out, yt, out);
        }
      }
    }
  });
}

// y[t, col_offset : col_offset + n] *= each entry's vector: l when its weight is 1, else 1 + w (l - 1).
void ia3_scale(at::Tensor& y, int64_t col_offset, const at::Tensor& table, const at::Tensor& query_start_loc,
               const at::Tensor& entry_ptr, const at::Tensor& entry_slot, const at::Tensor& entry_weight) {
  check_csr(query_start_loc, entry_ptr, "ia3_scale");
  TORCH_CHECK(y.is_contiguous() && table.is_contiguous() && y.scalar_type() == at::kFloat &&
                  table.scalar_type() == at::kFloat,
              "ia3_scale: contiguous float32 tensors only");
  const int64_t n = table.size(1), width = y.size(1);
  TORCH_CHECK(col_offset >= 0 && col_offset + n <= width, "ia3_scale: shape mismatch");
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* ptr = entry_ptr.data_ptr<int32_t>();
  const int32_t* slots = entry_slot.data_ptr<int32_t>();
  const float* weights = entry_weight.data_ptr<float>();
  for (int64_t e = 0; e < entry_slot.numel(); ++e)
    TORCH_CHECK(slots[e] >= 0 && slots[e] < table.size(0), "ia3_scale: entry ", e, " is outside the table");
  const std::vector<Span> work = spans(qsl, ptr, query_start_loc.numel() - 1);
  const float* pt = table.data_ptr<float>();
  float* py = y.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(work.size()), 1, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {
      const Span& s = work[w];
      for (int32_t t = s.begin; t < s.end; ++t) {
        float* yt = py + t * width + col_offset;
        for (int32_t e = ptr[s.seq]; e < ptr[s.seq + 1]; ++e) {
          const float* l = pt + slots[e] * n;
          const float wgt = weights[e];
          int64_t i = 0;
          if (wgt == 1.0f) {
            for (; i + kLanes <= n; i += kLanes) (Vec::load(yt + i) * Vec::load(l + i)).store(yt + i);
            for (; i < n; ++i) yt[i] = yt[i] * l[i];
          } else {
            const Vec vw = Vec::broadcast(wgt), one = Vec::broadcast(1.0f);
            for (; i + kLanes <= n; i += kLanes)
              (Vec::load(yt + i) * (one + vw * (Vec::load(l + i) - one))).store(yt + i);
            for (; i < n; ++i) yt[i] = yt[i] * (1.0f + wgt * (l[i] - 1.0f));
          }
        }
      }
    }
  });
}

}  // namespace expert
