// ApplyResumePoint: the store half of resuming a layer-wise stage (calibrate, evaluate), for its
// StageJob::Attach: the resume point its OpenJob found (calibration/layer_checkpoint.h) is
// applied to the store, requeueing the done layer tasks after it, and logged.
#ifndef QUANTD_SERVER_PIPELINE_STAGES_LAYER_RESUME_H_
#define QUANTD_SERVER_PIPELINE_STAGES_LAYER_RESUME_H_

#include <string>

#include "absl/status/status.h"
#include "server/calibration/layer_checkpoint.h"
#include "server/pipeline/stage.h"

namespace quantd::pipeline {

// What ApplyResumePoint stores and logs for one layer-wise stage.
struct ResumeMessages {
  std::string reason;     // stored with the requeued tasks
  std::string requeued;   // logged after "requeued <count> "
  std::string unchanged;  // logged when nothing is requeued; "": nothing
};

// Logs resume.rejected, requeues resume.requeue and logs it (or logs messages.unchanged), and
// lists attach.tasks again after a requeue.
absl::Status ApplyResumePoint(StageJobAttach& attach, const calibration::ResumePoint& resume,
                              const ResumeMessages& messages);

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_STAGES_LAYER_RESUME_H_
