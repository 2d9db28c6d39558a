// Causal attention over the paged KV cache, for any mix of prefill chunks and decode tokens.
//
// Sequence b owns queries [query_start_loc[b], query_start_loc[b+1]) and has seq_lens[b] tokens
// in the cache after this step's writes; its queries are the last ones, so query i sits at
// position seq_lens[b] - q_len + i and sees keys 0..position. The kernel reads the block table
// directly: no gather into a contiguous copy.
//
// Each (query row, head) is computed alone, keys in ascending order, with the same fixed-order
// dot product, softmax and weighted sum whatever the batch, the chunking or the query's
// neighbours: a token's attention output is bitwise the same in prefill, chunked prefill, decode
// and recompute after preemption. A work item takes the query heads that share a KV head together,
// and in prefill up to kQueryTile consecutive queries with them, block by block, so each block of
// keys and values is read from memory once for all of them; that and prefetching the block two
// ahead made decode attention about 20 % faster than one head at a time (32 sequences of 192
// tokens, default model), with the same bits. Prefetching each thread's
// blocks as one stream (BlockStream), a line at a time behind the arithmetic, took the same
// decode attention from 0.74 to about 0.47 ms a layer with the cache in memory.
//
// An int8 cache (kv_int8.h: codes and a scale per token row) is read directly: a block's codes are
// widened to float once, into a block-sized scratch that stays in L1 for the work item's rows (its
// queries' heads sharing the KV head), and go through the same dot products as float rows; a key's scale multiplies its
// finished dot product and a value's scale its softmax weight. Nothing beyond one block is ever
// dequantized, and a block moves a quarter of the float cache's bytes from memory. Widening a block
// once per group rather than inside each head's dot products made int8 decode attention about 20 %
// faster (32 sequences of 2,000 tokens, default model's heads; a busy machine, so roughly).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <limits>
#include <type_traits>
#include <vector>

#include "kv_int8.h"
#include "vec.h"
#include "work_runs.h"

namespace expert {
namespace {

constexpr int64_t kQueryTile = 8;  // queries per work item in prefill
constexpr int64_t kItemsPerTake = 8;  // the most work items in one run a thread takes

struct WorkItem {
  int32_t seq, kv_head, q_begin, q_end;
};

// T is float (the model-dtype cache) or int8_t (codes with a float scale after each row).
template <typename T>
struct CacheView {
  const T* k;
  const T* v;
  const int32_t* block_table;  // this sequence's row
  int64_t num_kv_heads, block_size, row;  // row: elements per token (head_dim, + 4 bytes for int8)
  inline int64_t offset(int64_t kv_head, int64_t token) const {
    const int64_t block = block_table[token / block_size];
    return ((block * num_kv_heads + kv_head) * block_size + token % block_size) * row;
  }
};

template <typename T>
constexpr bool kQuantized = std::is_same<T, int8_t>::value;

// One block's rows of one KV head as float rows of D: the float cache's where they lie; an int8
// block's codes widened into `scratch` (exactly: every int8 is a float) and its scales put in
// `scales`, once for the G heads that read them rather than once per head.
template <int D, typename T>
inline const float* block_rows(const T* block, int64_t rows, int64_t row, float* scratch, float* scales) {
  if constexpr (kQuantized<T>) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int c = 0; c < D / kLanes; ++c) Vec::load_i8(block + r * row + c * kLanes).store(scratch + r * D + c * kLanes);
      scales[r] = kv_row_scale(block + r * row, D);
    }
    return scratch;
  } else {
    return block;
  }
}

// The blocks one thread reads, in the order it reads them: a work item's K blocks, then its V
// blocks, then the next call's K blocks. The block kAhead places further on in this one stream is
// asked for into L2 a line or two at a time, interleaved with the arithmetic on the current block,
// so that memory stays busy across the switches from K to V and from one item to the next.
// Measured on the 2-core machine (4 KB blocks read in random order): a whole block's prefetches
// issued at once reach 13-15 GB/s, one line per line consumed into L2 20 GB/s, as much as a
// sequential read.
template <typename T>
struct BlockStream {
  static constexpr int64_t kAhead = 3;
  const CacheView<T>* cache;
  int64_t kv_head, num_keys;
  const CacheView<T>* next;  // the next call's cache view, or nullptr
  int64_t next_kv_head, next_num_keys;

