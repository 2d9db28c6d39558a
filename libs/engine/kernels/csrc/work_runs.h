// Work handed to the threads in runs taken from a shared counter, for the kernels whose items
// cost about the same (the linear layer's row-block x panel-group items, attention's work items).
//
// Why not a fixed share per thread: on the 2-core machine one core is now and then slower than
// the other for a while, and with fixed shares every call waited for it. Which thread computes an
// item never changes the item's numbers, so results stay bitwise the same.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace expert {

// Calls body(next) once on each thread (at most one thread per item); next(begin, end) hands the
// calling thread the next run of up to `run` consecutive items of [0, count) and returns false
// once none is left. Per-thread scratch belongs in `body`, before its first call of next.
template <class Body>
void parallel_runs(int64_t count, int64_t run, const Body& body) {
  std::atomic<int64_t> counter{0};
  auto next = [&](int64_t& begin, int64_t& end) {
    begin = counter.fetch_add(run);
    end = std::min(count, begin + run);
    return begin < count;
  };
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), count));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { body(next); });
}

}  // namespace expert
