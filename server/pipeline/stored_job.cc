#include "server/pipeline/stored_job.h"

#include <filesystem>
#include <system_error>

#include "server/base/status_macros.h"

namespace quantd::pipeline {

absl::StatusOr<StoredJob> ReadStoredJob(store::JobStore& store, int64_t job_id) {
  ASSIGN_OR_RETURN(const store::JobRow row, store.GetJob(job_id));
  StoredJob stored;
  // The claim names the job by id, creation time and state database (JobIdentity).
  std::error_code ec;
  stored.identity = {
      job_id, row.created_ms,
      std::filesystem::weakly_canonical(std::filesystem::absolute(store.db().path()), ec).string()};
  stored.planned = store.HasPlan(job_id);
  if (stored.planned) {
    ASSIGN_OR_RETURN(stored.tasks, store.ListTasks(job_id));
  }
  return stored;
}

}  // namespace quantd::pipeline
