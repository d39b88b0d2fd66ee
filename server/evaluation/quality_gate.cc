#include "server/evaluation/quality_gate.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace quantd::evaluation {

std::vector<std::string> BrokenBounds(const job::QualityGate& gate, const QualityReport& report) {
  const NextTokenQuality& n = report.next_token;
  std::vector<std::string> broken;
  if (gate.max_mean_kl && !(n.mean_kl <= *gate.max_mean_kl)) {
    broken.push_back(
        absl::StrFormat("mean_kl %.6g > max_mean_kl %g", n.mean_kl, *gate.max_mean_kl));
  }
  if (gate.min_top1_agreement && !(n.top1_agreement >= *gate.min_top1_agreement)) {
    broken.push_back(absl::StrFormat("top1_agreement %.6g < min_top1_agreement %g",
                                     n.top1_agreement, *gate.min_top1_agreement));
  }
  if (gate.max_ppl_ratio && !(n.ppl_ratio <= *gate.max_ppl_ratio)) {
    broken.push_back(
        absl::StrFormat("ppl_ratio %.6g > max_ppl_ratio %g", n.ppl_ratio, *gate.max_ppl_ratio));
  }
  return broken;
}

absl::Status CheckQualityGate(const job::QualityGate& gate, const QualityReport& report) {
  const std::vector<std::string> broken = BrokenBounds(gate, report);
  if (broken.empty()) return absl::OkStatus();
  std::string message = absl::StrCat("quality gate: ", absl::StrJoin(broken, "; "));
  if (const int64_t worst = WorstLayer(report); worst >= 0) {
    for (const LayerQuality& l : report.layers) {
      if (l.layer == worst) {
        absl::StrAppend(&message,
                        absl::StrFormat("; lowest teacher-forced SQNR at layer %d (%.2f dB)", worst,
                                        l.teacher_forced.Db()));
      }
    }
  }
  return absl::FailedPreconditionError(message);
}

}  // namespace quantd::evaluation
