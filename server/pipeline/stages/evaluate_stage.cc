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
#include "server/pipeline/stages/layer_resume.h"
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

// At most how many held-out samples the job evaluates, and their tokens: the samples asked
// (evaluation/held_out_samples.h), each at most calibration.seq_len tokens.
calibration::TokenBound HeldOutBound(const JobSpec& spec) {
  return calibration::BoundOf(evaluation::HeldOutSamplesAsked(spec.evaluate.num_samples),
                              spec.calibration.seq_len);
}

// The stage's state for one evaluating job (StageJob): its evaluation::JobEvaluation and where it
// resumes.
class EvaluateJob final : public StageJob {
 public:
  absl::Status Attach(StageJobAttach& attach) override;
  void TaskDone(const store::TaskRow& task, const TaskOutput& output) override;

  std::unique_ptr<evaluation::JobEvaluation> evaluation;  // thread-safe
  // Where the stage resumes, found by OpenJob on a later start; applied by Attach.
  calibration::ResumePoint resume;
};

// What an evaluate task produced besides its file: a layer's figures (layer tasks) or the job's
// (the head), recorded with its completion.
struct EvaluateResult final : StageResult {
  std::optional<store::EvaluationLayerRow> layer;
  std::optional<store::EvaluationRow> figures;
};

const EvaluateResult& ResultOf(const TaskOutput& output) {
  static const EvaluateResult kNone;
  const auto* result = static_cast<const EvaluateResult*>(output.result.get());
  return result != nullptr ? *result : kNone;
}

// The layer of `t` when it is an evaluate layer task (whose output is a layer checkpoint).
std::optional<int64_t> EvaluateLayerOf(const store::TaskRow& t) {
  const std::optional<EvaluateTask> task = evaluation::EvaluateTaskOf(t);
  if (!task.has_value() || task->kind != EvaluateTask::Kind::kLayer) return std::nullopt;
  return task->layer;
}

absl::Status EvaluateJob::Attach(StageJobAttach& attach) {
  // A task up to the resume layer requeued meanwhile (an output it depends on is rebuilt): the
  // stage runs again from there, its requeue took the later tasks with it.
  for (const store::TaskRow& t : *attach.tasks) {
    const std::optional<int64_t> layer = EvaluateLayerOf(t);
    if (layer.has_value() && *layer <= resume.layer && t.state != store::TaskState::kDone) {
      calibration::ResumePoint rebuilt;
      rebuilt.rejected = resume.rejected;
      return ApplyResumePoint(
          attach, rebuilt,
          ResumeMessages{"", "", "evaluation resumes from layer 0: the outputs it evaluates are "
                                 "rebuilt"});
    }
  }
  const std::string from =
      resume.layer < 0
          ? std::string("from layer 0: no usable layer checkpoint (the activations between "
                        "layers were held by the process that stopped)")
          : absl::StrCat("after layer ", resume.layer, ": the checkpointed outputs of both models "
                         "at layer ", resume.layer, " are verified");
  RETURN_IF_ERROR(ApplyResumePoint(
      attach, resume,
      ResumeMessages{"evaluation resumes " + from, "task(s) to evaluate " + from,
                     resume.layer >= 0 ? "evaluation resumes " + from : std::string()}));
  // The figures of the layer tasks that stay DONE (a task requeued meanwhile, e.g. with an
  // output rebuilt, reruns and replaces its own).
  ASSIGN_OR_RETURN(const std::vector<store::EvaluationLayerRow> rows,
                   attach.store->ListEvaluationLayers(attach.job_id));
  evaluation->Restore(rows, *attach.tasks);
  return absl::OkStatus();
}

void EvaluateJob::TaskDone(const store::TaskRow& task, const TaskOutput& output) {
  const EvaluateResult& result = ResultOf(output);
  evaluation->OnTaskDone(task, output.path, result.layer, result.figures);
}

absl::StatusOr<evaluation::JobEvaluation*> JobState(const StageContext& ctx) {
  if (ctx.job == nullptr || !Calibrates(ctx)) {
    return absl::InternalError("an evaluate task ran without the job's evaluation state");
  }
  return static_cast<EvaluateJob*>(ctx.job)->evaluation.get();
}

// The job's output as a V4 model, read beneath the handle the job wrote it through.
absl::StatusOr<const model::V4Checkpoint*> QuantizedOutput(evaluation::JobEvaluation& job,
                                                          const StageContext& ctx) {
  if (ctx.output_dir == nullptr) {
    return absl::InternalError("output: the job's directory is not open");
  }
  return job.Quantized(*ctx.output_dir);
}