  static int64_t blocks(int64_t keys, int64_t bs) { return (keys + bs - 1) / bs; }
  // Block `index` of the stream (K blocks 0..n-1, V blocks n..2n-1, then the next call's K), or
  // nullptr past its end.
  const char* address(int64_t index) const {
    const int64_t bs = cache->block_size, n = blocks(num_keys, bs);
    const T* p = nullptr;
    if (index < n) p = cache->k + cache->offset(kv_head, index * bs);
    else if (index < 2 * n) p = cache->v + cache->offset(kv_head, (index - n) * bs);
    else if (next != nullptr && index - 2 * n < blocks(next_num_keys, bs))
      p = next->k + next->offset(next_kv_head, (index - 2 * n) * bs);
    return reinterpret_cast<const char*>(p);
  }
  int64_t block_bytes() const { return cache->block_size * cache->row * static_cast<int64_t>(sizeof(T)); }
};

// Prefetches one block into L2, a few lines per call of issue().
struct LinePrefetcher {
  const char* next = nullptr;
  const char* end = nullptr;
  void start(const char* block, int64_t bytes) {
    next = block;
    end = block == nullptr ? nullptr : block + bytes;
  }
  inline void issue(int lines) {
    for (int i = 0; i < lines && next < end; ++i, next += 64) __builtin_prefetch(next, 0, 2);
  }
  inline void finish() { issue(1 << 30); }
};

