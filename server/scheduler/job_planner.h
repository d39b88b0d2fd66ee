// JobPlanner: the scheduler's seam to the pipeline, so that scheduler tests run fake stages.
//
// Starting a job has two phases. The strand reads what the store knows of the job
// (pipeline::StoredJob). Load then runs off the strand (its planning pool): it reads the source,
// every shard header of it, and on a resume hashes every finished output, which may take
// seconds or minutes, and touches no store. Attach runs on the strand, which owns the JobStore:
// it stores the plan (first start) or requeues the tasks whose outputs changed (later starts)
// and returns the job's JobTasks. A LoadedJob whose job stopped meanwhile is destroyed unused. Tasks then run on worker threads, each
// on the compute::Device its worker owns, and report progress and honour `cancelled` between units
// of work as pipeline/stage.h describes.
#ifndef QUANTD_SERVER_SCHEDULER_JOB_PLANNER_H_
#define QUANTD_SERVER_SCHEDULER_JOB_PLANNER_H_

#include <stdint.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/compute/device.h"
#include "server/compute/requirement.h"
#include "server/job/job_spec.h"
#include "server/pipeline/stage.h"
#include "server/pipeline/stage_registry.h"
#include "server/pipeline/stored_job.h"
#include "server/store/job_store.h"

namespace quantd::scheduler {

// One started job's tasks; read-only, shared by the worker threads.
class JobTasks {
 public:
  virtual ~JobTasks() = default;

  // Runs one task on `device` (a worker thread). `add_progress` receives processed source bytes
  // and counts as the task's heartbeat; the task stops with Cancelled once `cancelled` is true.
  virtual absl::StatusOr<pipeline::TaskOutput> RunTask(
      const store::TaskRow& task, compute::Device& device, const std::atomic<bool>* cancelled,
      std::function<void(uint64_t)> add_progress) const = 0;
  // Marks the leased task DONE in `store` with its output and whatever its stage records, in one
  // transaction (on the strand). FailedPrecondition when the lease is no longer this process's.
  // `written_here`: a local worker ran it (false: a remote worker's result).
  virtual absl::Status Complete(store::JobStore& store, const store::TaskLease& lease,
                                const store::TaskRow& task, const pipeline::TaskOutput& output,
                                int64_t now_ms, bool written_here) const = 0;
  // What the task needs from its device (the strand places it by this).
  virtual compute::DeviceRequirement Requirement(const store::TaskRow& task) const = 0;
  // Removes the *.tmp files interrupted tasks left in the output; returns how many.
  virtual absl::StatusOr<int> SweepTmpFiles() const = 0;
  // Whether remote workers may run the job's tasks: they open the job from its stored spec, so
  // only a job whose stages keep no state between tasks in this process.
  virtual bool RunsRemotely() const { return true; }
};

// A source read by JobPlanner::Load, waiting for the strand to attach it to the store.
class LoadedJob {
 public:
  virtual ~LoadedJob() = default;

  // On the strand, once: plans the job in `store` (first start) or updates its stored tasks with
  // what Load found. `log` receives the planning summary. Errors name the file, tensor or field;
  // the job fails with them.
  virtual absl::StatusOr<std::unique_ptr<JobTasks>> Attach(
      store::JobStore& store, int64_t now_ms,
      const std::function<void(const std::string&)>& log) = 0;
};

class JobPlanner {
 public:
  virtual ~JobPlanner() = default;

  // Off the strand: opens the source of job `stored` and reads what planning and resuming need.
  // Thread-safe; never touches the store.
  virtual absl::StatusOr<std::unique_ptr<LoadedJob>> Load(const job::JobSpec& spec,
                                                          pipeline::StoredJob stored) = 0;
  // The stages of the jobs it loads: what a stage's progress counts and where it stands
  // (snapshots) come from them.
  virtual const pipeline::StageRegistry& stages() const { return pipeline::BuiltinStages(); }
};

// The real pipeline (pipeline/prepared_job.h); a plan of more than `max_tasks` tasks fails.
std::unique_ptr<JobPlanner> NewPipelinePlanner(int64_t max_tasks);

}  // namespace quantd::scheduler

#endif  // QUANTD_SERVER_SCHEDULER_JOB_PLANNER_H_
