#include "kernels/cpu/parallel_for.h"

#include <system_error>
#include <thread>
#include <vector>

namespace quantd::kernels::cpu {

void ParallelFor(int workers, int64_t n,
                 const std::function<void(int worker, int64_t begin, int64_t end)>& fn) {
  if (n <= 0) return;
  if (workers > n) workers = static_cast<int>(n);
  if (workers < 1) workers = 1;
  auto begin = [&](int w) { return n * w / workers; };
  std::vector<std::thread> threads;
  std::vector<int> inline_ranges;  // ranges whose thread could not be started
  threads.reserve(workers - 1);
  for (int w = 1; w < workers; ++w) {
    try {
      threads.emplace_back(fn, w, begin(w), begin(w + 1));
    } catch (const std::system_error&) {
      inline_ranges.push_back(w);
    }
  }
  fn(0, 0, begin(1));
  for (int w : inline_ranges) fn(w, begin(w), begin(w + 1));
  for (std::thread& t : threads) t.join();
}

}  // namespace quantd::kernels::cpu
