#include "server/pipeline/stages/evaluate_stage.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/base/status_macros.h"
#include "server/calibration/calibrate_layer.h"
#include "server/calibration/job_calibration.h"
#include "server/calibration/layer_checkpoint.h"
#include "server/evaluation/evaluate_head.h"
#include "server/evaluation/evaluate_layer.h"
#include "server/evaluation/evaluate_task.h"
#include "server/evaluation/held_out_samples.h"
#include "server/evaluation/job_evaluation.h"
#include "server/evaluation/quality_gate.h"
#include "server/evaluation/run_evaluation.h"
#include "server/model/v4_config.h"
#include "server/pipeline/stages/calibrate_stage.h"
#include "server/pipeline/stages/export_stage.h"
#include "server/pipeline/stages/layer_task_memory.h"
#include "server/pipeline/stages/verify_stage.h"

namespace quantd::pipeline {

using job::CalibrationNumericsName;
using job::JobSpec;

namespace {

using evaluation::EvaluateTask;

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// `vocab`: the source model's vocab_size.
absl::StatusOr<std::vector<std::vector<int32_t>>> HeldOutSamples(const JobSpec& spec, int64_t vocab) {
  calibration::CalibrationTokenizer tokenizer(spec.source, spec.source_roots);
  return evaluation::LoadHeldOutSamples(spec.calibration, spec.source_roots,
                                        spec.evaluate.num_samples, tokenizer, vocab);
}

int64_t Tokens(const std::vector<std::vector<int32_t>>& samples) {
  int64_t tokens = 0;
  for (const std::vector<int32_t>& s : samples) tokens += static_cast<int64_t>(s.size());
  return tokens;
}

absl::StatusOr<evaluation::JobEvaluation*> JobState(const StageContext& ctx) {
  if (ctx.calibration == nullptr || ctx.evaluation == nullptr) {
    return absl::InternalError("an evaluate task ran without the job's evaluation state");
  }
  return ctx.evaluation;
}

evaluation::EvaluationHooks Hooks(const StageContext& ctx) {
  evaluation::EvaluationHooks hooks;
  hooks.on_batch = [&ctx](int64_t tokens) {
    if (ctx.add_progress) ctx.add_progress(static_cast<uint64_t>(tokens));
  };
  hooks.alive = [&ctx] {
    if (ctx.add_progress) ctx.add_progress(0);
  };
  hooks.cancelled = ctx.cancelled;
  return hooks;
}

// Layer 0's input: the held-out samples embedded by both models, the same the plan found.
absl::StatusOr<evaluation::EvaluationBatches> EmbeddedSamples(const EvaluateTask& task,
                                                              const model::V4Checkpoint& source,
                                                              const model::V4Checkpoint& quantized,
                                                              const StageContext& ctx) {
  ASSIGN_OR_RETURN(const std::vector<std::vector<int32_t>> samples, HeldOutSamples(*ctx.spec, source.config.vocab_size));
  const int64_t n = static_cast<int64_t>(samples.size());
  if (n != task.samples || Tokens(samples) != task.tokens) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the calibration data now gives ", n, " held-out samples of ", Tokens(samples),
        " tokens, the job was planned with ", task.samples, " of ", task.tokens,
        ": the data set files changed"));
  }
  return evaluation::EmbedHeldOut(source, quantized, samples, calibration::kDefaultBatchBytes);
}

absl::StatusOr<TaskOutput> RunLayer(const EvaluateTask& task, compute::Device& device,
                                    const StageContext& ctx) {
  const auto start = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(evaluation::JobEvaluation * job, JobState(ctx));
  ASSIGN_OR_RETURN(const model::V4Checkpoint* source, ctx.calibration->Checkpoint());
  ASSIGN_OR_RETURN(const model::V4Checkpoint* quantized, job->Quantized());
  evaluation::EvaluationBatches input;
  if (task.layer == 0) {
    ASSIGN_OR_RETURN(input, EmbeddedSamples(task, *source, *quantized, ctx));
  } else {
    std::optional<evaluation::EvaluationBatches> previous = job->Output(task.layer - 1);
    if (!previous.has_value()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "evaluate ", task.Name(), ": the activations of layer ", task.layer - 1,
          " are not in this process"));
    }
    input = *std::move(previous);
  }
  ASSIGN_OR_RETURN(evaluation::LayerEvaluation step,
                   evaluation::EvaluateLayer(*source, *quantized, task.layer, input, device,
                                             evaluation::ForwardNumerics(ctx.spec->calibration),
                                             Hooks(ctx)));
  // A boundary's outputs go to disk as well (JobEvaluation, calibration/layer_checkpoint.h); the
  // task's output is then the checkpoint's manifest, committed with its completion.
  ASSIGN_OR_RETURN(const std::optional<calibration::CheckpointFile> file,
                   job->PutOutput(task.layer, std::move(step.source), std::move(step.quantized),
                                  [&ctx] {
                                    if (ctx.add_progress) ctx.add_progress(0);
                                  }));
  const evaluation::LayerQuality& q = step.quality;
  TaskOutput out;
  if (file.has_value()) {
    out.path = file->path;
    out.bytes = file->bytes;
    out.sha256 = file->sha256;
  }
  out.evaluation_layer =
      store::EvaluationLayerRow{task.layer,           q.free_running.signal,
                                q.free_running.noise, q.teacher_forced.signal,
                                q.teacher_forced.noise, SecondsSince(start)};
  out.evaluated_tokens = input.tokens();
  out.summary = absl::StrFormat("load %.1f s, decode %.1f s, forward %.1f s", q.load_seconds,
                                q.decode_seconds, q.forward_seconds);
  return out;
}

