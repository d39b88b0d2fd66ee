#include "server/pipeline/stages/calibrate_stage.h"

#include <errno.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <system_error>
#include <tuple>
#include <memory>
#include <optional>
#include <set>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/base/status_macros.h"
#include "server/calibration/amax_rows.h"
#include "server/calibration/calibrate_layer.h"
#include "server/calibration/calibrate_task.h"
#include "server/calibration/calibration_tokens.h"
#include "server/calibration/export_amax.h"
#include "server/calibration/job_calibration.h"
#include "server/calibration/layer_checkpoint.h"
#include "server/checkpoint/atomic_file.h"
#include "server/checkpoint/sha256.h"
#include "server/model/v4_config.h"
#include "server/pipeline/stages/inspect_stage.h"
#include "server/pipeline/stages/job_tokens.h"
#include "server/pipeline/stages/layer_resume.h"
#include "server/pipeline/stages/layer_task_memory.h"
#include "server/store/private_files.h"

namespace quantd::pipeline {

using job::CalibrationMode;
using job::CalibrationNumerics;
using job::CalibrationSpec;
using job::JobSpec;
using job::UncalibratedFill;
using job::WeightFormat;

namespace {

using calibration::CalibrateTask;

// The decoder layer of an official module name ("layers.<L>.…"), or -1.
int64_t LayerOf(const std::string& module) {
  constexpr std::string_view kPrefix = "layers.";
  if (module.rfind(kPrefix, 0) != 0) return -1;
  const size_t dot = module.find('.', kPrefix.size());
  int64_t layer = -1;
  if (dot == std::string::npos ||
      !absl::SimpleAtoi(module.substr(kPrefix.size(), dot - kPrefix.size()), &layer)) {
    return -1;
  }
  return layer;
}

// The source's config.json as a DeepSeek-V4 model: the only architecture with a forward.
absl::StatusOr<model::V4Config> SourceConfig(const PlanInput& input) {
  absl::StatusOr<model::V4Config> config =
      model::ParseV4Config(input.source->config(), input.spec->source + "/config.json");
  if (!config.ok()) {
    return absl::Status(config.status().code(),
                        absl::StrCat("calibration data is given, and calibration runs the "
                                     "DeepSeek-V4 forward: ", config.status().message()));
  }
  return config;
}

model::Numerics ForwardNumerics(const CalibrationSpec& spec) {
  return spec.numerics == CalibrationNumerics::kMath ? model::Numerics::kMath
                                                     : model::Numerics::kOfficial;
}

// The stage's state for one calibrating job (StageJob): the job's calibration::JobCalibration,
// where it resumes, and the directory calibration.amax_out is written beneath.
class CalibrateJob final : public StageJob {
 public:
  absl::Status Attach(StageJobAttach& attach) override;
  void TaskDone(const store::TaskRow& task, const TaskOutput& output) override;
  absl::Status CheckDirsUnchanged() const override {
    return amax_out_dir.is_open() ? amax_out_dir.CheckUnchanged() : absl::OkStatus();
  }