// The query rows of one work item: nq consecutive queries of one sequence, each with the G heads
// that share kv_head. Query qi sees the first num_keys - (nq - 1 - qi) keys, where num_keys is the
// stream's (the last query's). q and out hold a query's G rows at [G][D], one query every
// `token_stride` floats; scores is [nq * G][stride], maxima and sums [nq * G] (scratch).
//
// Each row's numbers are computed exactly as alone: its dot products, running max, exponentials,
// sum and weighted sum of V, keys in ascending order, blocks and eight-key steps cut where they
// would be for that row alone. Interleaving the rows block by block only changes when they run:
// each block of K and V is read from memory, and an int8 block widened, once for the whole item
// (up to kQueryTile queries x G heads) while it is in L1, and the block kAhead ahead in the
// thread's stream is prefetched behind the work on this one.
//
// With an int8 cache each block is widened once into `scratch` ([block_size][D]) and `row_scales`
// ([block_size]); a key's scale multiplies its dot product, a value's scale its softmax weight.
template <int D, typename T>
void attend_rows(const float* q, int64_t nq, int64_t G, int64_t token_stride, const BlockStream<T>& stream,
                 bool prime, float scale, float* scores, int64_t stride, float* maxima, float* sums, float* out,
                 float* scratch, float* row_scales) {
  constexpr int C = D / kLanes;
  constexpr int64_t kAhead = BlockStream<T>::kAhead;
  const CacheView<T>& cache = *stream.cache;
  const int64_t kv_head = stream.kv_head, num_keys = stream.num_keys, rows = nq * G;
  const int64_t bs = cache.block_size, row = cache.row, n = BlockStream<T>::blocks(num_keys, bs);
  const int64_t block_bytes = stream.block_bytes();
  auto keys_of = [&](int64_t qi) { return num_keys - (nq - 1 - qi); };
  for (int64_t r = 0; r < rows; ++r) maxima[r] = -std::numeric_limits<float>::infinity();
  LinePrefetcher ahead;
  // The first call of a thread starts its stream; later calls were prefetched by the one before.
  if (prime)
    for (int64_t b = 0; b < kAhead; ++b) {
      ahead.start(stream.address(b), block_bytes);
      ahead.finish();
    }
  for (int64_t j0 = 0; j0 < num_keys; j0 += bs) {
    ahead.finish();
    ahead.start(stream.address(j0 / bs + kAhead), block_bytes);
    const float* block =
        block_rows<D>(cache.k + cache.offset(kv_head, j0), std::min(num_keys, j0 + bs) - j0, row, scratch, row_scales);
    for (int64_t qi = 0; qi < nq; ++qi) {
      const int64_t j1 = std::min(keys_of(qi), j0 + bs);
      for (int64_t g = 0; g < G; ++g) {
        Vec qv[C];
        const float* qrow = q + qi * token_stride + g * D;
        for (int c = 0; c < C; ++c) qv[c] = Vec::load(qrow + c * kLanes);
        float* s = scores + (qi * G + g) * stride;
        float m = maxima[qi * G + g];
        const float* k = block;
        int64_t j = j0;
        // Eight keys at a time: the same chain per key, summed by hsum8 (bitwise hsum).
        for (; j + kLanes <= j1; j += kLanes, k += kLanes * D) {
          Vec acc[kLanes];
          for (int t = 0; t < kLanes; ++t) acc[t] = Vec::zero();
          for (int c = 0; c < C; ++c) {
            ahead.issue(1);
            for (int t = 0; t < kLanes; ++t) acc[t] = Vec::fma(qv[c], Vec::load(k + t * D + c * kLanes), acc[t]);
          }
          Vec dots = hsum8(acc);
          if constexpr (kQuantized<T>) dots = dots * Vec::load(row_scales + (j - j0));
          (dots * Vec::broadcast(scale)).store(s + j);
          for (int t = 0; t < kLanes; ++t) m = s[j + t] > m ? s[j + t] : m;
        }
        for (; j < j1; ++j, k += D) {
          Vec acc = Vec::zero();
          for (int c = 0; c < C; ++c) acc = Vec::fma(qv[c], Vec::load(k + c * kLanes), acc);
          float dot = hsum(acc);
          if constexpr (kQuantized<T>) dot *= row_scales[j - j0];
          s[j] = dot * scale;
          m = s[j] > m ? s[j] : m;
        }
        maxima[qi * G + g] = m;
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t keys = keys_of(r / G);
    float* s = scores + r * stride;
    const Vec vm = Vec::broadcast(maxima[r]);
    Vec vsum = Vec::zero();
    int64_t j = 0;
    for (; j + kLanes <= keys; j += kLanes) {
      const Vec e = exp(Vec::load(s + j) - vm);
      e.store(s + j);
      vsum = vsum + e;
    }
    float sum = hsum(vsum);
    for (; j < keys; ++j) {
      s[j] = exp_scalar(s[j] - maxima[r]);
      sum += s[j];
    }
    sums[r] = sum;
  }
  // Each row's weighted sum continues block to block through `out` (stored and reloaded exactly).
  for (int64_t j0 = 0; j0 < num_keys; j0 += bs) {
    ahead.finish();
    ahead.start(stream.address(n + j0 / bs + kAhead), block_bytes);
    const float* block =
        block_rows<D>(cache.v + cache.offset(kv_head, j0), std::min(num_keys, j0 + bs) - j0, row, scratch, row_scales);
    for (int64_t qi = 0; qi < nq; ++qi) {
      const int64_t j1 = std::min(keys_of(qi), j0 + bs);
      if (j1 <= j0) continue;  // this query's keys ended in an earlier block
      for (int64_t g = 0; g < G; ++g) {
        const float* s = scores + (qi * G + g) * stride;
        float* orow = out + qi * token_stride + g * D;
        Vec o[C];
        for (int c = 0; c < C; ++c) o[c] = j0 == 0 ? Vec::zero() : Vec::load(orow + c * kLanes);
        const float* v = block;
        for (int64_t jj = j0; jj < j1; ++jj, v += D) {
          float weight = s[jj];
          if constexpr (kQuantized<T>) weight *= row_scales[jj - j0];
          const Vec p = Vec::broadcast(weight);
          ahead.issue(2);
          for (int c = 0; c < C; ++c) o[c] = Vec::fma(p, Vec::load(v + c * kLanes), o[c]);
        }
        for (int c = 0; c < C; ++c) o[c].store(orow + c * kLanes);
      }
    }
  }
  ahead.finish();
  for (int64_t r = 0; r < rows; ++r) {
    const Vec vs = Vec::broadcast(sums[r]);
    float* orow = out + (r / G) * token_stride + (r % G) * D;
    for (int c = 0; c < C; ++c) (Vec::load(orow + c * kLanes) / vs).store(orow + c * kLanes);
  }
}

template <typename T>
using RowsFn = void (*)(const float*, int64_t, int64_t, int64_t, const BlockStream<T>&, bool, float, float*, int64_t,
                        float*, float*, float*, float*, float*);

template <typename T>
RowsFn<T> rows_function(int64_t head_dim) {
  switch (head_dim) {
    case 16: return attend_rows<16, T>;
    case 32: return attend_rows<32, T>;
    case 64: return attend_rows<64, T>;
    case 80: return attend_rows<80, T>;
    case 96: return attend_rows<96, T>;
    case 128: return attend_rows<128, T>;
    case 256: return attend_rows<256, T>;
    default: return nullptr;
  }
}

}  // namespace

bool paged_attention_supports(int64_t head_dim) { return rows_function<float>(head_dim) != nullptr; }

namespace {

// The work items' loop over a cache of element type T.
template <typename T>
void attend_items(const std::vector<WorkItem>& items, const float* pq, float* po, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, const int32_t* pbt, const int32_t* plen, const int32_t* pqsl,
                  int64_t Hq, int64_t D, int64_t max_blocks, int64_t max_len, float scale) {
  const RowsFn<T> attend = rows_function<T>(D);
  TORCH_CHECK(attend != nullptr, "paged_attention: unsupported head_dim ", D);
  const int64_t Hkv = k_cache.size(1), block_size = k_cache.size(2), row = k_cache.size(3), group = Hq / Hkv;
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  // Runs of up to kItemsPerTake consecutive items (work_runs.h), long enough for the block
  // stream to prefetch across a run's items. Against fixed shares: 32-request decode throughput
  // +5.5 % (median of 8 interleaved pairs), a 2,048-token prefill step 3.4 % shorter (10 pairs).
  const int64_t count = static_cast<int64_t>(items.size());
  const int64_t run = std::max<int64_t>(1, std::min<int64_t>(kItemsPerTake, count / (at::get_num_threads() * 4)));
  parallel_runs(count, run, [&](const auto& next) {
    const int64_t stride = std::max<int64_t>(max_len, 1);
    const int64_t rows = group * kQueryTile;
    std::vector<float> scores(rows * stride), maxima(rows), sums(rows);
    // An int8 block widened for the item's rows (unused with a float cache).
    // Aligned to a cache line as the cache's own rows are: a misaligned scratch made every other
    // 32-byte load straddle two lines.
    std::vector<float> scratch_store(kQuantized<T> ? block_size * D + 16 : 0), row_scales(kQuantized<T> ? block_size : 0);
    float* scratch = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch_store.data()) + 63) & ~uintptr_t{63});
    // Keys seen by the last query of item i: its position + 1.
    auto keys_of = [&](const WorkItem& it) -> int64_t {
      return plen[it.seq] - (pqsl[it.seq + 1] - pqsl[it.seq]) + it.q_end;
    };
    auto view_of = [&](const WorkItem& it) -> CacheView<T> {
      return {kc, vc, pbt + it.seq * max_blocks, Hkv, block_size, row};
    };
    for (int64_t i0, i1; next(i0, i1);) {
      for (int64_t i = i0; i < i1; ++i) {
        const WorkItem& it = items[i];
        const CacheView<T> cache = view_of(it);
        const CacheView<T> next_cache = i + 1 < i1 ? view_of(items[i + 1]) : cache;
        // The next call is the next item's, if this run has one.
        BlockStream<T> stream{&cache, it.kv_head, keys_of(it), nullptr, 0, 0};
        if (i + 1 < i1) stream = {&cache, it.kv_head, keys_of(it), &next_cache, items[i + 1].kv_head, keys_of(items[i + 1])};
        const int64_t offset = ((pqsl[it.seq] + it.q_begin) * Hq + it.kv_head * group) * D;
        attend(pq + offset, it.q_end - it.q_begin, group, Hq * D, stream, i == i0, scale, scores.data(), stride,
               maxima.data(), sums.data(), po + offset, scratch, row_scales.data());
      }
    }
  });
}

}  // namespace

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start_loc, double scale) {
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kFloat, "paged_attention: query must be [T, H, D] float32");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention: cache must be contiguous [blocks, kv_heads, block_size, head_dim]");
  const bool int8_cache = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() && (int8_cache || k_cache.scalar_type() == at::kFloat),
              "paged_attention: caches must both be float32 or both int8");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt,
              "paged_attention: block_tables, seq_lens and query_start_loc must be int32");
  auto q = query.contiguous();
  auto bt = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto qsl = query_start_loc.contiguous();
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(1), block_size = k_cache.size(2), B = lens.size(0);
  TORCH_CHECK(k_cache.size(3) == (int8_cache ? D + kKvScaleBytes : D) && Hq % Hkv == 0,
              "paged_attention: head layout mismatch");
  const int64_t max_blocks = bt.size(1);
  const int32_t* pbt = bt.data_ptr<int32_t>();
  const int32_t* plen = lens.data_ptr<int32_t>();
  const int32_t* pqsl = qsl.data_ptr<int32_t>();
  TORCH_CHECK(qsl.size(0) == B + 1 && pqsl[B] == T, "paged_attention: query_start_loc does not cover the queries");

  std::vector<WorkItem> items;
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int32_t q_len = pqsl[b + 1] - pqsl[b];
    TORCH_CHECK(q_len >= 0 && plen[b] >= q_len && plen[b] <= max_blocks * block_size,
                "paged_attention: sequence ", b, " has inconsistent lengths");
    max_len = std::max<int64_t>(max_len, plen[b]);
    for (int64_t h = 0; h < Hkv; ++h)
      for (int32_t q0 = 0; q0 < q_len; q0 += kQueryTile)
        items.push_back({static_cast<int32_t>(b), static_cast<int32_t>(h), q0,
                         static_cast<int32_t>(std::min<int64_t>(q_len, q0 + kQueryTile))});
  }
  auto out = at::empty({T, Hq * D}, q.options());
  const float* pq = q.data_ptr<float>();
  float* po = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  if (int8_cache)
    attend_items<int8_t>(items, pq, po, k_cache, v_cache, pbt, plen, pqsl, Hq, D, max_blocks, max_len, fscale);
  else
    attend_items<float>(items, pq, po, k_cache, v_cache, pbt, plen, pqsl, Hq, D, max_blocks, max_len, fscale);
  return out;
}

}  // namespace expert
