// A Hugging Face checkpoint directory: config.json plus either model.safetensors.index.json and
// its shards, or a single model.safetensors.
#ifndef QUANTD_SERVER_CHECKPOINT_CHECKPOINT_DIR_H_
#define QUANTD_SERVER_CHECKPOINT_CHECKPOINT_DIR_H_

#include <stdint.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nlohmann/json_fwd.hpp"
#include "server/checkpoint/dir_handle.h"
#include "server/checkpoint/safetensors_reader.h"
#include "server/checkpoint/source_roots.h"

namespace quantd::checkpoint {

inline constexpr char kIndexFileName[] = "model.safetensors.index.json";
// Size caps of the JSON files a checkpoint holds (a DeepSeek-V4 index is ~10 MB, its config a few
// KB); larger files are refused before they are read.
inline constexpr uint64_t kMaxIndexFileBytes = 64ull << 20;
inline constexpr uint64_t kMaxConfigFileBytes = 16ull << 20;

// model.safetensors.index.json: tensor -> shard file name, plus metadata.total_size.
struct ShardIndex {
  std::map<std::string, std::string> weight_map;  // tensor name -> shard file name
  uint64_t total_size = 0;                        // sum of tensor bytes over all shards
};

// Parses and validates an index (shard names must be plain file names, no paths); at most
// kMaxIndexFileBytes.
absl::StatusOr<ShardIndex> ParseShardIndex(const std::string& path,
                                           const SourceRoots& roots = std::nullopt);
// Writes the index atomically (tmp + fsync + rename).
absl::Status WriteShardIndex(const std::string& path, const ShardIndex& index);
// The text WriteShardIndex writes; `path` names the file in errors.
absl::StatusOr<std::string> ShardIndexText(const std::string& path, const ShardIndex& index);

class CheckpointDir {
 public:
  // Opens every shard (mmap) and checks that the index and the shards agree: every indexed shard
  // exists, every indexed tensor is in its shard, no tensor appears in two shards. config.json,
  // the index and every shard must resolve inside `roots` (source_roots.h: a job's source;
  // PermissionDenied naming "source" and the file otherwise).
  static absl::StatusOr<std::unique_ptr<CheckpointDir>> Open(const std::string& dir,
                                                             const SourceRoots& roots = std::nullopt);
  // The same checks, every file opened beneath `dir` (DirHandle::OpenRegularFile: no symbolic
  // link followed, nothing outside the directory the handle holds): a job's own output read back.
  static absl::StatusOr<std::unique_ptr<CheckpointDir>> Open(const DirHandle& dir);

  const std::string& dir() const { return dir_; }
  // config.json (empty object when the file is absent).
  const nlohmann::json& config() const;
  // Shards in file-name order.
  const std::vector<std::unique_ptr<SafetensorsFile>>& shards() const { return shards_; }
  // DataLoss naming the first shard that shrank while it was being read (SafetensorsFile::
  // CheckIntact).
  absl::Status CheckIntact() const;
  // nullptr when absent.
  const TensorView* Find(const std::string& name) const;
  // The shard holding `name` (nullptr when absent).
  const SafetensorsFile* ShardOf(const std::string& name) const;
  ~CheckpointDir();

 private:
  struct Files;  // how Open reaches the directory's files (checkpoint_dir.cc)
  CheckpointDir() = default;
  static absl::StatusOr<std::unique_ptr<CheckpointDir>> OpenFiles(const std::string& dir,
                                                                  const Files& files);

  std::string dir_;                                         // directory path
  std::unique_ptr<nlohmann::json> config_;                  // parsed config.json
  std::vector<std::unique_ptr<SafetensorsFile>> shards_;    // open shards
  std::map<std::string, std::pair<size_t, const TensorView*>> tensors_;  // name -> (shard, view)
};

}  // namespace quantd::checkpoint

#endif  // QUANTD_SERVER_CHECKPOINT_CHECKPOINT_DIR_H_
