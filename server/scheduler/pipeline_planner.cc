// NewPipelinePlanner: JobPlanner over pipeline::PreparedJob.
//
// PreparedJob::Prepare reads the source and uses the store in one call, and the store belongs to
// the strand. So Load reads the source off the strand (it fails a job with an unreadable or
// inconsistent source there, and leaves the shard headers in the page cache), and Attach runs
// Prepare on the strand, which reads those headers again from the cache. Once PreparedJob offers
// its two phases separately, Load keeps what it read and Attach only touches the store.
#include <utility>

#include "server/base/status_macros.h"
#include "server/checkpoint/checkpoint_dir.h"
#include "server/pipeline/plan.h"
#include "server/pipeline/prepared_job.h"
#include "server/pipeline/tensor_inventory.h"
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
                        int64_t now_ms) const override {
    return job_->CompleteTask(store, lease, task, output, now_ms);
  }
  // The stage stated it when it planned the task; the store keeps it on the task row.
  compute::DeviceRequirement Requirement(const store::TaskRow& task) const override {
    return task.requirement;
  }
  absl::StatusOr<int> SweepTmpFiles() const override { return job_->SweepTmpFiles(); }

 private:
  std::unique_ptr<pipeline::PreparedJob> job_;  // shared read-only by the workers
};

class LoadedPipelineJob final : public LoadedJob {
 public:
  explicit LoadedPipelineJob(pipeline::JobSpec spec) : spec_(std::move(spec)) {}

  absl::StatusOr<std::unique_ptr<JobTasks>> Attach(
      store::JobStore& store, int64_t job_id, int64_t now_ms,
      const std::function<void(const std::string&)>& log) override {
    ASSIGN_OR_RETURN(std::unique_ptr<pipeline::PreparedJob> job,
                     pipeline::PreparedJob::Prepare(store, job_id, spec_, now_ms, log));
    return std::unique_ptr<JobTasks>(new PipelineTasks(std::move(job)));
  }

 private:
  const pipeline::JobSpec spec_;  // the job's spec
};

class PipelinePlanner final : public JobPlanner {
 public:
  absl::StatusOr<std::unique_ptr<LoadedJob>> Load(const pipeline::JobSpec& spec) override {
    ASSIGN_OR_RETURN(std::unique_ptr<checkpoint::CheckpointDir> source,
                     checkpoint::CheckpointDir::Open(spec.source));
    ASSIGN_OR_RETURN(pipeline::TensorInventory inventory, pipeline::BuildInventory(*source));
    RETURN_IF_ERROR(pipeline::BuildPlan(spec, *source, inventory).status());
    return std::unique_ptr<LoadedJob>(new LoadedPipelineJob(spec));
  }
};

}  // namespace

std::unique_ptr<JobPlanner> NewPipelinePlanner() { return std::make_unique<PipelinePlanner>(); }

}  // namespace quantd::scheduler
