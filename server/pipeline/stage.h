// What a stage needs to run one task, and what a task produces.
//
// Each stage is a free function over its task payload (plan.h), in its own file under stages/.
// Stages never touch the JobStore: the runner leases tasks, runs them (possibly several at once on
// worker threads) and records their TaskOutput. A stage writes only `<file>.tmp` and renames it
// into place when complete (checkpoint/atomic_file.h, SafetensorsWriter), so re-running an
// interrupted task is harmless.
//
// Errors: InvalidArgument / DataLoss for bad input (a corrupt shard, a tensor that breaks a rule:
// permanent, the message names the file and the tensor), Unavailable / ResourceExhausted for
// transient conditions (EAGAIN, ENOSPC: retried with back-off), Cancelled when `cancelled` was
// set (the task is requeued as interrupted).
#ifndef QUANTD_SERVER_PIPELINE_STAGE_H_
#define QUANTD_SERVER_PIPELINE_STAGE_H_

#include <stdint.h>

#include <atomic>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "server/checkpoint/checkpoint_dir.h"
#include "server/pipeline/job_spec.h"
#include "server/pipeline/tensor_inventory.h"
#include "server/store/job_store.h"

namespace quantd::pipeline {

struct StageContext {
  const JobSpec* spec = nullptr;
  const checkpoint::CheckpointDir* source = nullptr;  // opened once per run
  const TensorInventory* inventory = nullptr;         // of `source`
  kernels::Backend* backend = nullptr;                // where decode/quantize kernels run
  // Calibrated max |input| per quantized module (the amax table), for input_scale.
  const std::map<std::string, float>* input_amax = nullptr;
  // Called with the number of source bytes just processed (for progress); thread-safe.
  std::function<void(uint64_t)> add_progress;
  // Set when the job is being cancelled or the process is stopping; checked between tensors.
  const std::atomic<bool>* cancelled = nullptr;
};

struct TaskOutput {
  std::string path;      // the file the task wrote ("" when it wrote none)
  uint64_t bytes = 0;    // its size
  std::string sha256;    // its SHA-256, hex
  std::vector<store::TensorStatsRow> stats;  // verify: per-tensor error against the source
};

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_STAGE_H_