  std::unique_ptr<calibration::JobCalibration> calibration;  // thread-safe
  bool planned = false;  // the job's plan was stored before this start (StoredJob::planned)
  // Where calibration resumes, found by OpenJob on a later start; applied by Attach.
  calibration::ResumePoint resume;
  // The directory of calibration.amax_out, opened by OpenJob after the path checks (closed when
  // the spec sets no amax_out): the file is written beneath it.
  checkpoint::DirHandle amax_out_dir;
  // calibration.amax_out existed when the job was first loaded (so admission let the job replace
  // it); a file that appears there later is another writer's, never replaced without overwrite.
  bool amax_out_existed = false;
};

// What a calibrate task produced besides its file: its amax rows (calibration/amax_rows.h).
struct CalibrateResult final : StageResult {
  std::vector<store::AmaxRow> amax;
};

const std::vector<store::AmaxRow>& AmaxOf(const TaskOutput& output) {
  static const std::vector<store::AmaxRow> kNone;
  const auto* result = static_cast<const CalibrateResult*>(output.result.get());
  return result != nullptr ? result->amax : kNone;
}

// The calibrate stage's job of `job` (the object CalibrateStage::OpenJob made; nullptr when it
// made none).
CalibrateJob* CalibrateJobOf(StageJob* job) { return static_cast<CalibrateJob*>(job); }

absl::StatusOr<CalibrateJob*> StageState(const StageContext& ctx) {
  CalibrateJob* job = ctx.job_of ? CalibrateJobOf(ctx.job_of(CalibrateStage::kKind)) : nullptr;
  if (job == nullptr) {
    return absl::InternalError("a calibrate task ran without the job's calibration state");
  }
  return job;
}

absl::StatusOr<calibration::JobCalibration*> JobState(const StageContext& ctx) {
  ASSIGN_OR_RETURN(CalibrateJob * job, StageState(ctx));
  return job->calibration.get();
}

// Whether `t` is a calibrate task of kind `kind`.
bool IsTaskOfKind(const store::TaskRow& t, CalibrateTask::Kind kind) {
  if (t.stage_kind != CalibrateStage::kKind) return false;
  absl::StatusOr<CalibrateTask> task = calibration::ParseCalibrateTask(t.payload_json);
  return task.ok() && task->kind == kind;
}

// Whether calibration.amax_out was there when the job was first loaded (kept in the work dir).
absl::StatusOr<bool> AmaxOutExisted(const JobSpec& spec, const StoredJob& stored,
                                    const checkpoint::DirHandle& dir) {
  const std::string name = std::filesystem::path(spec.calibration.amax_out).filename().string();
  const bool present = dir.Stat(name).ok();
  if (stored.work_dir.empty()) return present;
  // What admission accepted at submit is kept in the work dir, so that a resumed job never takes
  // a file that another writer (a job of another quantd) put there meanwhile for one it may
  // replace.
  const std::string marker = stored.work_dir + "/amax_out_existed";
  if (stored.planned) return std::filesystem::exists(marker);
  if (!present) return false;
  std::error_code ec;
  std::filesystem::create_directories(stored.work_dir, ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("cannot create the work directory ", stored.work_dir, ": ", ec.message()));
  }
  absl::Status created = store::CreatePrivateFile(marker);
  if (!created.ok() && !absl::IsAlreadyExists(created)) return created;
  return true;
}

absl::Status CalibrateJob::Attach(StageJobAttach& attach) {
  const std::string from =
      resume.layer < 0
          ? std::string("calibration resumes from layer 0: no usable layer checkpoint")
          : absl::StrCat("calibration resumes from layer ", resume.layer + 1,
                         ": the checkpointed outputs of layer ", resume.layer, " are verified");
  RETURN_IF_ERROR(ApplyResumePoint(
      attach, resume,
      ResumeMessages{from, "done task(s): " + from,
                     planned && !resume.finished ? from : std::string()}));
  // The rows of the tasks that stay DONE are the table so far. Those of the requeued tasks stay
  // in the store until their rerun replaces them; a rerun measures the same values again (the
  // same tokens, batches and inputs), so restoring them now changes no amax, and the rerun's
  // rows replace them in the calibration as in the store.
  ASSIGN_OR_RETURN(const std::vector<store::TaskAmaxRow> amax,
                   attach.store->ListTaskAmax(attach.job_id));
  calibration->Restore(amax, *attach.tasks);
  return absl::OkStatus();
}

void CalibrateJob::TaskDone(const store::TaskRow& task, const TaskOutput& output) {
  calibration->OnTaskDone(task, AmaxOf(output), output.path, output.sha256);
}

// The output record of a file the task wrote.
absl::StatusOr<TaskOutput> FileOutput(const std::string& path) {
  TaskOutput out;
  out.path = path;
  std::error_code ec;
  out.bytes = std::filesystem::file_size(path, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot stat ", path, ": ", ec.message()));
  ASSIGN_OR_RETURN(out.sha256, checkpoint::Sha256File(path));
  return out;
}

absl::StatusOr<TaskOutput> RunTokens(const store::TaskRow& row, const StageContext& ctx) {
  ASSIGN_OR_RETURN(calibration::JobCalibration * job, JobState(ctx));
  ASSIGN_OR_RETURN(const model::V4Config config,
                   model::ParseV4Config(ctx.source->config(), ctx.spec->source + "/config.json"));
  ASSIGN_OR_RETURN(const calibration::JobTokens tokens,
                   TokenizeJob(*ctx.spec, config.vocab_size, ctx.spec->evaluate.on(),
                               ctx.cancelled));
  const int64_t count = calibration::TokenCount(tokens.calibration);
  if (count > row.bytes_total) {
    return absl::InternalError(absl::StrCat("the calibration data gives ", count,
                                            " tokens, more than the ", row.bytes_total,
                                            " its samples and seq_len allow"));
  }
  RETURN_IF_ERROR(calibration::WriteTokensFile(job->tokens_path(), tokens));
  if (ctx.add_progress) ctx.add_progress(static_cast<uint64_t>(row.bytes_total));
  return FileOutput(job->tokens_path());
}

absl::StatusOr<TaskOutput> RunLayer(const CalibrateTask& task, const store::TaskRow& row,
                                    compute::Device& device, const StageContext& ctx) {
  const auto start = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(calibration::JobCalibration * job, JobState(ctx));
  ASSIGN_OR_RETURN(const model::V4Checkpoint* ckpt, job->Checkpoint());
  calibration::ActivationStore& store = job->activations();

  // The slice's input: its batches embedded (layer 0), or the previous layer's output.
  std::shared_ptr<const calibration::ActivationStore::Batches> input;
  if (task.layer == 0) {
    ASSIGN_OR_RETURN(std::shared_ptr<const calibration::JobTokens> tokens,
                     job->Tokens(ckpt->config.vocab_size));
    const calibration::SampleIds& ids = tokens->calibration;
    std::vector<int64_t> lengths;
    for (const std::vector<int32_t>& s : ids) lengths.push_back(static_cast<int64_t>(s.size()));
    ASSIGN_OR_RETURN(const std::vector<std::vector<size_t>> batches,
                     calibration::PlanBatches(ckpt->config, lengths,
                                              calibration::kDefaultBatchBytes));
    const auto [first, end] = calibration::SliceBatches(static_cast<int64_t>(batches.size()),
                                                        task.slice, task.slices);
    auto embedded = std::make_shared<calibration::ActivationStore::Batches>();
    for (int64_t b = first; b < end; ++b) {
      ASSIGN_OR_RETURN(calibration::BatchActivations acts,
                       calibration::EmbedBatch(*ckpt, ids, batches[b]));
      embedded->push_back(std::move(acts));
    }
    input = std::move(embedded);
  } else {
    input = store.Get(task.layer - 1, task.slice);
    if (input == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("calibrate ", task.Name(), ": the activations of layer ", task.layer - 1,
                       " slice ", task.slice, " are not in this process"));
    }
  }

  calibration::SliceOptions options;
  options.numerics = ForwardNumerics(ctx.spec->calibration);
  options.slice = absl::StrCat("layer ", task.layer, " slice ", task.slice, " of ", task.slices);
  options.slice_index = task.slice;
  options.spill_dir = store.spill_dir();
  options.all_experts = ctx.spec->calibration.calibrate_all_experts;
  options.discard_output = task.layer + 1 == task.layers;
  int64_t reserved = 0;  // host bytes reserved for this slice's outputs
  options.keep_in_host = [&store, &reserved](int64_t bytes) {
    if (!store.ReserveHost(bytes)) return false;
    reserved += bytes;
    return true;
  };
  // The task's planned total is its share of the data's bound (the plan reads no data): the
  // slice's real tokens count for that share.
  int64_t slice_tokens = 0;
  for (const calibration::BatchActivations& b : *input) slice_tokens += b.tokens;
  options.on_batch = [&ctx, &row, slice_tokens](int64_t tokens) {
    if (ctx.add_progress && slice_tokens > 0) {
      ctx.add_progress(static_cast<uint64_t>(tokens * row.bytes_total / slice_tokens));
    }
  };
  options.alive = [&ctx] {
    if (ctx.add_progress) ctx.add_progress(0);
  };
  absl::StatusOr<calibration::SliceResult> result = calibration::CalibrateLayerSlice(
      *ckpt, task.layer, *input, device, options, ctx.cancelled);
  if (!result.ok()) {
    store.UnreserveHost(reserved);
    return result.status();
  }
  TaskOutput out;
  if (!options.discard_output) {
    // A layer boundary's outputs go to disk as well (calibration/layer_checkpoint.h); the task's
    // output is then the checkpoint's manifest, committed with its completion.
    bool all_spilled = true;
    for (const calibration::BatchActivations& b : result->output) {
      all_spilled &= !b.spill_path.empty();
    }
    if (job->checkpoints().ShouldPersist(task.layer, all_spilled)) {
      absl::StatusOr<calibration::CheckpointFile> file = job->checkpoints().Persist(
          task.layer, task.slice, result->output, [&ctx] {
            if (ctx.add_progress) ctx.add_progress(0);
          });
      if (!file.ok()) {
        calibration::ReleaseBatches(result->output);
        store.UnreserveHost(reserved);
        return file.status();
      }
      out.path = file->path;
      out.bytes = file->bytes;
      out.sha256 = file->sha256;
    }
    store.Put(task.layer, task.slice, std::move(result->output));
  }
  auto amax = std::make_unique<CalibrateResult>();
  amax->amax = calibration::ToAmaxRows(result->amax);
  out.result = std::move(amax);
  if (result->tokens > 0) {
    out.figures = {
        {"quantd_calibrated_tokens_total", static_cast<double>(result->tokens)},
        {"quantd_calibration_layer_seconds",
         std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()}};
  }
  const calibration::SliceTiming& s = result->timing;
  out.summary = absl::StrFormat("load %.1f s, decode %.1f s, forward %.1f s, record %.1f s", s.load,
                                s.decode, s.forward, s.record);
  return out;
}

// Whether the regular file `name` beneath `dir` holds exactly `text` (read at most text's size
// plus one byte).
absl::StatusOr<bool> SameContents(const checkpoint::DirHandle& dir, const std::string& name,
                                  const std::string& text) {
  struct stat st;
  ASSIGN_OR_RETURN(const int fd, dir.OpenRegularFile(name, &st));
  std::string present(text.size() + 1, '\0');
  size_t got = 0;
  while (got < present.size()) {
    const ssize_t n = read(fd, present.data() + got, present.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  close(fd);
  return got == text.size() && present.compare(0, got, text) == 0;
}

absl::StatusOr<TaskOutput> RunAmaxOut(const StageContext& ctx) {
  ASSIGN_OR_RETURN(CalibrateJob * stage, StageState(ctx));
  calibration::JobCalibration* job = stage->calibration.get();
  ASSIGN_OR_RETURN(const model::V4Checkpoint* ckpt, job->Checkpoint());
  const calibration::AmaxTable table = job->Table();
  calibration::ExportReport report;
  ASSIGN_OR_RETURN(const auto exported, calibration::ExportInputAmax(
                                            table, ckpt->config, ctx.spec->calibration, &report));
  // Written beneath the handle of its directory, opened when the job was claimed, and described
  // from the bytes written, not read back through the path.
  const std::string& path = ctx.spec->calibration.amax_out;
  if (!stage->amax_out_dir.is_open()) {
    return absl::InternalError("calibration.amax_out: the job's directory for it is not open");
  }
  const checkpoint::DirHandle& dir = stage->amax_out_dir;
  const std::string text = calibration::AmaxFileText(exported, table);
  const std::string name = std::filesystem::path(path).filename().string();
  // A file that was not there when the job was loaded is never replaced (RENAME_NOREPLACE): two
  // jobs, of one daemon or of two, that name one amax_out cannot both think they wrote it.
  const bool replace = ctx.spec->overwrite || stage->amax_out_existed;
  if (absl::Status written = checkpoint::WriteFileAtomicallyAt(dir, name, text, replace);
      absl::IsAlreadyExists(written)) {
    // The same bytes are this job's own (an attempt that wrote them before it was recorded).
    ASSIGN_OR_RETURN(const bool same, SameContents(dir, name, text));
    if (!same) {
      return WithJobReason(
          absl::FailedPreconditionError(absl::StrCat(
              "calibration.amax_out: ", path,
              " was written by another job while this one ran; set overwrite to replace it")),
          "OUTPUT_EXISTS");
    }
  } else if (!written.ok()) {
    return written;
  }
  checkpoint::Sha256 hash;
  hash.Update(text.data(), text.size());
  TaskOutput out;
  out.path = dir.PathOf(name);
  out.bytes = text.size();
  out.sha256 = hash.HexDigest();
  return out;
}

}  // namespace

bool NeedsCalibration(const JobSpec& spec) {
  const CalibrationSpec& c = spec.calibration;
  return spec.weight_format == WeightFormat::kNvfp4 && c.mode == CalibrationMode::kData &&
         c.amax_file.empty() && (!c.dataset.empty() || !c.datasets.empty());
}

absl::StatusOr<CalibrationLayout> PlanCalibrationLayout(const PlanInput& input) {
  if (!NeedsCalibration(*input.spec)) return CalibrationLayout{};
  ASSIGN_OR_RETURN(const model::V4Config config, SourceConfig(input));
  const int64_t devices = static_cast<int64_t>(input.spec->devices.size());
  return CalibrationLayout{config.num_hidden_layers, devices > 0 ? devices : kAutoSlices};
}

absl::StatusOr<uint64_t> LayerCheckpointBytes(const PlanInput& input, int64_t tokens,
                                              int64_t models) {
  ASSIGN_OR_RETURN(const model::V4Config config, SourceConfig(input));
  constexpr int64_t kBoundaries = 2;
  return static_cast<uint64_t>(kBoundaries * models * tokens * config.hc_mult *
                               config.hidden_size * static_cast<int64_t>(sizeof(float)));
}

std::vector<store::TaskRef> CalibrateDependencies(const CalibrationLayout& layout,
                                                  const JobSpec& spec, const ShardTask& task) {
  std::set<int64_t> layers;
  bool all = spec.calibration.uncalibrated == UncalibratedFill::kModelMax;
  for (const std::string& module : task.modules) {
    const int64_t layer = LayerOf(module);
    if (layer < 0 || layer >= layout.layers) all = true;
    layers.insert(layer);
  }
  if (all) {
    layers.clear();
    for (int64_t l = 0; l < layout.layers; ++l) layers.insert(l);
  }
  std::vector<store::TaskRef> refs;
  if (task.modules.empty()) return refs;
  for (int64_t l : layers) {
    for (int64_t s = 0; s < layout.slices; ++s) {
      refs.push_back({std::string(CalibrateStage::kKind), calibration::CalibrateTaskName(l, s)});
    }
  }
  return refs;
}

bool Calibrates(const StageContext& ctx) {
  return ctx.job_of && ctx.job_of(CalibrateStage::kKind) != nullptr;
}

absl::StatusOr<const model::V4Checkpoint*> CalibrationSource(const StageContext& ctx) {
  ASSIGN_OR_RETURN(calibration::JobCalibration * job, JobState(ctx));
  return job->Checkpoint();
}

absl::StatusOr<std::shared_ptr<const calibration::JobTokens>> CalibrationTokens(
    const StageContext& ctx, int64_t vocab) {
  ASSIGN_OR_RETURN(calibration::JobCalibration * job, JobState(ctx));
  return job->Tokens(vocab);
}

absl::StatusOr<std::map<std::string, float>> CalibratedInputAmax(const StageContext& ctx,
                                                                 const ShardTask& task) {
  if (task.modules.empty()) return std::map<std::string, float>();
  ASSIGN_OR_RETURN(calibration::JobCalibration * job, JobState(ctx));
  ASSIGN_OR_RETURN(const model::V4Checkpoint* ckpt, job->Checkpoint());
  calibration::ExportReport report;
  using AmaxMap = std::map<std::string, float>;
  ASSIGN_OR_RETURN(AmaxMap exported, calibration::ExportInputAmax(job->Table(), ckpt->config,
                                                                  ctx.spec->calibration, &report));
  if (ctx.spec->calibration.uncalibrated == UncalibratedFill::kModelMax) return exported;
  std::set<int64_t> layers;
  for (const std::string& module : task.modules) layers.insert(LayerOf(module));
  for (int64_t l : report.layers_without_experts) {
    if (layers.count(l) != 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          task.shard, ": no routed expert of layer ", l,
          " received a calibration token for some projection, so its experts take the model's "
          "max, known only after the last layer: set calibration.uncalibrated to model_max"));
    }
  }
  return exported;
}

