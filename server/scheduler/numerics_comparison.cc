#include "server/scheduler/numerics_comparison.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <string>

#include "server/base/status_macros.h"
#include "server/pipeline/stages/calibrate_stage.h"
#include "server/scheduler/calibration_report.h"

namespace quantd::scheduler {
namespace {

constexpr char kInputKind[] = "input";
constexpr int kJobsPerPage = 500;

// |official - math| / math; 0 when both are 0, +inf when only math is.
double RelativeDifference(double official, double math) {
  if (math == 0) return official == 0 ? 0 : std::numeric_limits<double>::infinity();
  return std::abs(official - math) / math;
}

// The largest relative difference over the modules compared so far.
struct Largest {
  int64_t modules = 0;     // modules compared
  double difference = 0;   // the largest
  std::string module;      // where; the first of equals

  void Add(double d, std::string name) {
    if (modules++ == 0 || d > difference) {
      difference = d;
      module = std::move(name);
    }
  }
};

bool SameDatasets(const std::vector<job::CalibrationDataset>& a,
                  const std::vector<job::CalibrationDataset>& b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end(),
                    [](const job::CalibrationDataset& x, const job::CalibrationDataset& y) {
                      return x.path == y.path && x.samples == y.samples;
                    });
}

}  // namespace

bool SameCalibrationOtherNumerics(const job::JobSpec& a, const job::JobSpec& b) {
  const job::CalibrationSpec& x = a.calibration;
  const job::CalibrationSpec& y = b.calibration;
  return a.source == b.source && x.mode == job::CalibrationMode::kData &&
         y.mode == job::CalibrationMode::kData && x.dataset == y.dataset &&
         SameDatasets(x.datasets, y.datasets) && x.num_samples == y.num_samples &&
         x.seq_len == y.seq_len && x.min_seq_len == y.min_seq_len && x.seed == y.seed &&
         x.add_bos == y.add_bos && x.calibrate_all_experts == y.calibrate_all_experts &&
         x.numerics != y.numerics;
}

void AddNumericsComparison(const std::vector<store::AmaxRow>& amax,
                           job::CalibrationNumerics numerics, int64_t peer_job,
                           const std::vector<store::AmaxRow>& peer_amax, v1::JobReport* report) {
  std::map<std::string, double> peer;
  for (const store::AmaxRow& row : peer_amax) {
    if (row.kind == kInputKind) peer.emplace(row.module, row.value);
  }
  const bool official = numerics == job::CalibrationNumerics::kOfficial;
  Largest job;
  std::map<int64_t, Largest> layers;
  for (const store::AmaxRow& row : amax) {
    if (row.kind != kInputKind) continue;
    const auto other = peer.find(row.module);
    if (other == peer.end()) continue;
    const double d = official ? RelativeDifference(row.value, other->second)
                              : RelativeDifference(other->second, row.value);
    job.Add(d, row.module);
    if (const auto layer = LayerOfModule(row.module); layer.has_value()) {
      layers[layer->first].Add(d, std::string(layer->second));
    }
  }
  report->set_numerics_peer_job(peer_job);
  report->set_numerics_peer(job::CalibrationNumericsName(
      official ? job::CalibrationNumerics::kMath : job::CalibrationNumerics::kOfficial));
  report->set_numerics_compared_modules(job.modules);
  report->set_numerics_max_rel_diff(job.difference);
  report->set_numerics_max_rel_diff_module(job.module);
  for (v1::LayerReport& out : *report->mutable_layers()) {
    const auto layer = layers.find(out.layer());
    if (layer == layers.end()) continue;
    out.set_numerics_compared(true);
    out.set_numerics_compared_modules(layer->second.modules);
    out.set_numerics_max_rel_diff(layer->second.difference);
    out.set_numerics_max_rel_diff_module(layer->second.module);
  }
}

absl::Status AddNumericsComparisonFromStore(store::JobStore& store, int64_t job_id,
                                            const job::JobSpec& spec,
                                            const std::vector<store::AmaxRow>& amax,
                                            const std::vector<store::TaskRow>& tasks,
                                            v1::JobReport* report) {
  if (spec.calibration.mode != job::CalibrationMode::kData) return absl::OkStatus();
  const std::optional<int64_t> layers = pipeline::CalibratedLayers(tasks);
  if (!layers.has_value()) return absl::OkStatus();
  std::vector<int64_t> candidates;  // ascending id
  for (int64_t after = 0;;) {
    ASSIGN_OR_RETURN(std::vector<store::JobRow> jobs,
                     store.ListJobs(std::nullopt, after, kJobsPerPage));
    if (jobs.empty()) break;
    for (const store::JobRow& row : jobs) {
      after = row.id;
      if (row.id == job_id) continue;
      absl::StatusOr<job::JobSpec> other = job::ParseStoredJobSpec(row.spec_json, "stored spec");
      if (other.ok() && SameCalibrationOtherNumerics(spec, *other)) candidates.push_back(row.id);
    }
  }
  for (auto id = candidates.rbegin(); id != candidates.rend(); ++id) {
    ASSIGN_OR_RETURN(std::vector<store::StageProgress> stages, store.Progress(*id));
    if (!pipeline::CalibrationSucceeded(stages)) continue;
    ASSIGN_OR_RETURN(std::vector<store::TaskRow> peer_tasks, store.ListTasks(*id));
    if (pipeline::CalibratedLayers(peer_tasks) != layers) continue;
    ASSIGN_OR_RETURN(std::vector<store::AmaxRow> peer_amax, store.ListAmax(*id));
    AddNumericsComparison(amax, spec.calibration.numerics, *id, peer_amax, report);
    return absl::OkStatus();
  }
  return absl::OkStatus();
}

}  // namespace quantd::scheduler
