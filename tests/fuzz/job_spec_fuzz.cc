// libFuzzer target: job::ParseJobSpec (the JSON job spec of `quantd run`: protobuf's JSON mapping
// of quantd.proto's JobSpec, then ValidateJobSpec, the validation of SubmitJob) on arbitrary text.
// Besides the sanitizers' checks: every error is InvalidArgument prefixed with the origin, and
// every accepted spec survives JobSpecToJson -> ParseStoredJobSpec unchanged (the stored form is
// a fixed point).
#include <stddef.h>
#include <stdint.h>

#include <string>

#include "server/job/job_spec.h"

namespace {

constexpr char kOrigin[] = "fuzz.json";

// Aborts (a finding for the fuzzer) when an invariant breaks.
void Check(bool condition) {
  if (!condition) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using quantd::job::JobSpecToJson;
  using quantd::job::ParseJobSpec;
  using quantd::job::ParseStoredJobSpec;
  const std::string text(reinterpret_cast<const char*>(data), size);
  const auto spec = ParseJobSpec(text, kOrigin);
  if (!spec.ok()) {
    Check(spec.status().code() == absl::StatusCode::kInvalidArgument);
    Check(spec.status().message().rfind(std::string(kOrigin) + ": ", 0) == 0);
    return 0;
  }
  const std::string canonical = JobSpecToJson(*spec);
  const auto again = ParseStoredJobSpec(canonical, kOrigin);
  Check(again.ok());
  Check(JobSpecToJson(*again) == canonical);
  return 0;
}