// The task metrics' figures of a task that moved `tokens` token rows (none for 0).
std::vector<TaskFigure> EvaluatedTokens(int64_t tokens) {
  if (tokens <= 0) return {};
  return {{"quantd_evaluated_tokens_total", static_cast<double>(tokens)}};
}

// The task's planned total is the bound of the held-out tokens (the plan reads no data): the
// `tokens` the task really moves count for all of it.
evaluation::EvaluationHooks Hooks(const StageContext& ctx, const store::TaskRow& row,
                                  int64_t tokens) {
  evaluation::EvaluationHooks hooks;
  hooks.on_batch = [&ctx, total = row.bytes_total, tokens](int64_t moved) {
    if (ctx.add_progress && tokens > 0) {
      ctx.add_progress(static_cast<uint64_t>(moved * total / tokens));
    }
  };
  hooks.alive = [&ctx] {
    if (ctx.add_progress) ctx.add_progress(0);
  };
  hooks.cancelled = ctx.cancelled;
  return hooks;
}

// Layer 0's input: the held-out samples of the job's tokens file embedded by both models.
absl::StatusOr<evaluation::EvaluationBatches> EmbeddedSamples(const EvaluateTask& task,
                                                              const model::V4Checkpoint& source,
                                                              const model::V4Checkpoint& quantized,
                                                              const StageContext& ctx) {
  ASSIGN_OR_RETURN(const std::shared_ptr<const calibration::JobTokens> tokens,
                   CalibrationTokens(ctx, source.config.vocab_size));
  const std::vector<std::vector<int32_t>>& samples = tokens->held_out;
  const int64_t n = static_cast<int64_t>(samples.size());
  if (n == 0 || n > task.max_samples || calibration::TokenCount(samples) > task.max_tokens) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the job's tokens file has ", n, " held-out samples of ", calibration::TokenCount(samples),
        " tokens; the evaluation was planned for 1 to ", task.max_samples, " of at most ",
        task.max_tokens));
  }
  return evaluation::EmbedHeldOut(source, quantized, samples, calibration::kDefaultBatchBytes);
}

absl::StatusOr<TaskOutput> RunLayer(const EvaluateTask& task, const store::TaskRow& row,
                                    compute::Device& device,
                                    const StageContext& ctx) {
  const auto start = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(evaluation::JobEvaluation * job, JobState(ctx));
  ASSIGN_OR_RETURN(const model::V4Checkpoint* source, CalibrationSource(ctx));
  ASSIGN_OR_RETURN(const model::V4Checkpoint* quantized, QuantizedOutput(*job, ctx));
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
                                             Hooks(ctx, row, input.tokens())));
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
  auto result = std::make_unique<EvaluateResult>();
  result->layer = store::EvaluationLayerRow{task.layer,           q.free_running.signal,
                                            q.free_running.noise, q.teacher_forced.signal,
                                            q.teacher_forced.noise, SecondsSince(start)};
  out.result = std::move(result);
  out.figures = EvaluatedTokens(input.tokens());
  out.summary = absl::StrFormat("load %.1f s, decode %.1f s, forward %.1f s", q.load_seconds,
                                q.decode_seconds, q.forward_seconds);
  return out;
}