absl::StatusOr<TaskOutput> RunHead(const EvaluateTask& task, compute::Device& device,
                                   const StageContext& ctx) {
  const auto start = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(evaluation::JobEvaluation * job, JobState(ctx));
  ASSIGN_OR_RETURN(const model::V4Checkpoint* source, ctx.calibration->Checkpoint());
  ASSIGN_OR_RETURN(const model::V4Checkpoint* quantized, job->Quantized());
  const std::map<int64_t, store::EvaluationLayerRow> layers = job->Layers();
  std::optional<evaluation::EvaluationBatches> input = job->Output(task.layers - 1);
  if (!input.has_value() || static_cast<int64_t>(layers.size()) != task.layers) {
    return absl::FailedPreconditionError(
        "evaluate head: the figures and activations of the decoder layers are not in this "
        "process");
  }
  evaluation::QualityReport report;
  report.numerics = CalibrationNumericsName(ctx.spec->calibration.numerics);
  report.samples = task.samples;
  report.tokens = input->tokens();
  double seconds = 0;
  for (const auto& [layer, row] : layers) {
    evaluation::LayerQuality q;
    q.layer = layer;
    q.free_running = {row.free_running_signal, row.free_running_noise};
    q.teacher_forced = {row.teacher_forced_signal, row.teacher_forced_noise};
    report.layers.push_back(q);
    seconds += row.seconds;
  }
  ASSIGN_OR_RETURN(report.next_token,
                   evaluation::EvaluateHead(*source, *quantized, *input, device,
                                            evaluation::ForwardNumerics(ctx.spec->calibration),
                                            Hooks(ctx)));
  const absl::Status gate = evaluation::CheckQualityGate(ctx.spec->evaluate.gate, report);
  const evaluation::NextTokenQuality& n = report.next_token;
  store::EvaluationRow row;
  row.samples = report.samples;
  row.tokens = report.tokens;
  row.numerics = report.numerics;
  row.positions = n.positions;
  row.predicted = n.predicted;
  row.mean_kl = n.mean_kl;
  row.p99_kl = n.p99_kl;
  row.max_kl = n.max_kl;
  row.top1_agreement = n.top1_agreement;
  row.source_ppl = n.source_ppl;
  row.quantized_ppl = n.quantized_ppl;
  row.ppl_ratio = n.ppl_ratio;
  row.gate_passed = gate.ok();
  row.gate_message = std::string(gate.message());
  row.seconds = seconds + SecondsSince(start);
  TaskOutput out;
  out.evaluation = std::move(row);
  out.evaluated_tokens = report.tokens;
  return out;
}

absl::StatusOr<TaskOutput> RunGate(const StageContext& ctx) {
  ASSIGN_OR_RETURN(evaluation::JobEvaluation * job, JobState(ctx));
  const std::optional<store::EvaluationRow> figures = job->Figures();
  if (!figures.has_value()) {
    return absl::FailedPreconditionError(
        "evaluate gate: the head's figures are not in this process");
  }
  if (!figures->gate_passed) {
    return WithJobReason(absl::FailedPreconditionError(figures->gate_message),
                         kQualityGateReason);
  }
  return TaskOutput();
}

}  // namespace

bool NeedsEvaluation(const JobSpec& spec) { return NeedsCalibration(spec) && spec.evaluate.on(); }

