// Export: the checkpoint-level files, after every output shard is written.
//
// Layouts (the choice and its sources are in reference/nvfp4_modelopt.md §3.2, §3.3, §5.2 and
// reference/deepseek_v4_format.md §8a):
//   modelopt        hf_quant_config.json {producer, quantization: {quant_algo, kv_cache_quant_algo,
//                   group_size, exclude_modules}}; config.json quantization_config as ModelOpt's
//                   convert_hf_quant_config_format writes it (config_groups, ignore, quant_algo,
//                   kv_cache_scheme, producer, quant_method "modelopt"). quant_algo is "NVFP4"
//                   (W4A4) or "W4A16_NVFP4" (weights only), the names ModelOpt and vLLM use.
//   modelopt-mixed  NVIDIA's published DeepSeek-V4 layout, used when a V4 source keeps its FP8
//                   quantization_config and only routed experts become NVFP4 (the `experts`
//                   recipe): quant_algo "MIXED_PRECISION" with quantized_layers
//                   {"layers.N.ffn.experts": {quant_algo, group_size}}, exclude_modules = the
//                   recipe's exclusion globs; config.json keeps quant_method "fp8" and adds
//                   moe_quant_algo and the same fields (quantize_to_nvfp4.py
//                   _rewrite_config_json).
//   compressed-tensors  no hf_quant_config.json; config.json quantization_config with
//                   quant_method "compressed-tensors", format "nvfp4-pack-quantized" and one
//                   config group (input_activations omitted for weights only).
// KV cache: none -> kv_cache_quant_algo null and no kv_cache_scheme; fp8_cast and fp8 -> "FP8"
// and kv_cache_scheme (fp8_cast writes no k/v scales: readers then use 1.0).
//
// exclude_modules (ModelOpt) / ignore (compressed-tensors) list the linear modules left in their
// source format: the recipe's exclusion globs that cover some of them, then (except in the mixed
// layout, where quantized_layers alone says what is NVFP4) each remaining module as a pattern
// with its numeric components replaced by '*', or by its exact name. No entry matches a
// quantized module the way vLLM matches them (fnmatch or substring); compressed-tensors gets the
// same entries, globs written as anchored "re:" regexes.
#include "server/pipeline/stages/export_stage.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <optional>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"
#include "server/checkpoint/atomic_file.h"
#include "server/checkpoint/checkpoint_dir.h"
#include "server/checkpoint/safetensors_reader.h"
#include "server/checkpoint/sha256.h"
#include "server/pipeline/export_layout.h"
#include "server/pipeline/stages/dequant_stage.h"
#include "server/pipeline/stages/output_manifest.h"
#include "server/pipeline/stages/quantize_stage.h"
#include "server/pipeline/recipe.h"
#include "server/pipeline/stages/verify_rules.h"

