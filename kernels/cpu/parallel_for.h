// A minimal parallel-for over an index range on plain std::threads.
#ifndef QUANTD_KERNELS_CPU_PARALLEL_FOR_H_
#define QUANTD_KERNELS_CPU_PARALLEL_FOR_H_

#include <stdint.h>

#include <functional>

namespace quantd::kernels::cpu {

// Splits [0, n) into `workers` contiguous ranges of nearly equal size (range w is
// [n * w / workers, n * (w + 1) / workers)) and runs fn(w, begin, end) for each: range 0 on the
// calling thread, the others on threads of their own (or on the calling thread if a thread cannot
// be started). Returns when every range is done. workers is clamped to [1, max(n, 1)].
void ParallelFor(int workers, int64_t n,
                 const std::function<void(int worker, int64_t begin, int64_t end)>& fn);

}  // namespace quantd::kernels::cpu

#endif  // QUANTD_KERNELS_CPU_PARALLEL_FOR_H_