absl::StatusOr<std::vector<store::TaskPlan>> EvaluateStage::Plan(const PlanInput& input) const {
  const JobSpec& spec = *input.spec;
  if (spec.evaluate.enabled == true && !NeedsCalibration(spec)) {
    return absl::InvalidArgumentError(
        "evaluate.enabled: the evaluation runs on held-out samples of the calibration data, and "
        "this job does not calibrate on data (weight_format nvfp4, calibration.mode data, a "
        "data set and no calibration.amax_file)");
  }
  std::vector<store::TaskPlan> tasks;
  if (!NeedsEvaluation(spec)) return tasks;
  ASSIGN_OR_RETURN(const CalibrationLayout layout, PlanCalibrationLayout(input));
  ASSIGN_OR_RETURN(const model::V4Config config,
                   model::ParseV4Config(input.source->config(), spec.source + "/config.json"));
  ASSIGN_OR_RETURN(const std::vector<std::vector<int32_t>> samples,
                   HeldOutSamples(spec, config.vocab_size));
  EvaluateTask t;
  t.layers = layout.layers;
  t.samples = static_cast<int64_t>(samples.size());
  t.tokens = Tokens(samples);
  const std::string kind(kKind);
  std::vector<store::TaskRef> after = {
      {std::string(ExportStage::kKind), std::string(ExportStage::kKind)}};
  for (const OutputShard& shard : input.output_shards) {
    after.push_back({std::string(VerifyStage::kKind), shard.task.shard});
  }
  // The batches EmbedHeldOut will form, for the tasks' memory.
  std::vector<int64_t> lengths;
  for (const std::vector<int32_t>& s : samples) lengths.push_back(static_cast<int64_t>(s.size()));
  ASSIGN_OR_RETURN(const std::vector<std::vector<size_t>> batches,
                   calibration::PlanBatches(config, lengths, calibration::kDefaultBatchBytes));
  int64_t batch_bytes = 0, seq_len = 0;
  for (const std::vector<size_t>& b : batches) {
    const int64_t n = lengths[b.front()];
    seq_len = std::max(seq_len, n);
    batch_bytes = std::max(batch_bytes, calibration::EstimateBatchBytes(
                                            config, static_cast<int64_t>(b.size()), n));
  }
  t.kind = EvaluateTask::Kind::kLayer;
  for (int64_t l = 0; l < layout.layers; ++l) {
    t.layer = l;
    compute::DeviceRequirement memory;
    memory.memory_bytes =
        EvaluateLayerTaskBytes(config, *input.inventory, l, t.tokens, batch_bytes);
    tasks.push_back({t.Name(), ToJson(t), t.tokens,
                     absl::StrCat("layer ", l + 1, " of ", layout.layers), memory,
                     std::move(after)});
    after = {{kind, t.Name()}};
  }
  t.layer = 0;
  t.kind = EvaluateTask::Kind::kHead;
  compute::DeviceRequirement head_memory;
  head_memory.memory_bytes = EvaluateHeadTaskBytes(config, t.tokens, seq_len);
  tasks.push_back(
      {t.Name(), ToJson(t), t.tokens, "head: next-token figures", head_memory, after});
  const store::TaskRef head{kind, t.Name()};
  t.kind = EvaluateTask::Kind::kGate;
  tasks.push_back({t.Name(), ToJson(t), 0, "quality gate", {}, {head}});
  return tasks;
}

absl::StatusOr<uint64_t> EvaluateStage::CheckpointBytes(
    const PlanInput& input, const std::vector<store::TaskPlan>& tasks) const {
  if (tasks.empty()) return 0;
  ASSIGN_OR_RETURN(const EvaluateTask task,
                   evaluation::ParseEvaluateTask(tasks.front().payload_json));
  return LayerCheckpointBytes(input, task.tokens, /*models=*/2);
}

absl::StatusOr<TaskOutput> EvaluateStage::Run(const store::TaskRow& row, compute::Device& device,
                                              const StageContext& ctx) const {
  ASSIGN_OR_RETURN(const EvaluateTask task, evaluation::ParseEvaluateTask(row.payload_json));
  switch (task.kind) {
    case EvaluateTask::Kind::kLayer: return RunLayer(task, device, ctx);
    case EvaluateTask::Kind::kHead: return RunHead(task, device, ctx);
    case EvaluateTask::Kind::kGate: return RunGate(ctx);
  }
  return absl::InternalError("unknown evaluate task");
}

absl::Status EvaluateStage::Record(store::TaskRecord& txn, const store::TaskRow& /*task*/,
                                   const TaskOutput& output) const {
  if (output.evaluation_layer.has_value()) {
    RETURN_IF_ERROR(txn.PutEvaluationLayer(*output.evaluation_layer));
  }
  if (output.evaluation.has_value()) RETURN_IF_ERROR(txn.PutEvaluation(*output.evaluation));
  return absl::OkStatus();
}

}  // namespace quantd::pipeline
