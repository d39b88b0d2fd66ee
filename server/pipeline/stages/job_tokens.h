// The calibrate stage's tokens task: a job's calibration samples, and the held-out samples of a
// job that evaluates, tokenized once on a worker (never while planning: the plan sizes its tasks
// with calibration::CalibrationTokenBound) and stored in the job's tokens file.
//
// Tokenizing reads inputs from outside (the source's tokenizer.json, the data sets), so it runs
// under a thread budget (base/thread_budget.h): running out of its memory, a parser's exception
// or a cancel fails the task with an error naming the file, never the process.
#ifndef QUANTD_SERVER_PIPELINE_STAGES_JOB_TOKENS_H_
#define QUANTD_SERVER_PIPELINE_STAGES_JOB_TOKENS_H_

#include <stdint.h>

#include <atomic>
#include <string>

#include "absl/status/statusor.h"
#include "server/calibration/calibration_tokens.h"
#include "server/job/job_spec.h"

namespace quantd::pipeline {

// The memory one tokens task may hold: the samples, the data set index and the tokenizer.
inline constexpr int64_t kTokenizeMemoryBytes = int64_t{8} << 30;

// What the tokens task reads: "SOURCE/tokenizer.json or the calibration data FILE, ...".
std::string TokenInputs(const job::JobSpec& spec);

// The spec's calibration samples and, when `held_out`, its held-out samples
// (evaluation/held_out_samples.h), with SOURCE/tokenizer.json; ids checked against `vocab`.
// `memory_bytes`: the thread budget (kTokenizeMemoryBytes; tests pass less). Stops with
// Cancelled once `*cancelled` (may be null) is set.
absl::StatusOr<calibration::JobTokens> TokenizeJob(const job::JobSpec& spec, int64_t vocab,
                                                   bool held_out,
                                                   const std::atomic<bool>* cancelled,
                                                   int64_t memory_bytes = kTokenizeMemoryBytes);

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_STAGES_JOB_TOKENS_H_
