// DeviceRequirement: what one task needs from the device it runs on. Stages state it when they
// plan a task; the scheduler places the task only on a device that fits, and never two tasks on
// one device whose memory_bytes sum past the device's total.
#ifndef QUANTD_SERVER_COMPUTE_REQUIREMENT_H_
#define QUANTD_SERVER_COMPUTE_REQUIREMENT_H_

#include <stdint.h>

#include "server/compute/device.h"

namespace quantd::compute {

struct DeviceRequirement {
  bool gpu = false;          // must run on a CUDA device
  int64_t memory_bytes = 0;  // device memory the task holds while it runs; 0 = negligible

  bool operator==(const DeviceRequirement&) const = default;
};

// True when a task with `req` may start on `device` while tasks holding `reserved_bytes` of its
// memory already run there.
bool Fits(const Device& device, const DeviceRequirement& req, int64_t reserved_bytes);

}  // namespace quantd::compute

#endif  // QUANTD_SERVER_COMPUTE_REQUIREMENT_H_
