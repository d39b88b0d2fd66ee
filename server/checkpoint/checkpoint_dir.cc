#include "server/checkpoint/checkpoint_dir.h"

#include <sys/stat.h>

#include <functional>
#include <set>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "server/base/excerpt.h"
#include "server/base/status_macros.h"
#include "server/checkpoint/atomic_file.h"
#include "server/checkpoint/json_file.h"

namespace quantd::checkpoint {
namespace {

using nlohmann::json;

constexpr char kSingleFileName[] = "model.safetensors";
constexpr char kConfigFileName[] = "config.json";

absl::Status Invalid(const std::string& path, absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", message));
}

// A shard must be a file in the checkpoint directory itself.
bool IsPlainFileName(const std::string& name) {
  return !name.empty() && name != "." && name != ".." &&
         name.find('/') == std::string::npos && name.find('\0') == std::string::npos;
}

bool FileExists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

// The index parsed from `root`, the JSON of the file `path`.
absl::StatusOr<ShardIndex> ShardIndexOf(const std::string& path, absl::StatusOr<json> root) {
  if (!root.ok()) return root.status();
  if (!root->is_object()) return Invalid(path, "not a JSON object");

  ShardIndex index;
  auto metadata = root->find("metadata");
  if (metadata != root->end() && !metadata->is_null()) {
    if (!metadata->is_object()) return Invalid(path, "\"metadata\" is not an object");
    auto total = metadata->find("total_size");
    if (total != metadata->end()) {
      if (!total->is_number_unsigned()) {
        return Invalid(path, "metadata.total_size is not a non-negative integer");
      }
      index.total_size = total->get<uint64_t>();
    }
  }

  auto weight_map = root->find("weight_map");
  if (weight_map == root->end() || !weight_map->is_object()) {
    return Invalid(path, "\"weight_map\" is missing or not an object");
  }
  for (auto it = weight_map->begin(); it != weight_map->end(); ++it) {
    if (!it->is_string()) {
      return Invalid(
          path, absl::StrCat("weight_map entry for ", base::Excerpt(it.key()), " is not a string"));
    }
    const std::string& shard = it->get_ref<const std::string&>();
    if (!IsPlainFileName(shard)) {
      return Invalid(path, absl::StrCat("tensor ", base::Excerpt(it.key()), " maps to shard ",
                                        base::Excerpt(shard), ", which is not a plain file name"));
    }
    index.weight_map[it.key()] = shard;
  }
  return index;
}

}  // namespace

// How CheckpointDir::Open reaches the files of the directory, by name.
struct CheckpointDir::Files {
  std::function<bool(const std::string& name)> exists;
  std::function<absl::StatusOr<json>(const std::string& name, uint64_t max_bytes)> read_json;
  std::function<absl::StatusOr<std::unique_ptr<SafetensorsFile>>(const std::string& name)> open;
};

absl::StatusOr<ShardIndex> ParseShardIndex(const std::string& path, const SourceRoots& roots) {
  return ShardIndexOf(path, ReadJsonFile(path, kMaxIndexFileBytes, roots));
}

absl::Status WriteShardIndex(const std::string& path, const ShardIndex& index) {
  absl::StatusOr<std::string> text = ShardIndexText(path, index);
  if (!text.ok()) return text.status();
  return WriteFileAtomically(path, *text);
}

absl::StatusOr<std::string> ShardIndexText(const std::string& path, const ShardIndex& index) {
  for (const auto& [tensor, shard] : index.weight_map) {
    if (!IsPlainFileName(shard)) {
      return Invalid(path, absl::StrCat("tensor ", base::Excerpt(tensor), " maps to shard ",
                                        base::Excerpt(shard), ", which is not a plain file name"));
    }
  }
  json root = {{"metadata", {{"total_size", index.total_size}}},
               {"weight_map", index.weight_map}};
  std::string text;
  try {
    text = root.dump(2) + "\n";
  } catch (const json::exception& e) {
    return Invalid(path, absl::StrCat("cannot serialize index: ", e.what()));
  }
  return text;
}

absl::StatusOr<std::unique_ptr<CheckpointDir>> CheckpointDir::Open(const std::string& dir,
                                                                   const SourceRoots& roots) {
  const auto path = [&dir](const std::string& name) { return absl::StrCat(dir, "/", name); };
  Files files;
  files.exists = [&](const std::string& name) { return FileExists(path(name)); };
  files.read_json = [&](const std::string& name, uint64_t max_bytes) {
    return ReadJsonFile(path(name), max_bytes, roots);
  };
  files.open = [&](const std::string& name) { return SafetensorsFile::Open(path(name), roots); };
  return OpenFiles(dir, files);
}

absl::StatusOr<std::unique_ptr<CheckpointDir>> CheckpointDir::Open(const DirHandle& dir) {
  Files files;
  files.exists = [&](const std::string& name) { return dir.Stat(name).ok(); };
  files.read_json = [&](const std::string& name,
                        uint64_t max_bytes) -> absl::StatusOr<json> {
    struct stat st;
    ASSIGN_OR_RETURN(const int fd, dir.OpenRegularFile(name, &st));
    ASSIGN_OR_RETURN(const std::string text, ReadOpenedFile(dir.PathOf(name), fd, st, max_bytes));
    return ParseJsonText(text, dir.PathOf(name));
  };
  files.open = [&](const std::string& name) { return SafetensorsFile::Open(dir, name); };
  return OpenFiles(dir.path(), files);
}

absl::StatusOr<std::unique_ptr<CheckpointDir>> CheckpointDir::OpenFiles(const std::string& dir,
                                                                        const Files& files) {
  std::unique_ptr<CheckpointDir> checkpoint(new CheckpointDir());
  checkpoint->dir_ = dir;

  std::string config_path = absl::StrCat(dir, "/", kConfigFileName);
  if (files.exists(kConfigFileName)) {
    absl::StatusOr<json> config = files.read_json(kConfigFileName, kMaxConfigFileBytes);
    if (!config.ok()) return config.status();
    if (!config->is_object()) return Invalid(config_path, "not a JSON object");
    checkpoint->config_ = std::make_unique<json>(std::move(*config));
  } else {
    checkpoint->config_ = std::make_unique<json>(json::object());
  }

  std::string index_path = absl::StrCat(dir, "/", kIndexFileName);
  const bool indexed = files.exists(kIndexFileName);
  std::map<std::string, std::string> weight_map;  // empty for a single-file checkpoint
  std::set<std::string> shard_names;
  if (indexed) {
    absl::StatusOr<ShardIndex> index =
        ShardIndexOf(index_path, files.read_json(kIndexFileName, kMaxIndexFileBytes));
    if (!index.ok()) return index.status();
    weight_map = std::move(index->weight_map);
    for (const auto& [tensor, shard] : weight_map) shard_names.insert(shard);
  } else if (files.exists(kSingleFileName)) {
    shard_names.insert(kSingleFileName);
  } else {
    return absl::NotFoundError(absl::StrCat(dir, ": not a checkpoint directory: neither ",
                                            kIndexFileName, " nor ", kSingleFileName, " found"));
  }

  for (const std::string& shard : shard_names) {
    std::string shard_path = absl::StrCat(dir, "/", shard);
    if (indexed && !files.exists(shard)) {
      // The path too, unless the name had to be cut or escaped.
      const std::string quoted = base::Excerpt(shard);
      return absl::NotFoundError(absl::StrCat(
          index_path, ": shard ", quoted, " is missing",
          quoted == absl::StrCat("\"", shard, "\"") ? absl::StrCat(" (", shard_path, ")") : ""));
    }
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = files.open(shard);
    if (!file.ok()) return file.status();
    size_t shard_index = checkpoint->shards_.size();
    for (const TensorView& view : (*file)->tensors()) {
      auto [it, inserted] =
          checkpoint->tensors_.emplace(view.name, std::make_pair(shard_index, &view));
      if (!inserted) {
        return Invalid(shard_path, absl::StrCat("tensor ", base::Excerpt(view.name), " is also in ",
                                                checkpoint->shards_[it->second.first]->path()));
      }
      if (indexed) {
        auto listed = weight_map.find(view.name);
        if (listed == weight_map.end() || listed->second != shard) {
          return Invalid(
              index_path,
              absl::StrCat("tensor ", base::Excerpt(view.name), " is in shard ",
                           base::Excerpt(shard), " but the index ",
                           listed == weight_map.end()
                               ? std::string("does not list it")
                               : absl::StrCat("maps it to ", base::Excerpt(listed->second))));
        }
      }
    }
    checkpoint->shards_.push_back(std::move(*file));
  }

  for (const auto& [tensor, shard] : weight_map) {
    if (!checkpoint->tensors_.count(tensor)) {
      return Invalid(index_path,
                     absl::StrCat("tensor ", base::Excerpt(tensor), " is listed in shard ",
                                  base::Excerpt(shard), " but absent from it"));
    }
  }
  return checkpoint;
}

CheckpointDir::~CheckpointDir() = default;

absl::Status CheckpointDir::CheckIntact() const {
  for (const std::unique_ptr<SafetensorsFile>& shard : shards_) {
    if (absl::Status s = shard->CheckIntact(); !s.ok()) return s;
  }
  return absl::OkStatus();
}

const nlohmann::json& CheckpointDir::config() const { return *config_; }

const TensorView* CheckpointDir::Find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : it->second.second;
}

const SafetensorsFile* CheckpointDir::ShardOf(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : shards_[it->second.first].get();
}

}  // namespace quantd::checkpoint
