// StoredJob: what the state database says about a job when a process starts (or resumes) it.
// Read on the thread that owns the JobStore (the scheduler's strand) and handed to the source
// phase of PreparedJob (PreparedJob::Load), which reads files only and never touches the store.
#ifndef QUANTD_SERVER_PIPELINE_STORED_JOB_H_
#define QUANTD_SERVER_PIPELINE_STORED_JOB_H_

#include <stdint.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/pipeline/output_marker.h"
#include "server/store/job_store.h"

namespace quantd::pipeline {

struct StoredJob {
  JobIdentity identity;              // the job, as its output markers name it
  bool planned = false;              // its plan is stored: this is not its first start
  std::vector<store::TaskRow> tasks;  // the stored plan's tasks (empty until planned)
  std::string work_dir;               // JobWorkDir of the job
};

// Reads job `job_id` from `store` (on the store's thread).
absl::StatusOr<StoredJob> ReadStoredJob(store::JobStore& store, int64_t job_id);

// A job's own work directory (calibration tokens, spilled activations, layer checkpoints):
// "<state>.work/job-<id>" next to the state database `db_path`.
std::string JobWorkDir(const std::string& db_path, int64_t job_id);
// Creates "<state>.work", the parent of every job's work directory, with mode 0700, or makes an
// existing one private (store/private_files.h): what jobs keep there (calibration tokens,
// activations) is readable by quantd's user only, whatever their own modes.
absl::Status CreateWorkRoot(const std::string& db_path);
// Removes JobWorkDir(db_path, job_id) with everything in it (nothing when it does not exist):
// for a job that can no longer resume (SUCCEEDED, CANCELLED) or was deleted.
absl::Status RemoveJobWorkDir(const std::string& db_path, int64_t job_id);

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_STORED_JOB_H_
