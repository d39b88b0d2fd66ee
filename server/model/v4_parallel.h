// The host threads of the DeepSeek-V4 forward's non-GEMM loops (norms, RoPE, mHC, softmax, MoE
// gather/scatter, activation simulation): a loop over independent rows is split into contiguous
// ranges, each run by one thread of the device's pool (kernels/cpu/thread_pool.h). Every output
// element is computed by exactly one thread with the same operations in the same order as on one
// thread, so results are bit-identical for any thread count; reductions never cross a range
// boundary.
#ifndef QUANTD_SERVER_MODEL_V4_PARALLEL_H_
#define QUANTD_SERVER_MODEL_V4_PARALLEL_H_

#include <stdint.h>

#include <functional>

#include "absl/status/status.h"
#include "kernels/cpu/thread_pool.h"

namespace quantd::model {

// Elementary operations (about a nanosecond each) below which a range is not worth a thread of
// its own: waking a pool thread and waiting for it costs microseconds to tens of microseconds on
// a loaded machine.
inline constexpr int64_t kMinWorkPerThread = int64_t{1} << 16;

// How a loop may be split.
struct HostThreads {
  int count = 1;                         // threads at most (the device's host_threads())
  int64_t min_work = kMinWorkPerThread;  // per thread; tests set 1 to split every loop
  kernels::cpu::ThreadPool* pool = nullptr;  // runs the ranges; none: everything on the caller
};

// Runs fn(worker, begin, end) over contiguous ranges of [0, rows) on up to threads.count threads
// of threads.pool (worker in [0, count), range w before range w + 1), fewer when the pool is
// smaller or rows * work_per_row would give a thread less than threads.min_work. One worker:
// fn(0, 0, rows) on the caller.
void ParallelRows(const HostThreads& threads, int64_t rows, int64_t work_per_row,
                  const std::function<void(int worker, int64_t begin, int64_t end)>& fn);

// As ParallelRows for a loop that can fail: every range runs; returns the error of the first
// failing range (the one with the lowest rows, as one thread would have reported it), or OK.
absl::Status ParallelRowsOrError(const HostThreads& threads, int64_t rows, int64_t work_per_row,
                                 const std::function<absl::Status(int64_t begin, int64_t end)>& fn);

// The number of workers ParallelRows uses for this loop (for per-worker scratch).
int ParallelWorkers(const HostThreads& threads, int64_t rows, int64_t work_per_row);

}  // namespace quantd::model

#endif  // QUANTD_SERVER_MODEL_V4_PARALLEL_H_
