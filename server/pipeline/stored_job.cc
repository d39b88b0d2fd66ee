#include "server/pipeline/stored_job.h"

#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "server/base/status_macros.h"
#include "server/store/private_files.h"

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
  stored.work_dir = JobWorkDir(store.db().path(), job_id);
  return stored;
}

std::string JobWorkDir(const std::string& db_path, int64_t job_id) {
  return absl::StrCat(db_path, ".work/job-", job_id);
}

absl::Status CreateWorkRoot(const std::string& db_path) {
  return store::CreatePrivateDir(absl::StrCat(db_path, ".work")).status();
}

absl::Status RemoveJobWorkDir(const std::string& db_path, int64_t job_id) {
  const std::string dir = JobWorkDir(db_path, job_id);
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot remove ", dir, ": ", ec.message()));
  return absl::OkStatus();
}

}  // namespace quantd::pipeline
