#include "server/scheduler/job_proto.h"

#include <nlohmann/json.hpp>
#include <optional>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/types/optional.h"

namespace quantd::scheduler {
namespace {

// The absl::Status payload key that carries the reason between the scheduler and the service.
constexpr char kReasonPayload[] = "quantd-reason";

// Adds `key: value` unless the value is the proto default (the JSON spec's default applies).
void PutString(nlohmann::json& j, const char* key, const std::string& value) {
  if (!value.empty()) j[key] = value;
}
void PutList(nlohmann::json& j, const char* key,
             const google::protobuf::RepeatedPtrField<std::string>& values) {
  if (!values.empty()) j[key] = std::vector<std::string>(values.begin(), values.end());
}

}  // namespace

std::string JobSpecProtoToJson(const v1::JobSpec& spec) {
  nlohmann::json j = nlohmann::json::object();
  PutString(j, "source", spec.source());
  PutString(j, "output", spec.output());
  PutString(j, "recipe", spec.recipe());
  PutList(j, "include", spec.include());
  PutList(j, "exclude", spec.exclude());
  PutString(j, "weight_format", spec.weight_format());
  PutString(j, "expert_cast", spec.expert_cast());
  PutString(j, "export_format", spec.export_format());
  PutString(j, "kv_cache", spec.kv_cache());
  PutString(j, "materialize_bf16", spec.materialize_bf16());
  if (spec.has_calibration()) {
    const v1::CalibrationSpec& c = spec.calibration();
    nlohmann::json cal = nlohmann::json::object();
    PutString(cal, "amax_file", c.amax_file());
    PutString(cal, "dataset", c.dataset());
    if (!c.datasets().empty()) {
      nlohmann::json datasets = nlohmann::json::array();
      for (const v1::CalibrationDataset& d : c.datasets()) {
        datasets.push_back({{"path", d.path()}, {"samples", d.samples()}});
      }
      cal["datasets"] = std::move(datasets);
    }
    if (c.num_samples() != 0) cal["num_samples"] = c.num_samples();
    if (c.seq_len() != 0) cal["seq_len"] = c.seq_len();
    if (c.has_min_seq_len()) cal["min_seq_len"] = c.min_seq_len();
    if (c.seed() != 0) cal["seed"] = c.seed();
    if (c.has_add_bos()) cal["add_bos"] = c.add_bos();
    if (c.calibrate_all_experts()) cal["calibrate_all_experts"] = true;
    PutString(cal, "mode", c.mode());
    PutString(cal, "w2_input", c.w2_input());
    PutString(cal, "expert_amax", c.expert_amax());
    PutString(cal, "uncalibrated", c.uncalibrated());
    PutString(cal, "numerics", c.numerics());
    PutString(cal, "amax_out", c.amax_out());
    if (c.has_checkpoint_seconds()) cal["checkpoint_seconds"] = c.checkpoint_seconds();
    j["calibration"] = std::move(cal);
  }
  if (spec.has_evaluate()) {
    const v1::EvaluateSpec& e = spec.evaluate();
    nlohmann::json ev = nlohmann::json::object();
    if (e.has_enabled()) ev["enabled"] = e.enabled();
    if (e.num_samples() != 0) ev["num_samples"] = e.num_samples();
    if (e.has_gate()) {
      const v1::QualityGate& g = e.gate();
      nlohmann::json gate = nlohmann::json::object();
      if (g.has_max_mean_kl()) gate["max_mean_kl"] = g.max_mean_kl();
      if (g.has_min_top1_agreement()) gate["min_top1_agreement"] = g.min_top1_agreement();
      if (g.has_max_ppl_ratio()) gate["max_ppl_ratio"] = g.max_ppl_ratio();
      ev["gate"] = std::move(gate);
    }
    j["evaluate"] = std::move(ev);
  }
  if (spec.devices_size() == 1 && spec.devices(0) == "auto") {
    j["devices"] = "auto";
  } else {
    PutList(j, "devices", spec.devices());
  }
  if (spec.host_memory_bytes() != 0) j["host_memory_bytes"] = spec.host_memory_bytes();
  if (spec.overwrite()) j["overwrite"] = true;
  return j.dump();
}

absl::StatusOr<job::JobSpec> JobSpecFromProto(const v1::JobSpec& spec) {
  return job::ParseJobSpec(JobSpecProtoToJson(spec), "SubmitJobRequest.spec");
}

v1::JobSpec JobSpecToProto(const job::JobSpec& spec) {
  v1::JobSpec out;
  out.set_source(spec.source);
  out.set_output(spec.output);
  out.set_recipe(job::RecipeKindName(spec.recipe));
  for (const std::string& g : spec.include) out.add_include(g);
  for (const std::string& g : spec.exclude) out.add_exclude(g);
  out.set_weight_format(job::WeightFormatName(spec.weight_format));
  out.set_expert_cast(job::ExpertCastName(spec.expert_cast));
  out.set_export_format(job::ExportFormatName(spec.export_format));
  out.set_kv_cache(job::KvCacheName(spec.kv_cache));
  out.set_materialize_bf16(spec.materialize_bf16);
  v1::CalibrationSpec* c = out.mutable_calibration();
  c->set_amax_file(spec.calibration.amax_file);
  c->set_dataset(spec.calibration.dataset);
  c->set_num_samples(spec.calibration.num_samples);
  c->set_seq_len(spec.calibration.seq_len);
  c->set_calibrate_all_experts(spec.calibration.calibrate_all_experts);
  for (const job::CalibrationDataset& d : spec.calibration.datasets) {
    v1::CalibrationDataset* dataset = c->add_datasets();
    dataset->set_path(d.path);
    dataset->set_samples(d.samples);
  }
  c->set_min_seq_len(spec.calibration.min_seq_len);
  c->set_seed(spec.calibration.seed);
  c->set_add_bos(spec.calibration.add_bos);
  c->set_mode(job::CalibrationModeName(spec.calibration.mode));
  c->set_w2_input(job::W2InputName(spec.calibration.w2_input));
  c->set_expert_amax(job::ExpertAmaxName(spec.calibration.expert_amax));
  c->set_uncalibrated(job::UncalibratedFillName(spec.calibration.uncalibrated));
  c->set_numerics(job::CalibrationNumericsName(spec.calibration.numerics));
  c->set_amax_out(spec.calibration.amax_out);
  c->set_checkpoint_seconds(spec.calibration.checkpoint_seconds);
  v1::EvaluateSpec* e = out.mutable_evaluate();
  if (spec.evaluate.enabled.has_value()) e->set_enabled(*spec.evaluate.enabled);
  e->set_num_samples(spec.evaluate.num_samples);
  const job::QualityGate& gate = spec.evaluate.gate;
  v1::QualityGate* g = e->mutable_gate();
  if (gate.max_mean_kl) g->set_max_mean_kl(*gate.max_mean_kl);
  if (gate.min_top1_agreement) g->set_min_top1_agreement(*gate.min_top1_agreement);
  if (gate.max_ppl_ratio) g->set_max_ppl_ratio(*gate.max_ppl_ratio);
  for (const std::string& d : spec.devices) out.add_devices(d);
  out.set_host_memory_bytes(spec.host_memory_bytes);
  out.set_overwrite(spec.overwrite);
  return out;
}

v1::JobState JobStateToProto(store::JobState state) {
  switch (state) {
    case store::JobState::kPending:
      return v1::PENDING;
    case store::JobState::kRunning:
      return v1::RUNNING;
    case store::JobState::kPaused:
      return v1::PAUSED;
    case store::JobState::kSucceeded:
      return v1::SUCCEEDED;
    case store::JobState::kFailed:
      return v1::FAILED;
    case store::JobState::kCancelled:
      return v1::CANCELLED;
  }
  return v1::JOB_STATE_UNSPECIFIED;
}

store::JobState JobStateFromProto(v1::JobState state) {
  switch (state) {
    case v1::RUNNING:
      return store::JobState::kRunning;
    case v1::PAUSED:
      return store::JobState::kPaused;
    case v1::SUCCEEDED:
      return store::JobState::kSucceeded;
    case v1::FAILED:
      return store::JobState::kFailed;
    case v1::CANCELLED:
      return store::JobState::kCancelled;
    default:
      return store::JobState::kPending;
  }
}

v1::StageProgress::State StageStateToProto(store::StageState state) {
  switch (state) {
    case store::StageState::kPending:
      return v1::StageProgress::PENDING;
    case store::StageState::kRunning:
      return v1::StageProgress::RUNNING;
    case store::StageState::kSucceeded:
      return v1::StageProgress::SUCCEEDED;
    case store::StageState::kFailed:
      return v1::StageProgress::FAILED;
  }
  return v1::StageProgress::STATE_UNSPECIFIED;
}

google::protobuf::Timestamp TimestampFromMs(int64_t unix_ms) {
  google::protobuf::Timestamp t;
  t.set_seconds(unix_ms / 1000);
  t.set_nanos(static_cast<int32_t>(unix_ms % 1000) * 1'000'000);
  return t;
}

absl::Status WithReason(absl::Status status, const std::string& reason) {
  status.SetPayload(kReasonPayload, absl::Cord(reason));
  return status;
}

std::string ReasonOf(const absl::Status& status) {
  const auto payload = status.GetPayload(kReasonPayload);  // absl::optional here, not std::
  return payload.has_value() ? std::string(*payload) : std::string();
}

}  // namespace quantd::scheduler