namespace quantd::pipeline {

using checkpoint::LinearModule;
using checkpoint::TensorInventory;

using job::JobSpec;
using job::KvCache;
using job::WeightFormat;

namespace {

using nlohmann::json;
using nlohmann::ordered_json;

constexpr char kConfigName[] = "config.json";
constexpr char kHfQuantConfigName[] = "hf_quant_config.json";
constexpr char kExpertsInfix[] = ".ffn.experts.";
constexpr size_t kCopyChunk = 1 << 20;

// One file the task wrote: its path relative to the output and its digest, for the task's
// checksum.
struct Written {
  std::string name;
  uint64_t bytes = 0;
  std::string sha256;
};

std::string Sha256Of(const std::string& text) {
  checkpoint::Sha256 h;
  h.Update(text.data(), text.size());
  return h.HexDigest();
}

// Writes `text` to `name` beneath `dir` (atomically) and lists it in *written.
absl::Status WriteText(const checkpoint::DirHandle& dir, const std::string& name,
                       const std::string& text, std::vector<Written>* written) {
  absl::Status s = checkpoint::WriteFileAtomicallyAt(dir, name, text);
  if (!s.ok()) return s;
  written->push_back({name, text.size(), Sha256Of(text)});
  return absl::OkStatus();
}

// Tells the scheduler the export is alive: it writes no source bytes, but a long one (a large
// tokenizer, a slow disk, 64 shard headers) must not look hung and lose its lease.
void Heartbeat(const StageContext& ctx) {
  if (ctx.add_progress) ctx.add_progress(0);
}

// Writes the index of the shards beneath `dir` and lists it in *written.
absl::Status WriteIndex(const checkpoint::DirHandle& dir, const checkpoint::ShardIndex& index,
                        std::vector<Written>* written) {
  absl::StatusOr<std::string> text =
      checkpoint::ShardIndexText(dir.PathOf(checkpoint::kIndexFileName), index);
  if (!text.ok()) return text.status();
  return WriteText(dir, checkpoint::kIndexFileName, *text, written);
}

// Copies the open regular file `in` (closed here; `src` names it in errors) to `name` beneath
// `dst_dir` byte for byte through name.tmp (fsync + rename), with a heartbeat per chunk.
absl::Status CopyFile(const StageContext& ctx, int in, const std::string& src,
                      const checkpoint::DirHandle& dst_dir, const std::string& name,
                      std::vector<Written>* written) {
  const std::string tmp_name = name + ".tmp";
  const std::string tmp = dst_dir.PathOf(tmp_name);
  absl::StatusOr<int> out = dst_dir.CreateForWrite(tmp_name);
  if (!out.ok()) {
    close(in);
    return out.status();
  }
  checkpoint::Sha256 hash;
  std::vector<char> buffer(kCopyChunk);
  uint64_t total = 0;
  absl::Status status;
  while (status.ok()) {
    const ssize_t n = read(in, buffer.data(), buffer.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      status = absl::UnavailableError(absl::StrCat("cannot read ", src, ": ", strerror(errno)));
    } else if (n == 0) {
      break;
    } else {
      hash.Update(buffer.data(), static_cast<size_t>(n));
      total += static_cast<uint64_t>(n);
      status = checkpoint::WriteFully(*out, buffer.data(), static_cast<uint64_t>(n), tmp);
      Heartbeat(ctx);
    }
  }
  close(in);
  absl::Status closed = checkpoint::SyncAndClose(*out, tmp);
  if (status.ok()) status = closed;
  if (status.ok()) status = dst_dir.Rename(tmp_name, name);
  if (!status.ok()) {
    dst_dir.Remove(tmp_name).IgnoreError();
    return status;
  }
  written->push_back({name, total, hash.HexDigest()});
  return absl::OkStatus();
}

// Files of the source that the export does not copy: weights, the index, and what it rewrites.
bool SkippedSourceFile(const std::string& name, bool top_level) {
  if (absl::StartsWith(name, ".") || name == "__pycache__") return true;
  if (absl::EndsWith(name, ".safetensors") || name == checkpoint::kIndexFileName) return true;
  return top_level && (name == kConfigName || name == kHfQuantConfigName || name == kManifestName);
}

// Where the symlink `rel` of the source leads, as a path beneath the source directory, when it
// resolves to a file inside it; nullopt otherwise: a symlink out of the source would copy a file
// the caller may not be able to read (the daemon may run as root), so it is never followed. The
// source directory is the path resolved at submit (src.path()), never resolved again; the file is
// then opened beneath the source's handle without following any link, so whatever the link says
// by the time it is read, nothing outside the directory the job opened is copied.
std::optional<std::string> LinkTargetBeneath(const checkpoint::DirHandle& src,
                                             const std::string& rel) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path target = fs::canonical(src.PathOf(rel), ec);
  const fs::path root(src.path());
  if (ec) return std::nullopt;
  const auto [r, t] = std::mismatch(root.begin(), root.end(), target.begin(), target.end());
  if (r != root.end() || t == target.end()) return std::nullopt;
  return target.lexically_relative(root).string();
}

// Copies every other regular file of the source tree (tokenizer, generation config, code, docs)
// to the same relative name beneath `dst_dir`: files listed and opened beneath the source's
// handle `src`, symlinks only to files inside it (LinkTargetBeneath); symlinked directories are
// not entered.
absl::Status CopySourceFiles(const StageContext& ctx, const checkpoint::DirHandle& src,
                             const checkpoint::DirHandle& dst_dir, const std::string& rel,
                             int depth, std::vector<Written>* written) {
  absl::StatusOr<std::vector<checkpoint::DirEntry>> entries = src.List(rel);
  if (!entries.ok()) return entries.status();
  for (const checkpoint::DirEntry& e : *entries) {
    if (ctx.cancelled != nullptr && ctx.cancelled->load()) {
      return absl::CancelledError("export cancelled");
    }
    if (SkippedSourceFile(e.name, depth == 0)) continue;
    const std::string rel_name = rel.empty() ? e.name : absl::StrCat(rel, "/", e.name);
    if (e.type == S_IFDIR) {
      if (depth >= 8) continue;  // nothing a model repository holds
      if (absl::Status s = dst_dir.MakeDirs(rel_name); !s.ok()) return s;
      absl::Status s = CopySourceFiles(ctx, src, dst_dir, rel_name, depth + 1, written);
      if (!s.ok()) return s;
      continue;
    }
    std::optional<std::string> file;
    if (e.type == S_IFREG) {
      file = rel_name;
    } else if (e.type == S_IFLNK) {
      file = LinkTargetBeneath(src, rel_name);
    }
    if (!file.has_value()) continue;
    struct stat st;
    absl::StatusOr<int> in = src.OpenRegularFile(*file, &st);
    if (!in.ok()) {
      // A link to a directory, or to a file that is not regular: not copied, as before.
      if (e.type == S_IFLNK && absl::IsInvalidArgument(in.status())) continue;
      return in.status();
    }
    absl::Status s = CopyFile(ctx, *in, src.PathOf(*file), dst_dir, rel_name, written);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

// model.safetensors.index.json from the output shards' headers, read beneath the directory's
// handle (never through its path again), with a heartbeat per shard.
absl::StatusOr<checkpoint::ShardIndex> OutputIndex(const StageContext& ctx,
                                                   const checkpoint::DirHandle& dir,
                                                   const std::vector<std::string>& shards) {
  checkpoint::ShardIndex index;
  for (const std::string& shard : shards) {
    Heartbeat(ctx);
    absl::StatusOr<std::unique_ptr<checkpoint::SafetensorsFile>> f =
        checkpoint::SafetensorsFile::Open(dir, shard);
    if (!f.ok()) return f.status();
    for (const checkpoint::TensorView& v : (*f)->tensors()) {
      auto [it, inserted] = index.weight_map.emplace(v.name, shard);
      if (!inserted) {
        return absl::DataLossError(absl::StrCat("tensor ", v.name, " is in both output shards ",
                                                it->second, " and ", shard));
      }
      index.total_size += v.size;
    }
  }
  return index;
}

// Writes quantd_manifest.json beneath `dir` (output_manifest.h): the output files the task wrote
// (`written`, but for the BF16 copy's) and the shards as their quantize tasks recorded them.
absl::Status WriteManifest(const StageContext& ctx, const checkpoint::DirHandle& dir,
                           const std::vector<std::string>& shards, std::vector<Written>* written) {
  std::vector<ManifestEntry> files;
  for (const Written& w : *written) {
    if (!absl::StartsWith(w.name, "bf16/")) files.push_back({w.name, w.bytes, w.sha256});
  }
  for (const std::string& shard : shards) {
    const std::optional<RecordedOutput> recorded =
        ctx.recorded_output ? ctx.recorded_output(QuantizeStage::kKind, shard) : std::nullopt;
    if (!recorded.has_value()) {
      return absl::FailedPreconditionError(
          absl::StrCat(dir.PathOf(shard), ": the quantize task of ", shard, " recorded no output"));
    }
    files.push_back({shard, static_cast<uint64_t>(recorded->bytes), recorded->sha256});
  }
  return WriteText(dir, kManifestName, ManifestText(std::move(files)), written);
}

// "layers.3.attn.wq_a" -> "layers.*.attn.wq_a": every all-digit name component becomes '*'.
std::string DigitsToStar(const std::string& name) {
  std::vector<std::string> parts = absl::StrSplit(name, '.');
  for (std::string& p : parts) {
    if (!p.empty() && std::all_of(p.begin(), p.end(), absl::ascii_isdigit)) p = "*";
  }
  return absl::StrJoin(parts, ".");
}

// The exclude entries for the modules left in source format (see the file comment).
absl::StatusOr<std::vector<std::string>> ExcludeEntries(const Recipe& recipe,
                                                        const TensorInventory& inventory,
                                                        const std::set<std::string>& quantized,
                                                        bool cover_every_module) {
  std::vector<std::string> left;
  for (const LinearModule& m : inventory.linears) {
    if (quantized.count(m.name) == 0) left.push_back(m.name);
  }
  const auto hits_quantized = [&](const std::string& entry) {
    for (const std::string& q : quantized) {
      if (ModelOptExcludeMatches(entry, q)) return true;
    }
    return false;
  };
  const auto covered = [](const std::vector<std::string>& entries, const std::string& m) {
    for (const std::string& e : entries) {
      if (ModelOptExcludeMatches(e, m)) return true;
    }
    return false;
  };
  std::vector<std::string> entries;
  for (const RecipeRule& rule : recipe.rules) {
    if (rule.include || std::find(entries.begin(), entries.end(), rule.glob) != entries.end()) {
      continue;
    }
    if (hits_quantized(rule.glob)) continue;
    bool used = false;
    for (const std::string& m : left) used = used || ModelOptExcludeMatches(rule.glob, m);
    if (used) entries.push_back(rule.glob);
  }
  if (!cover_every_module) return entries;
  for (const std::string& m : left) {
    if (covered(entries, m)) continue;
    const std::string pattern = DigitsToStar(m);
    if (pattern != m && !hits_quantized(pattern)) {
      entries.push_back(pattern);
    } else if (!hits_quantized(m)) {
      entries.push_back(m);
    } else {
      return absl::FailedPreconditionError(absl::StrCat(
          "module ", m, " stays in its source format, but every exclude_modules entry that "
          "names it also matches a quantized module (readers match entries as substrings)"));
    }
  }
  return entries;
}

// A glob as a compressed-tensors ignore entry: exact names stay, globs become "re:" regexes
// anchored at both ends (compressed-tensors applies re.match, which anchors only the start).
std::string CompressedTensorsIgnoreEntry(const std::string& glob) {
  if (glob.find_first_of("*?") == std::string::npos) return glob;
  std::string re = "re:";
  for (char c : glob) {
    if (c == '*') {
      re += ".*";
    } else if (c == '?') {
      re += '.';
    } else {
      if (std::string("\\^$.|+()[]{}").find(c) != std::string::npos) re += '\\';
      re += c;
    }
  }
  return re + "$";
}

// "layers.3.ffn.experts.7.w1" -> "layers.3.ffn.experts" (NVIDIA's quantized_layers key).
std::string ExpertsPrefix(const std::string& module) {
  const size_t at = module.find(kExpertsInfix);
  return module.substr(0, at + strlen(kExpertsInfix) - 1);
}

// ModelOpt's config group for NVFP4 weights (and activations unless weights only).
json ModelOptConfigGroups(bool w4a4) {
  json group = {{"weights", {{"dynamic", false}, {"num_bits", 4}, {"type", "float"},
                             {"group_size", 16}}},
                {"targets", {"Linear"}}};
  if (w4a4) {
    group["input_activations"] = {{"dynamic", false}, {"num_bits", 4}, {"type", "float"},
                                  {"group_size", 16}};
  }
  return {{"group_0", group}};
}

const json& Fp8KvCacheScheme() {
  static const json kScheme = {{"dynamic", false}, {"num_bits", 8}, {"type", "float"}};
  return kScheme;
}

json CompressedTensorsConfig(bool w4a4, bool fp8_kv, const std::vector<std::string>& excludes) {
  const json args = {{"num_bits", 4},        {"type", "float"},   {"strategy", "tensor_group"},
                     {"group_size", 16},     {"symmetric", true}, {"dynamic", false},
                     {"observer", "static_minmax"}};
  json group = {{"format", "nvfp4-pack-quantized"}, {"targets", {"Linear"}}, {"weights", args}};
  if (w4a4) {
    json input = args;
    input["dynamic"] = "local";
    group["input_activations"] = input;
  }
  json ignore = json::array();
  for (const std::string& e : excludes) ignore.push_back(CompressedTensorsIgnoreEntry(e));
  json kv = nullptr;
  if (fp8_kv) {
    kv = {{"num_bits", 8}, {"type", "float"}, {"strategy", "tensor"}, {"dynamic", false},
          {"symmetric", true}};
  }
  return {{"quant_method", "compressed-tensors"},
          {"format", "nvfp4-pack-quantized"},
          {"quantization_status", "compressed"},
          {"config_groups", {{"group_0", group}}},
          {"ignore", ignore},
          {"kv_cache_scheme", kv}};
}

}  // namespace

// The BF16 copy (materialize_bf16) becomes a complete unquantized checkpoint: its index, the
// source config.json without quantization_config, and the source's other files. Its files are
// listed in the task's checksum under "bf16/".
absl::Status ExportBf16Copy(const StageContext& ctx, const Plan& plan,
                            std::vector<Written>* written) {
  if (ctx.materialize_bf16_dir == nullptr) {
    return absl::InternalError("materialize_bf16: the job's directory is not open");
  }
  const checkpoint::DirHandle& dir = *ctx.materialize_bf16_dir;
  std::vector<std::string> shards;
  for (const store::StagePlan& stage : plan.stages) {
    if (stage.kind != DequantStage::kKind) continue;
    for (const store::TaskPlan& t : stage.tasks) shards.push_back(t.name);
  }
  absl::StatusOr<checkpoint::ShardIndex> index = OutputIndex(ctx, dir, shards);
  if (!index.ok()) return index.status();
  std::vector<Written> bf16;
  absl::Status s = WriteIndex(dir, *index, &bf16);
  if (!s.ok()) return s;
  json config = ctx.source->config();
  config.erase("quantization_config");
  s = WriteText(dir, kConfigName, config.dump(2) + "\n", &bf16);
  if (!s.ok()) return s;
  s = CopySourceFiles(ctx, *ctx.source_dir, dir, "", 0, &bf16);
  if (!s.ok()) return s;
  for (Written& w : bf16) written->push_back({absl::StrCat("bf16/", w.name), w.bytes, w.sha256});
  return absl::OkStatus();
}

absl::StatusOr<std::vector<store::TaskPlan>> ExportStage::Plan(const PlanInput& input) const {
  std::vector<store::TaskRef> after;
  for (const OutputShard& shard : input.output_shards) {
    after.push_back({std::string(QuantizeStage::kKind), shard.task.shard});
  }
  if (!input.spec->materialize_bf16.empty()) {
    for (const auto& [shard, bytes] : input.source_shards) {
      after.push_back({std::string(DequantStage::kKind), shard});
    }
  }
  return std::vector<store::TaskPlan>{
      {std::string(kKind), "{}", 0, "", {}, std::move(after)}};
}

absl::StatusOr<TaskOutput> ExportStage::Run(const store::TaskRow&, compute::Device&,
                                            const StageContext& ctx) const {
  return RunExportTask(ctx, *ctx.plan);
}

absl::StatusOr<TaskOutput> RunExportTask(const StageContext& ctx, const Plan& plan) {
  const JobSpec& spec = *ctx.spec;
  const TensorInventory& inventory = *ctx.inventory;
  if (ctx.output_dir == nullptr || ctx.source_dir == nullptr) {
    return absl::InternalError("output, source: the job's directories are not open");
  }
  const checkpoint::DirHandle& out = *ctx.output_dir;
  const std::string& out_dir = out.path();
  std::vector<Written> written;

  // The index, from the shards the quantize stage wrote.
  std::vector<std::string> shards;
  for (const store::StagePlan& stage : plan.stages) {
    if (stage.kind != QuantizeStage::kKind) continue;
    for (const store::TaskPlan& t : stage.tasks) shards.push_back(t.name);
  }
  absl::StatusOr<checkpoint::ShardIndex> index = OutputIndex(ctx, out, shards);
  if (!index.ok()) return index.status();
  absl::Status s = WriteIndex(out, *index, &written);
  if (!s.ok()) return s;

  // What the configs describe.
  const std::set<std::string> quantized(plan.recipe.modules.begin(), plan.recipe.modules.end());
  const bool w4a4 = spec.weight_format == WeightFormat::kNvfp4;
  const std::string algo = w4a4 ? "NVFP4" : "W4A16_NVFP4";
  const bool fp8_kv = spec.kv_cache != KvCache::kNone;
  const json& source_config = ctx.source->config();
  const ExportLayout layout = ChooseExportLayout(spec, inventory, source_config, quantized);

  absl::StatusOr<Recipe> recipe = RecipeForSpec(spec, inventory);
  if (!recipe.ok()) return recipe.status();
  absl::StatusOr<std::vector<std::string>> excludes =
      ExcludeEntries(*recipe, inventory, quantized, layout != ExportLayout::kModelOptMixed);
  if (!excludes.ok()) return excludes.status();

  const ordered_json producer = {{"name", "quantd"}};
  json config = source_config;
  if (layout == ExportLayout::kCompressedTensors) {
    config["quantization_config"] = CompressedTensorsConfig(w4a4, fp8_kv, *excludes);
    // A ModelOpt description left by an earlier export of this directory would mislead readers.
    if (absl::Status removed = out.Remove(kHfQuantConfigName);
        !removed.ok() && !absl::IsNotFound(removed)) {
      return removed;
    }
  } else {
    ordered_json quantization = {{"quant_algo", layout == ExportLayout::kModelOptMixed
                                                    ? std::string("MIXED_PRECISION")
                                                    : algo},
                                 {"kv_cache_quant_algo", fp8_kv ? ordered_json("FP8") : nullptr},
                                 {"group_size", 16}};
    // Keys sorted, entries {quant_algo, group_size}, as NVIDIA's quantize_to_nvfp4.py writes them.
    ordered_json quantized_layers = ordered_json::object();
    if (layout == ExportLayout::kModelOptMixed) {
      std::set<std::string> prefixes;
      for (const std::string& m : quantized) prefixes.insert(ExpertsPrefix(m));
      for (const std::string& p : prefixes) {
        quantized_layers[p] = {{"quant_algo", algo}, {"group_size", 16}};
      }
      quantization["quantized_layers"] = quantized_layers;
    }
    quantization["exclude_modules"] = *excludes;
    const ordered_json hf = {{"producer", producer}, {"quantization", quantization}};
    s = WriteText(out, kHfQuantConfigName, hf.dump(2) + "\n", &written);
    if (!s.ok()) return s;

    json qc;
    if (layout == ExportLayout::kModelOptMixed) {
      qc = source_config["quantization_config"];  // the mixed layout implies it is there
      if (!qc.contains("activation_scheme")) qc["activation_scheme"] = "dynamic";
      if (!qc.contains("weight_block_size")) qc["weight_block_size"] = {128, 128};
      qc["quant_method"] = "fp8";
      qc["moe_quant_algo"] = algo;
      qc["quant_algo"] = "MIXED_PRECISION";
      qc["kv_cache_quant_algo"] = fp8_kv ? json("FP8") : json(nullptr);
      qc["group_size"] = 16;
      qc["quantized_layers"] = json(quantized_layers);
      qc["exclude_modules"] = *excludes;
    } else {
      qc["quant_algo"] = algo;
      qc["quant_method"] = "modelopt";
    }
    qc["config_groups"] = ModelOptConfigGroups(w4a4);
    qc["ignore"] = *excludes;
    qc["producer"] = json(producer);
    if (fp8_kv) qc["kv_cache_scheme"] = Fp8KvCacheScheme();
    config["quantization_config"] = qc;
  }
  s = WriteText(out, kConfigName, config.dump(2) + "\n", &written);
  if (!s.ok()) return s;

  s = CopySourceFiles(ctx, *ctx.source_dir, out, "", 0, &written);
  if (!s.ok()) return s;
  if (!spec.materialize_bf16.empty()) {
    s = ExportBf16Copy(ctx, plan, &written);
    if (!s.ok()) return s;
  }

  s = WriteManifest(ctx, out, shards, &written);
  if (!s.ok()) return s;

  // The task's checksum covers every file it wrote: SHA-256 over "name\tbytes\tsha256\n" lines.
  std::sort(written.begin(), written.end(),
            [](const Written& a, const Written& b) { return a.name < b.name; });
  TaskOutput output;
  output.path = out_dir;
  std::string manifest;
  for (const Written& w : written) {
    output.bytes += w.bytes;
    absl::StrAppend(&manifest, w.name, "\t", w.bytes, "\t", w.sha256, "\n");
  }
  output.sha256 = Sha256Of(manifest);
  return output;
}

}  // namespace quantd::pipeline
