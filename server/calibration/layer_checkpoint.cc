#include "server/calibration/layer_checkpoint.h"

#include <chrono>
#include <filesystem>
#include <system_error>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "server/base/status_macros.h"
#include "server/checkpoint/atomic_file.h"
#include "server/checkpoint/json_file.h"
#include "server/checkpoint/sha256.h"
#include "server/model/v4_activations.h"

namespace quantd::calibration {
namespace {

std::string SliceStem(int64_t layer, int64_t slice) {
  return absl::StrCat("layer", layer, ".slice", slice);
}

std::string BatchFileName(int64_t layer, int64_t slice, size_t batch) {
  return absl::StrCat(SliceStem(layer, slice), ".batch", batch, ".safetensors");
}

// The layer a checkpoint file name ("layer<L>.…", .tmp files too) belongs to, or -1.
int64_t LayerOfFile(const std::string& name) {
  constexpr std::string_view kPrefix = "layer";
  const size_t dot = name.find('.');
  int64_t layer = -1;
  if (name.rfind(kPrefix, 0) != 0 || dot == std::string::npos ||
      !absl::SimpleAtoi(name.substr(kPrefix.size(), dot - kPrefix.size()), &layer)) {
    return -1;
  }
  return layer;
}

std::string Sha256Of(const std::string& text) {
  checkpoint::Sha256 h;
  h.Update(text.data(), text.size());
  return h.HexDigest();
}

// A spilled batch in the checkpoint at `path`: a hard link to its spill file, or, where the file
// system refuses links, its activations read back and written again. Returns the file's SHA-256.
absl::StatusOr<std::string> LinkSpilled(const BatchActivations& batch, const std::string& path) {
  std::error_code ec;
  std::filesystem::remove(path, ec);  // an earlier run's checkpoint of the same slice
  std::filesystem::create_hard_link(batch.spill_path, path, ec);
  if (!ec) return batch.spill_sha256;
  ASSIGN_OR_RETURN(const model::V4Activations acts, model::ReadActivations(batch.spill_path));
  RETURN_IF_ERROR(model::SpillActivations(acts, path));
  return checkpoint::Sha256File(path);
}

// The batches of one slice's checkpoint (spilled, naming the checkpoint's files), after checking
// the chain of checksums: the manifest against the task's recorded size and SHA-256, each batch
// file against the manifest. Errors name the file and the check, never the content.
absl::StatusOr<std::vector<BatchActivations>> ReadCheckpoint(const LayerTask& task) {
  const store::TaskRow& row = task.row;
  const std::string& path = row.output_path;
  std::error_code ec;
  const uintmax_t size = std::filesystem::file_size(path, ec);
  if (ec) return absl::DataLossError(absl::StrCat(path, " is gone"));
  if (!row.output_bytes.has_value() || size != static_cast<uintmax_t>(*row.output_bytes)) {
    return absl::DataLossError(absl::StrCat(path, " has ", size, " bytes, recorded ",
                                            row.output_bytes.value_or(0)));
  }
  ASSIGN_OR_RETURN(const std::string text, checkpoint::ReadFile(path, kMaxCheckpointManifestBytes));
  if (Sha256Of(text) != row.output_sha256) {
    return absl::DataLossError(absl::StrCat(path, " does not have the recorded SHA-256"));
  }
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  const auto bad = [&path](const std::string& field) {
    return absl::DataLossError(absl::StrCat(path, ": ", field, " is missing or not valid"));
  };
  if (!j.is_object()) return bad("the manifest");
  if (!j.contains("layer") || j["layer"] != task.layer) return bad("layer");
  if (!j.contains("slice") || j["slice"] != task.slice) return bad("slice");
  if (!j.contains("batches") || !j["batches"].is_array()) return bad("batches");
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  std::vector<BatchActivations> batches;
  for (size_t i = 0; i < j["batches"].size(); ++i) {
    const nlohmann::json& e = j["batches"][i];
    const std::string field = absl::StrCat("batches[", i, "]");
    // The name is fixed by its place, so a manifest can only point into its own directory.
    int64_t listed = 0;
    BatchActivations b;
    if (!e.is_object() || !e.contains("file") ||
        e["file"] != BatchFileName(task.layer, task.slice, i) ||
        !checkpoint::GetCount(e, "bytes", &listed) ||
        !checkpoint::GetCount(e, "tokens", &b.tokens) || !e.contains("sha256") ||
        !e["sha256"].is_string() || e["sha256"].get<std::string>().size() != 64) {
      return bad(field);
    }
    b.spill_path = (dir / e["file"].get<std::string>()).string();
    b.spill_sha256 = e["sha256"].get<std::string>();
    const uintmax_t batch_size = std::filesystem::file_size(b.spill_path, ec);
    if (ec) return absl::DataLossError(absl::StrCat(b.spill_path, " is gone"));
    if (batch_size != static_cast<uintmax_t>(listed)) {
      return absl::DataLossError(absl::StrCat(b.spill_path, " has ", batch_size,
                                              " bytes, its manifest lists ", listed));
    }
    ASSIGN_OR_RETURN(const std::string sha256, checkpoint::Sha256File(b.spill_path));
    if (sha256 != b.spill_sha256) {
      return absl::DataLossError(
          absl::StrCat(b.spill_path, " does not have the SHA-256 its manifest records"));
    }
    batches.push_back(std::move(b));
  }
  return batches;
}

}  // namespace

int64_t SteadyNowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

absl::StatusOr<std::unique_ptr<LayerCheckpoints>> LayerCheckpoints::Create(
    const std::string& dir, int64_t checkpoint_seconds, MonotonicMs now_ms) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  return std::unique_ptr<LayerCheckpoints>(
      new LayerCheckpoints(dir, checkpoint_seconds, std::move(now_ms)));
}

