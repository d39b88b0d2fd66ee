// The directory handles a stage writes beneath (StageContext::output_dir and friends), for stage
// tests that build a StageContext themselves instead of going through PreparedJob.
#ifndef QUANTD_TESTS_UNIT_STAGE_DIRS_H_
#define QUANTD_TESTS_UNIT_STAGE_DIRS_H_

#include "server/pipeline/stage.h"

namespace quantd::testing_util {

// Creates ctx->spec's output and materialize_bf16 directories when absent, opens them (and the
// source) as checkpoint::DirHandles that stay open until the test binary ends, and sets them in
// *ctx.
void OpenStageDirs(pipeline::StageContext* ctx);

}  // namespace quantd::testing_util

#endif  // QUANTD_TESTS_UNIT_STAGE_DIRS_H_
