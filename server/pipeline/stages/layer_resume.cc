#include "server/pipeline/stages/layer_resume.h"

#include "absl/strings/str_cat.h"
#include "server/base/status_macros.h"

namespace quantd::pipeline {

absl::Status ApplyResumePoint(StageJobAttach& attach, const calibration::ResumePoint& resume,
                              const ResumeMessages& messages) {
  const auto log = [&attach](const std::string& line) {
    if (attach.log != nullptr && *attach.log) (*attach.log)(line);
  };
  for (const std::string& line : resume.rejected) log(line);
  if (resume.requeue.empty()) {
    if (!messages.unchanged.empty()) log(messages.unchanged);
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(int requeued, attach.store->RequeueDoneTasks(attach.job_id, resume.requeue,
                                                                messages.reason, attach.now_ms));
  log(absl::StrCat("requeued ", requeued, " ", messages.requeued));
  ASSIGN_OR_RETURN(*attach.tasks, attach.store->ListTasks(attach.job_id));
  return absl::OkStatus();
}

}  // namespace quantd::pipeline
