#include "server/scheduler/planning_stall.h"

#include <unistd.h>

#include <atomic>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "server/base/thread_budget.h"

namespace quantd::scheduler {
namespace {

class Stalling final : public JobPlanner {
 public:
  Stalling(std::shared_ptr<JobPlanner> planner, PlanningStall stall)
      : planner_(std::move(planner)), stall_(stall) {}

  absl::StatusOr<std::unique_ptr<LoadedJob>> Load(const job::JobSpec& spec,
                                                  pipeline::StoredJob stored) override {
    if (++loads_ == stall_.n) {
      for (std::vector<std::string> held;; held.clear()) {
        if (stall_.stuck) {
          sleep(1);
          continue;
        }
        base::ThreadBudgetCheck();  // a parser that polls its budget
        for (int i = 0; i < 1000; ++i) held.push_back(std::string(64, 'x'));
        usleep(1000);
      }
    }
    return planner_->Load(spec, std::move(stored));
  }
  const pipeline::StageRegistry& stages() const override { return planner_->stages(); }

 private:
  const std::shared_ptr<JobPlanner> planner_;
  const PlanningStall stall_;
  std::atomic<int64_t> loads_{0};
};

}  // namespace

absl::StatusOr<std::optional<PlanningStall>> ParsePlanningStall(const char* value) {
  if (value == nullptr || *value == '\0') return std::optional<PlanningStall>();
  const std::vector<std::string> parts = absl::StrSplit(value, ':');
  PlanningStall stall;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &stall.n) || stall.n < 1 ||
      (parts[1] != "busy" && parts[1] != "stuck")) {
    return absl::InvalidArgumentError(absl::StrCat(
        "QUANTD_TEST_PLANNING_STALL=", value, ": expected <n>:busy or <n>:stuck with n >= 1"));
  }
  stall.stuck = parts[1] == "stuck";
  return std::optional<PlanningStall>(stall);
}

std::shared_ptr<JobPlanner> StallingPlanner(std::shared_ptr<JobPlanner> planner,
                                            PlanningStall stall) {
  return std::make_shared<Stalling>(std::move(planner), stall);
}

}  // namespace quantd::scheduler
