#include "server/pipeline/inspect.h"

#include <filesystem>
#include <memory>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/checkpoint/checkpoint_dir.h"
#include "server/checkpoint/tensor_inventory.h"
#include "server/pipeline/recipe.h"

namespace quantd::pipeline {

using checkpoint::ArchName;
using checkpoint::BuildInventory;
using checkpoint::FormatName;
using checkpoint::LinearModule;
using checkpoint::TensorInfo;
using checkpoint::TensorInventory;

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// A checkpoint directory has config.json or at least one .safetensors file.
absl::Status CheckLooksLikeCheckpoint(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return absl::NotFoundError(absl::StrCat(dir, ": not a directory"));
  }
  if (fs::exists(fs::path(dir) / "config.json", ec)) return absl::OkStatus();
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (absl::EndsWith(it->path().filename().string(), ".safetensors")) return absl::OkStatus();
  }
  return absl::NotFoundError(absl::StrCat(
      dir, ": not a checkpoint directory (no config.json and no .safetensors files)"));
}

void Count(json& table, const std::string& key, uint64_t bytes) {
  json& row = table[key];
  if (row.is_null()) row = {{"tensors", 0}, {"bytes", 0}};
  row["tensors"] = row["tensors"].get<uint64_t>() + 1;
  row["bytes"] = row["bytes"].get<uint64_t>() + bytes;
}

json RecipeReport(const std::string& name, const TensorInventory& inv) {
  absl::StatusOr<Recipe> recipe = BuiltinRecipe(name, inv);
  if (!recipe.ok()) return {{"error", std::string(recipe.status().message())}};
  absl::StatusOr<RecipePlan> plan = PlanRecipe(inv, *recipe);
  if (!plan.ok()) return {{"error", std::string(plan.status().message())}};
  return {{"modules", plan->modules.size()},
          {"bytes", plan->bytes},
          {"fusion_groups", plan->fusion_groups.size()},
          {"excluded", plan->excluded}};
}

std::string Bytes(uint64_t b) {
  if (b >= (1ull << 30)) return absl::StrFormat("%.2f GiB", static_cast<double>(b) / (1ull << 30));
  if (b >= (1ull << 20)) return absl::StrFormat("%.2f MiB", static_cast<double>(b) / (1ull << 20));
  if (b >= (1ull << 10)) return absl::StrFormat("%.2f KiB", static_cast<double>(b) / (1ull << 10));
  return absl::StrFormat("%d B", b);
}

// Rows of a {key -> {tensors, bytes}} table.
void AppendCountTable(std::string& out, const std::string& title, const json& table) {
  absl::StrAppendFormat(&out, "\n%-28s %10s %16s\n", title, "tensors", "bytes");
  for (const auto& [key, row] : table.items()) {
    const uint64_t bytes = row.at("bytes").get<uint64_t>();
    absl::StrAppendFormat(&out, "  %-26s %10d %16d  %s\n", key, row.at("tensors").get<uint64_t>(),
                          bytes, Bytes(bytes));
  }
}

}  // namespace