std::optional<int64_t> CalibratedLayers(const std::vector<store::TaskRow>& tasks) {
  for (const store::TaskRow& task : tasks) {
    if (task.stage_kind != CalibrateStage::kKind) continue;
    absl::StatusOr<CalibrateTask> t = calibration::ParseCalibrateTask(task.payload_json);
    if (t.ok() && t->kind == CalibrateTask::Kind::kLayer) return t->layers;
  }
  return std::nullopt;
}

bool CalibrationSucceeded(const std::vector<store::StageProgress>& stages) {
  return std::any_of(stages.begin(), stages.end(), [](const store::StageProgress& s) {
    return s.kind == CalibrateStage::kKind && s.state == store::StageState::kSucceeded;
  });
}

double CalibrationSeconds(const std::vector<store::StageProgress>& stages) {
  double seconds = 0;
  for (const store::StageProgress& s : stages) {
    if (s.kind == CalibrateStage::kKind && s.started_ms.has_value() &&
        s.finished_ms.has_value()) {
      seconds = static_cast<double>(*s.finished_ms - *s.started_ms) / 1000.0;
    }
  }
  return seconds;
}

absl::StatusOr<std::vector<store::TaskPlan>> CalibrateStage::Plan(const PlanInput& input) const {
  ASSIGN_OR_RETURN(const CalibrationLayout layout, PlanCalibrationLayout(input));
  if (layout.layers == 0) return std::vector<store::TaskPlan>();
  ASSIGN_OR_RETURN(const model::V4Config config, SourceConfig(input));
  // Sized by the bound, not the data: tokenizing is the tokens task's work (job_tokens.h).
  ASSIGN_OR_RETURN(const calibration::TokenBound bound,
                   calibration::CalibrationTokenBound(input.spec->calibration));
  const int64_t batch_bytes =
      LargestBatchBytes(config, bound.samples, input.spec->calibration.seq_len);

  std::vector<store::TaskPlan> tasks;
  const std::string kind(kKind);
  CalibrateTask t;
  t.layers = layout.layers;
  t.slices = layout.slices;
  t.kind = CalibrateTask::Kind::kTokens;
  const store::TaskRef inspect{std::string(InspectStage::kKind), std::string(InspectStage::kKind)};
  tasks.push_back({t.Name(), ToJson(t), bound.tokens,
                   absl::StrCat("tokenize up to ", bound.samples, " samples"), {}, {inspect}});
  std::vector<store::TaskRef> previous = {{kind, t.Name()}};
  t.kind = CalibrateTask::Kind::kLayer;
  for (int64_t l = 0; l < layout.layers; ++l) {
    std::vector<store::TaskRef> current;
    for (int64_t s = 0; s < layout.slices; ++s) {
      t.layer = l;
      t.slice = s;
      // The slice's share of the bound, for progress; its memory counts every token, since a
      // slice takes whole batches and one batch may hold nearly all of them.
      const int64_t share = bound.tokens * (s + 1) / layout.slices -
                            bound.tokens * s / layout.slices;
      std::string label = absl::StrCat("layer ", l + 1, " of ", layout.layers);
      if (layout.slices > 1) absl::StrAppend(&label, ", slice ", s + 1, " of ", layout.slices);
      compute::DeviceRequirement memory;
      memory.memory_bytes =
          CalibrateLayerTaskBytes(config, *input.inventory, l, bound.tokens, batch_bytes);
      tasks.push_back({t.Name(), ToJson(t), share, label, memory, previous});
      current.push_back({kind, t.Name()});
    }
    previous = std::move(current);
  }
  if (!input.spec->calibration.amax_out.empty()) {
    t.kind = CalibrateTask::Kind::kAmaxOut;
    tasks.push_back({t.Name(), ToJson(t), 0, "write calibration.amax_out", {}, previous});
  }
  return tasks;
}