absl::StatusOr<TaskOutput> RunHead(const EvaluateTask& task, const store::TaskRow& task_row,
                                   compute::Device& device,
                                   const StageContext& ctx) {
  const auto start = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(evaluation::JobEvaluation * job, JobState(ctx));
  ASSIGN_OR_RETURN(const model::V4Checkpoint* source, CalibrationSource(ctx));
  ASSIGN_OR_RETURN(const model::V4Checkpoint* quantized, QuantizedOutput(*job, ctx));
  const std::map<int64_t, store::EvaluationLayerRow> layers = job->Layers();
  std::optional<evaluation::EvaluationBatches> input = job->Output(task.layers - 1);
  if (!input.has_value() || static_cast<int64_t>(layers.size()) != task.layers) {
    return absl::FailedPreconditionError(
        "evaluate head: the figures and activations of the decoder layers are not in this "
        "process");
  }
  evaluation::QualityReport report;
  report.numerics = CalibrationNumericsName(ctx.spec->calibration.numerics);
  report.samples = input->samples();
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
                                            Hooks(ctx, task_row, input->tokens())));
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
  auto result = std::make_unique<EvaluateResult>();
  result->figures = std::move(row);
  out.result = std::move(result);
  out.figures = EvaluatedTokens(report.tokens);
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
  // Sized by the bound, not the data: the calibrate stage's tokens task tokenizes the held-out
  // samples (job_tokens.h).
  const calibration::TokenBound bound = HeldOutBound(spec);
  EvaluateTask t;
  t.layers = layout.layers;
  t.max_samples = bound.samples;
  t.max_tokens = bound.tokens;
  const std::string kind(kKind);
  std::vector<store::TaskRef> after = {
      {std::string(ExportStage::kKind), std::string(ExportStage::kKind)}};
  for (const OutputShard& shard : input.output_shards) {
    after.push_back({std::string(VerifyStage::kKind), shard.task.shard});
  }
  // The largest batch EmbedHeldOut may form, for the tasks' memory.
  const int64_t seq_len = spec.calibration.seq_len;
  const int64_t batch_bytes = LargestBatchBytes(config, bound.samples, seq_len);
  t.kind = EvaluateTask::Kind::kLayer;
  for (int64_t l = 0; l < layout.layers; ++l) {
    t.layer = l;
    compute::DeviceRequirement memory;
    memory.memory_bytes =
        EvaluateLayerTaskBytes(config, *input.inventory, l, t.max_tokens, batch_bytes);
    tasks.push_back({t.Name(), ToJson(t), t.max_tokens,
                     absl::StrCat("layer ", l + 1, " of ", layout.layers), memory,
                     std::move(after)});
    after = {{kind, t.Name()}};
  }
  t.layer = 0;
  t.kind = EvaluateTask::Kind::kHead;
  compute::DeviceRequirement head_memory;
  head_memory.memory_bytes = EvaluateHeadTaskBytes(config, t.max_tokens, seq_len);
  tasks.push_back(
      {t.Name(), ToJson(t), t.max_tokens, "head: next-token figures", head_memory, after});
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
  return LayerCheckpointBytes(input, task.max_tokens, /*models=*/2);
}

absl::StatusOr<std::unique_ptr<StageJob>> EvaluateStage::OpenJob(
    const StageJobInput& input) const {
  if (!NeedsEvaluation(*input.spec)) return nullptr;
  auto job = std::make_unique<EvaluateJob>();
  ASSIGN_OR_RETURN(job->evaluation,
                   evaluation::JobEvaluation::Create(input.stored->work_dir,
                                                     input.spec->calibration.checkpoint_seconds));
  if (input.stored->planned) job->resume = job->evaluation->Resume(input.stored->tasks);
  return std::unique_ptr<StageJob>(std::move(job));
}

void EvaluateStage::AdaptSpec(const std::vector<store::TaskRow>& stored, JobSpec& spec) const {
  // A calibrating job planned by a release without the evaluate stage (its stored plan has no
  // evaluate task, its spec does not mention evaluate) resumes on the plan it has.
  if (!spec.evaluate.enabled.has_value() &&
      std::none_of(stored.begin(), stored.end(),
                   [](const store::TaskRow& t) { return t.stage_kind == kKind; })) {
    spec.evaluate.enabled = false;
  }
}

bool EvaluateStage::ChecksOwnOutput(const store::TaskRow& task) const {
  return EvaluateLayerOf(task).has_value();
}

std::string EvaluateStage::ProgressStep(const std::vector<const store::TaskRow*>& running) const {
  return running.empty() ? std::string() : running.front()->label;
}

absl::StatusOr<TaskOutput> EvaluateStage::Run(const store::TaskRow& row, compute::Device& device,
                                              const StageContext& ctx) const {
  ASSIGN_OR_RETURN(const EvaluateTask task, evaluation::ParseEvaluateTask(row.payload_json));
  switch (task.kind) {
    case EvaluateTask::Kind::kLayer: return RunLayer(task, row, device, ctx);
    case EvaluateTask::Kind::kHead: return RunHead(task, row, device, ctx);
    case EvaluateTask::Kind::kGate: return RunGate(ctx);
  }
  return absl::InternalError("unknown evaluate task");
}

absl::Status EvaluateStage::Record(store::TaskRecord& txn, const store::TaskRow& /*task*/,
                                   const TaskOutput& output) const {
  const EvaluateResult& result = ResultOf(output);
  if (result.layer.has_value()) RETURN_IF_ERROR(txn.PutEvaluationLayer(*result.layer));
  if (result.figures.has_value()) RETURN_IF_ERROR(txn.PutEvaluation(*result.figures));
  return absl::OkStatus();
}

}  // namespace quantd::pipeline
