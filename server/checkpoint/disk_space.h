// DiskSpaceUnder: how full the file system that holds (or will hold) a path is: for the free-space
// check before a job writes (pipeline/plan.h CheckDiskSpace), the quantd_disk_* metrics and the
// "disk nearly full" alerts (deploy/prometheus/alerts.yml).
#ifndef QUANTD_SERVER_CHECKPOINT_DISK_SPACE_H_
#define QUANTD_SERVER_CHECKPOINT_DISK_SPACE_H_

#include <stdint.h>

#include <string>

#include "absl/status/statusor.h"

namespace quantd::checkpoint {

struct DiskSpace {
  int64_t free_bytes = 0;  // available to an unprivileged writer (statvfs f_bavail)
  int64_t size_bytes = 0;  // the file system's size (f_blocks)
};

// The file system of `path`, or of its nearest existing ancestor when `path` does not exist yet
// (an output directory a job has not created). `path` must be absolute; InvalidArgument
// otherwise, NotFound naming the path when no ancestor can be examined.
absl::StatusOr<DiskSpace> DiskSpaceUnder(const std::string& path);

}  // namespace quantd::checkpoint

#endif  // QUANTD_SERVER_CHECKPOINT_DISK_SPACE_H_