LayerCheckpoints::LayerCheckpoints(std::string dir, int64_t checkpoint_seconds,
                                   MonotonicMs now_ms)
    : dir_(std::move(dir)),
      checkpoint_ms_(checkpoint_seconds * 1000),
      now_ms_(std::move(now_ms)),
      last_boundary_ms_(now_ms_()) {}

bool LayerCheckpoints::ShouldPersist(int64_t layer, bool all_spilled) {
  absl::MutexLock lock(&mu_);
  auto [it, first] = decided_.emplace(layer, false);
  if (first) it->second = now_ms_() - last_boundary_ms_ >= checkpoint_ms_;
  return it->second || all_spilled;
}

absl::StatusOr<CheckpointFile> LayerCheckpoints::Persist(
    int64_t layer, int64_t slice, const std::vector<BatchActivations>& batches,
    const std::function<void()>& on_batch) const {
  CheckpointFile out;
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  for (size_t i = 0; i < batches.size(); ++i) {
    const BatchActivations& b = batches[i];
    const std::string name = BatchFileName(layer, slice, i);
    const std::string path = (std::filesystem::path(dir_) / name).string();
    std::string sha256;
    if (b.spill_path.empty()) {
      RETURN_IF_ERROR(model::SpillActivations(b.host, path));
      ASSIGN_OR_RETURN(sha256, checkpoint::Sha256File(path));
    } else {
      ASSIGN_OR_RETURN(sha256, LinkSpilled(b, path));
    }
    std::error_code ec;
    const uintmax_t bytes = std::filesystem::file_size(path, ec);
    if (ec) return absl::InternalError(absl::StrCat("cannot stat ", path, ": ", ec.message()));
    out.batch_bytes += static_cast<int64_t>(bytes);
    list.push_back({{"file", name}, {"bytes", bytes}, {"tokens", b.tokens}, {"sha256", sha256}});
    if (on_batch) on_batch();
  }
  nlohmann::ordered_json manifest;
  manifest["layer"] = layer;
  manifest["slice"] = slice;
  manifest["batches"] = std::move(list);
  const std::string text = manifest.dump();
  out.path = (std::filesystem::path(dir_) / (SliceStem(layer, slice) + ".json")).string();
  RETURN_IF_ERROR(checkpoint::WriteFileAtomically(out.path, text));
  out.bytes = text.size();
  out.sha256 = Sha256Of(text);
  return out;
}