absl::StatusOr<json> InspectCheckpoint(const std::string& dir) {
  if (absl::Status s = CheckLooksLikeCheckpoint(dir); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<checkpoint::CheckpointDir>> ckpt =
      checkpoint::CheckpointDir::Open(dir);
  if (!ckpt.ok()) return ckpt.status();
  absl::StatusOr<TensorInventory> inv = BuildInventory(**ckpt);
  if (!inv.ok()) return inv.status();

  json report = {{"dir", dir}, {"model_type", inv->model_type}, {"arch", ArchName(inv->arch)}};
  json shards = json::array();
  uint64_t file_bytes = 0;
  for (const auto& shard : (*ckpt)->shards()) {
    const std::string& path = shard->path();
    shards.push_back({{"name", path.substr(path.rfind('/') + 1)},
                      {"bytes", shard->file_size()},
                      {"tensors", shard->tensors().size()}});
    file_bytes += shard->file_size();
  }
  json by_dtype = json::object(), by_format = json::object(), linear = json::object();
  uint64_t tensor_bytes = 0;
  for (const TensorInfo& t : inv->tensors) {
    Count(by_dtype, std::string(checkpoint::DtypeName(t.dtype)), t.bytes);
    Count(by_format, FormatName(t.format), t.bytes);
    tensor_bytes += t.bytes;
  }
  for (const LinearModule& m : inv->linears) {
    json& n = linear[FormatName(m.format)];
    n = n.is_null() ? 1 : n.get<int64_t>() + 1;
  }
  report["shards"] = std::move(shards);
  report["tensors"] = inv->tensors.size();
  report["tensor_bytes"] = tensor_bytes;
  report["file_bytes"] = file_bytes;
  report["by_dtype"] = std::move(by_dtype);
  report["by_format"] = std::move(by_format);
  report["linear_modules"] = std::move(linear);
  report["recipes"] = {{"experts", RecipeReport("experts", *inv)},
                       {"full", RecipeReport("full", *inv)}};
  return report;
}

std::string FormatInspectReport(const json& r) {
  std::string out;
  absl::StrAppendFormat(&out, "checkpoint  %s\n", r.at("dir").get<std::string>());
  absl::StrAppendFormat(&out, "model_type  %s (arch %s)\n", r.at("model_type").get<std::string>(),
                        r.at("arch").get<std::string>());
  const uint64_t tensor_bytes = r.at("tensor_bytes").get<uint64_t>();
  const uint64_t file_bytes = r.at("file_bytes").get<uint64_t>();
  absl::StrAppendFormat(&out, "tensors     %d, %d bytes of data (%s), %d bytes in files (%s)\n",
                        r.at("tensors").get<uint64_t>(), tensor_bytes, Bytes(tensor_bytes),
                        file_bytes, Bytes(file_bytes));

  absl::StrAppendFormat(&out, "\n%-36s %10s %16s\n", "shard", "tensors", "bytes");
  for (const json& s : r.at("shards")) {
    const uint64_t bytes = s.at("bytes").get<uint64_t>();
    absl::StrAppendFormat(&out, "  %-34s %10d %16d  %s\n", s.at("name").get<std::string>(),
                          s.at("tensors").get<uint64_t>(), bytes, Bytes(bytes));
  }
  AppendCountTable(out, "by dtype", r.at("by_dtype"));
  AppendCountTable(out, "by format", r.at("by_format"));

  absl::StrAppendFormat(&out, "\n%-28s %10s\n", "linear modules by format", "modules");
  for (const auto& [format, n] : r.at("linear_modules").items()) {
    absl::StrAppendFormat(&out, "  %-26s %10d\n", format, n.get<int64_t>());
  }

  out += "\nrecipes\n";
  for (const auto& [name, rec] : r.at("recipes").items()) {
    if (rec.contains("error")) {
      absl::StrAppendFormat(&out, "  %-8s not applicable: %s\n", name,
                            rec.at("error").get<std::string>());
      continue;
    }
    const uint64_t bytes = rec.at("bytes").get<uint64_t>();
    absl::StrAppendFormat(&out, "  %-8s quantizes %d modules, %d bytes (%s), %d fusion groups\n",
                          name, rec.at("modules").get<uint64_t>(), bytes, Bytes(bytes),
                          rec.at("fusion_groups").get<uint64_t>());
    std::string excluded;
    for (const auto& [reason, n] : rec.at("excluded").items()) {
      absl::StrAppendFormat(&excluded, "%s%s %d", excluded.empty() ? "" : ", ", reason,
                            n.get<int64_t>());
    }
    absl::StrAppendFormat(&out, "           leaves alone: %s\n",
                          excluded.empty() ? std::string("nothing") : excluded);
  }
  return out;
}

}  // namespace quantd::pipeline
