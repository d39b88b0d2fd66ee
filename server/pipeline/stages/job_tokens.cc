#include "server/pipeline/stages/job_tokens.h"

#include <exception>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/base/excerpt.h"
#include "server/base/status_macros.h"
#include "server/base/thread_budget.h"
#include "server/calibration/calibration_data.h"
#include "server/evaluation/held_out_samples.h"

namespace quantd::pipeline {
namespace {

absl::StatusOr<calibration::JobTokens> Tokenize(const job::JobSpec& spec, int64_t vocab,
                                                bool held_out) {
  calibration::JobTokens tokens;
  ASSIGN_OR_RETURN(tokens.calibration,
                   calibration::TokenizeCalibration(spec, spec.source, vocab, /*fold_ids=*/false));
  if (held_out) {
    calibration::CalibrationTokenizer tokenizer(spec.source, spec.source_roots);
    ASSIGN_OR_RETURN(tokens.held_out,
                     evaluation::LoadHeldOutSamples(spec.calibration, spec.source_roots,
                                                    spec.evaluate.num_samples, tokenizer, vocab));
  }
  return tokens;
}

}  // namespace

std::string TokenInputs(const job::JobSpec& spec) {
  std::string inputs = absl::StrCat(spec.source, "/tokenizer.json or the calibration data ");
  if (!spec.calibration.dataset.empty()) absl::StrAppend(&inputs, spec.calibration.dataset);
  for (size_t i = 0; i < spec.calibration.datasets.size(); ++i) {
    absl::StrAppend(&inputs, i > 0 || !spec.calibration.dataset.empty() ? ", " : "",
                    spec.calibration.datasets[i].path);
  }
  return inputs;
}

absl::StatusOr<calibration::JobTokens> TokenizeJob(const job::JobSpec& spec, int64_t vocab,
                                                   bool held_out,
                                                   const std::atomic<bool>* cancelled,
                                                   int64_t memory_bytes) {
  const std::string inputs = TokenInputs(spec);
  base::ThreadBudgetLimits limits;
  limits.memory_bytes = memory_bytes;
  limits.cancelled = cancelled;
  absl::StatusOr<calibration::JobTokens> tokens = absl::UnknownError("not tokenized");
  std::exception_ptr error;
  base::ScopedThreadBudget scope(limits);
  try {
    const base::ScopedInput reading(inputs);
    tokens = Tokenize(spec, vocab, held_out);
  } catch (...) {
    error = std::current_exception();  // examined once the budget no longer holds
  }
  const base::ThreadBudgetResult ended = scope.End();
  if (!error && (tokens.ok() || ended.tripped == base::BudgetLimit::kNone)) return tokens;
  // The budget ended: what follows may allocate freely.
  const base::BudgetStop stop = base::ExamineBudgetStop(error, ended);
  const std::string what = error ? stop.what : base::Excerpt(tokens.status().message());
  const std::string& input = ended.failed_input.empty() ? inputs : ended.failed_input;
  switch (stop.tripped) {
    case base::BudgetLimit::kMemory:
      return absl::ResourceExhaustedError(
          absl::StrCat("tokenizing ran out of memory reading ", input, " (a tokens task may hold ",
                       memory_bytes, " bytes)"));
    case base::BudgetLimit::kCancelled:
      return absl::CancelledError("tokenizing stopped: the job is being cancelled or paused");
    case base::BudgetLimit::kDeadline:
    case base::BudgetLimit::kNone:
      break;
  }
  return absl::InvalidArgumentError(absl::StrCat("reading ", input, ": ", what));
}

}  // namespace quantd::pipeline
