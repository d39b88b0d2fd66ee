// NewPipelinePlanner: JobPlanner over pipeline::PreparedJob, whose source phase (Load) runs on
// the planning pool and whose store phase (Attach) runs on the strand.
#include <utility>

#include "server/base/status_macros.h"
#include "server/pipeline/prepared_job.h"
#include "server/scheduler/job_planner.h"

namespace quantd::scheduler {
namespace {

class PipelineTasks final : public JobTasks {
 public:
  explicit PipelineTasks(std::unique_ptr<pipeline::PreparedJob> job) : job_(std::move(job)) {}

  absl::StatusOr<pipeline::TaskOutput> RunTask(
      const store::TaskRow& task, compute::Device& device, const std::atomic<bool>* cancelled,
      std::function<void(uint64_t)> add_progress) const override {
    return job_->RunTask(task, device, cancelled, std::move(add_progress));
  }
  absl::Status Complete(store::JobStore& store, const store::TaskLease& lease,
                        const store::TaskRow& task, const pipeline::TaskOutput& output,
                        int64_t now_ms, bool written_here) const override {
    return job_->CompleteTask(store, lease, task, output, now_ms, written_here);
  }
  // The stage stated it when it planned the task; the store keeps it on the task row.
  compute::DeviceRequirement Requirement(const store::TaskRow& task) const override {
    return task.requirement;
  }
  absl::StatusOr<int> SweepTmpFiles() const override { return job_->SweepTmpFiles(); }
  bool RunsRemotely() const override { return !job_->keeps_stage_state(); }

 private:
  std::unique_ptr<pipeline::PreparedJob> job_;  // shared read-only by the workers
};

class LoadedPipelineJob final : public LoadedJob {
 public:
  explicit LoadedPipelineJob(std::unique_ptr<pipeline::PreparedJob> job) : job_(std::move(job)) {}

  absl::StatusOr<std::unique_ptr<JobTasks>> Attach(
      store::JobStore& store, int64_t now_ms,
      const std::function<void(const std::string&)>& log) override {
    RETURN_IF_ERROR(job_->Attach(store, now_ms, log));
    return std::unique_ptr<JobTasks>(new PipelineTasks(std::move(job_)));
  }

 private:
  std::unique_ptr<pipeline::PreparedJob> job_;  // loaded, not yet attached
};

class PipelinePlanner final : public JobPlanner {
 public:
  explicit PipelinePlanner(int64_t max_tasks) : max_tasks_(max_tasks) {}

  absl::StatusOr<std::unique_ptr<LoadedJob>> Load(const job::JobSpec& spec,
                                                  pipeline::StoredJob stored) override {
    pipeline::PlanLimits limits;
    limits.max_tasks = max_tasks_;
    ASSIGN_OR_RETURN(std::unique_ptr<pipeline::PreparedJob> job,
                     pipeline::PreparedJob::Load(spec, std::move(stored), limits));
    return std::unique_ptr<LoadedJob>(new LoadedPipelineJob(std::move(job)));
  }

 private:
  const int64_t max_tasks_;  // a larger plan fails the job
};

}  // namespace

std::unique_ptr<JobPlanner> NewPipelinePlanner(int64_t max_tasks) {
  return std::make_unique<PipelinePlanner>(max_tasks);
}

}  // namespace quantd::scheduler
