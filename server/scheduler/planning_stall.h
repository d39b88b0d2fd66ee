// The QUANTD_TEST_PLANNING_STALL test hook (integration tests of planning that does not end):
//   QUANTD_TEST_PLANNING_STALL="<n>:busy|stuck"
// makes the n-th job planning (JobPlanner::Load) of the process, counted from 1, never finish on
// its own: `busy` allocates in a loop and polls its budget (a parser working through a huge
// input: the planning budget stops it at its deadline, its cancel or its memory), `stuck` sleeps
// (a parser wedged in a loop that polls nothing: only abandoning its thread helps). Unset in
// normal use; a malformed value is an error.
#ifndef QUANTD_SERVER_SCHEDULER_PLANNING_STALL_H_
#define QUANTD_SERVER_SCHEDULER_PLANNING_STALL_H_

#include <stdint.h>

#include <memory>
#include <optional>

#include "absl/status/statusor.h"
#include "server/scheduler/job_planner.h"

namespace quantd::scheduler {

struct PlanningStall {
  int64_t n = 0;       // the n-th Load, from 1
  bool stuck = false;  // sleeps without allocating (else allocates in a loop)
};

// nullopt for nullptr or ""; InvalidArgument otherwise.
absl::StatusOr<std::optional<PlanningStall>> ParsePlanningStall(const char* value);

// `planner`, whose stall.n-th Load stalls as `stall` says.
std::shared_ptr<JobPlanner> StallingPlanner(std::shared_ptr<JobPlanner> planner,
                                            PlanningStall stall);

}  // namespace quantd::scheduler

#endif  // QUANTD_SERVER_SCHEDULER_PLANNING_STALL_H_
