// ParallelFor over independent index ranges (private to the CPU backend).
//
//   ParallelFor(threads, rows, /*grain=*/64, [&](int64_t begin, int64_t end) { ... });
//
// The range [0, n) is cut into at most `threads` contiguous chunks of at least `grain`
// indices; each chunk runs on its own thread (the first on the caller). Callers only
// parallelise work whose items are independent, so the chunking never changes a result.
#ifndef MOED_ENGINE_CPU_PARALLEL_H_
#define MOED_ENGINE_CPU_PARALLEL_H_

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace moe {
namespace cpu {

template <typename Fn>
void ParallelFor(int threads, int64_t n, int64_t grain, const Fn& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  int64_t chunks = std::min<int64_t>(threads, (n + grain - 1) / grain);
  if (chunks <= 1) {
    fn(int64_t{0}, n);
    return;
  }
  const int64_t per = (n + chunks - 1) / chunks;
  std::vector<std::thread> workers;
  workers.reserve(static_cast<size_t>(chunks - 1));
  for (int64_t c = 1; c < chunks; ++c) {
    const int64_t begin = c * per, end = std::min(n, begin + per);
    if (begin >= end) break;
    workers.emplace_back([&fn, begin, end] { fn(begin, end); });
  }
  fn(int64_t{0}, std::min(n, per));
  for (std::thread& t : workers) t.join();
}

}  // namespace cpu
}  // namespace moe

#endif  // MOED_ENGINE_CPU_PARALLEL_H_