absl::StatusOr<uint64_t> CalibrateStage::CheckpointBytes(
    const PlanInput& input, const std::vector<store::TaskPlan>& tasks) const {
  for (const store::TaskPlan& t : tasks) {
    absl::StatusOr<CalibrateTask> task = calibration::ParseCalibrateTask(t.payload_json);
    if (task.ok() && task->kind == CalibrateTask::Kind::kTokens) {
      return LayerCheckpointBytes(input, t.bytes_total, /*models=*/1);
    }
  }
  return 0;
}

absl::StatusOr<std::unique_ptr<StageJob>> CalibrateStage::OpenJob(
    const StageJobInput& input) const {
  const JobSpec& spec = *input.spec;
  const StoredJob& stored = *input.stored;
  if (!NeedsCalibration(spec)) return nullptr;
  auto job = std::make_unique<CalibrateJob>();
  job->planned = stored.planned;
  if (!spec.calibration.amax_out.empty()) {
    // The file is written beneath its directory's handle, opened now, after the path checks.
    ASSIGN_OR_RETURN(
        job->amax_out_dir,
        checkpoint::DirHandle::Open(
            "calibration.amax_out",
            std::filesystem::path(spec.calibration.amax_out).parent_path().string()));
    ASSIGN_OR_RETURN(job->amax_out_existed, AmaxOutExisted(spec, stored, job->amax_out_dir));
  }
  ASSIGN_OR_RETURN(job->calibration,
                   calibration::JobCalibration::Create(spec, input.source, stored.work_dir,
                                                       spec.host_memory_bytes));
  if (!stored.planned) return std::unique_ptr<StageJob>(std::move(job));
  // A tokens file gone or changed is rebuilt, and every layer task that depends on it with it
  // (the store phase requeues it): nothing resumes.
  std::vector<store::TaskRow> tasks = stored.tasks;
  for (const store::TaskRow& t : stored.tasks) {
    if (input.changed_outputs->count(t.id) == 0 ||
        !IsTaskOfKind(t, CalibrateTask::Kind::kTokens)) {
      continue;
    }
    for (store::TaskRow& layer : tasks) {
      if (IsTaskOfKind(layer, CalibrateTask::Kind::kLayer)) {
        layer.state = store::TaskState::kPending;
      }
    }
  }
  job->resume = job->calibration->Resume(tasks);
  return std::unique_ptr<StageJob>(std::move(job));
}