void LayerCheckpoints::OnBoundaryCommitted(int64_t layer) {
  {
    absl::MutexLock lock(&mu_);
    last_boundary_ms_ = now_ms_();
  }
  RemoveLayers([layer](int64_t l) { return l < layer; });
}

void LayerCheckpoints::RemoveAllBut(int64_t keep) const {
  RemoveLayers([keep](int64_t l) { return l != keep; });
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir_, ec)) {
    if (!entry.is_symlink() && entry.is_regular_file() && entry.path().extension() == ".tmp") {
      std::filesystem::remove(entry.path(), ec);
    }
  }
}

void LayerCheckpoints::RemoveLayers(const std::function<bool(int64_t)>& drop) const {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir_, ec)) {
    const int64_t layer = LayerOfFile(entry.path().filename().string());
    // is_symlink first: is_regular_file follows links.
    if (layer >= 0 && drop(layer) && !entry.is_symlink() && entry.is_regular_file()) {
      std::filesystem::remove(entry.path(), ec);
    }
  }
}

ResumePoint ResumeLayers(const std::vector<LayerTask>& tasks, int64_t slices,
                         const LayerCheckpoints& checkpoints, ActivationStore& store) {
  ResumePoint point;
  std::map<int64_t, std::vector<const LayerTask*>> by_layer;
  bool all_done = true;
  for (const LayerTask& t : tasks) {
    by_layer[t.layer].push_back(&t);
    all_done &= t.row.state == store::TaskState::kDone;
  }
  if (all_done) {
    point.finished = true;
    checkpoints.RemoveAllBut(-1);
    return point;
  }
  // The layers done whole, from layer 0 on: a boundary can only be one of them.
  int64_t done_through = -1;
  for (const auto& [layer, slice_tasks] : by_layer) {
    bool done = layer == done_through + 1 && static_cast<int64_t>(slice_tasks.size()) == slices;
    for (const LayerTask* t : slice_tasks) done &= t->row.state == store::TaskState::kDone;
    if (!done) break;
    done_through = layer;
  }
  for (int64_t layer = done_through; layer >= 0 && point.layer < 0; --layer) {
    const std::vector<const LayerTask*>& slice_tasks = by_layer[layer];
    bool checkpointed = true;
    for (const LayerTask* t : slice_tasks) checkpointed &= !t->row.output_path.empty();
    if (!checkpointed) continue;  // not a boundary
    std::map<int64_t, std::vector<BatchActivations>> outputs;
    for (const LayerTask* t : slice_tasks) {
      absl::StatusOr<std::vector<BatchActivations>> batches = ReadCheckpoint(*t);
      if (!batches.ok()) {
        point.rejected.push_back(absl::StrCat("layer ", layer, " slice ", t->slice,
                                              ": checkpoint not used: ",
                                              batches.status().message()));
        break;
      }
      outputs[t->slice] = *std::move(batches);
    }
    if (static_cast<int64_t>(outputs.size()) != slices) continue;
    for (auto& [slice, batches] : outputs) store.PutCheckpointed(layer, slice, std::move(batches));
    point.layer = layer;
  }
  for (const LayerTask& t : tasks) {
    if (t.layer > point.layer && t.row.state == store::TaskState::kDone) {
      point.requeue.push_back(t.row.id);
    }
  }
  checkpoints.RemoveAllBut(point.layer);
  return point;
}

}  // namespace quantd::calibration
