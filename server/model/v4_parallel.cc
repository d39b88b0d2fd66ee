#include "server/model/v4_parallel.h"

#include <algorithm>
#include <vector>

namespace quantd::model {

int ParallelWorkers(const HostThreads& threads, int64_t rows, int64_t work_per_row) {
  const int count = threads.pool == nullptr ? 1 : std::min(threads.count, threads.pool->size());
  if (count <= 1 || rows <= 1) return 1;
  const int64_t work = rows * std::max<int64_t>(work_per_row, 1);
  const int64_t affordable = std::max<int64_t>(1, work / std::max<int64_t>(threads.min_work, 1));
  return static_cast<int>(std::min<int64_t>({count, rows, affordable}));
}

void ParallelRows(const HostThreads& threads, int64_t rows, int64_t work_per_row,
                  const std::function<void(int worker, int64_t begin, int64_t end)>& fn) {
  if (rows <= 0) return;
  const int workers = ParallelWorkers(threads, rows, work_per_row);
  if (workers == 1) {
    fn(0, 0, rows);
    return;
  }
  threads.pool->Run(workers, rows, fn);
}

absl::Status ParallelRowsOrError(
    const HostThreads& threads, int64_t rows, int64_t work_per_row,
    const std::function<absl::Status(int64_t begin, int64_t end)>& fn) {
  const int workers = ParallelWorkers(threads, rows, work_per_row);
  std::vector<absl::Status> status(static_cast<size_t>(workers));
  ParallelRows(threads, rows, work_per_row,
               [&](int worker, int64_t begin, int64_t end) { status[worker] = fn(begin, end); });
  for (const absl::Status& s : status) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace quantd::model