bool CalibrateStage::ChecksOwnOutput(const store::TaskRow& task) const {
  return IsTaskOfKind(task, CalibrateTask::Kind::kLayer);
}

std::string CalibrateStage::ProgressStep(const std::vector<const store::TaskRow*>& running) const {
  std::optional<CalibrateTask> earliest;
  for (const store::TaskRow* row : running) {
    absl::StatusOr<CalibrateTask> task = calibration::ParseCalibrateTask(row->payload_json);
    if (!task.ok() || task->kind != CalibrateTask::Kind::kLayer) continue;
    if (!earliest.has_value() || task->layer < earliest->layer) earliest = *task;
  }
  if (!earliest.has_value()) return "";
  return absl::StrCat("layer ", earliest->layer + 1, " of ", earliest->layers);
}

absl::StatusOr<TaskOutput> CalibrateStage::Run(const store::TaskRow& row, compute::Device& device,
                                               const StageContext& ctx) const {
  ASSIGN_OR_RETURN(const CalibrateTask task, calibration::ParseCalibrateTask(row.payload_json));
  switch (task.kind) {
    case CalibrateTask::Kind::kTokens: return RunTokens(row, ctx);
    case CalibrateTask::Kind::kLayer: return RunLayer(task, row, device, ctx);
    case CalibrateTask::Kind::kAmaxOut: return RunAmaxOut(ctx);
  }
  return absl::InternalError("unknown calibrate task");
}

absl::Status CalibrateStage::Record(store::TaskRecord& txn, const store::TaskRow& /*task*/,
                                    const TaskOutput& output) const {
  return txn.PutTaskAmax(AmaxOf(output));
}

}  // namespace quantd::pipeline
