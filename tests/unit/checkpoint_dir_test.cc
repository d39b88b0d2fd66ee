// Shard index, checkpoint directories and atomic file writes.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"
#include "server/checkpoint/atomic_file.h"
#include "server/checkpoint/checkpoint_dir.h"
#include "server/checkpoint/safetensors_writer.h"
#include "tests/unit/test_dirs.h"

namespace quantd::checkpoint {
namespace {

namespace fs = std::filesystem;

using testing_util::TempDirTest;
using ShardIndexTest = TempDirTest;
using CheckpointDirTest = TempDirTest;
using AtomicFileTest = TempDirTest;

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// Writes a shard of U8 [2] tensors whose bytes are the tensor name's first two characters.
void WriteShard(const std::string& path, const std::vector<std::string>& names) {
  std::vector<TensorSpec> specs;
  for (const std::string& name : names) specs.push_back({name, Dtype::kU8, {2}});
  absl::StatusOr<std::unique_ptr<SafetensorsWriter>> writer =
      SafetensorsWriter::Create(path, specs);
  ASSERT_TRUE(writer.ok()) << writer.status();
  for (const std::string& name : names) {
    ASSERT_TRUE((*writer)->WriteTensor(name, name.data(), 2).ok());
  }
  ASSERT_TRUE((*writer)->Finish().ok());
}

std::string ErrorOf(const absl::Status& status) {
  EXPECT_FALSE(status.ok());
  return std::string(status.message());
}

// Fills `dir` with a two-shard checkpoint: shard 1 holds aa, bb; shard 2 holds cc.
void MakeTwoShardDir(const std::string& dir) {
  WriteShard(dir + "/model-00001-of-00002.safetensors", {"aa", "bb"});
  WriteShard(dir + "/model-00002-of-00002.safetensors", {"cc"});
  ShardIndex index;
  index.weight_map = {{"aa", "model-00001-of-00002.safetensors"},
                      {"bb", "model-00001-of-00002.safetensors"},
                      {"cc", "model-00002-of-00002.safetensors"}};
  index.total_size = 6;
  EXPECT_TRUE(WriteShardIndex(dir + "/" + kIndexFileName, index).ok());
}

// ---- index ----

TEST_F(ShardIndexTest, RoundTrips) {
  std::string path = dir_ + "/model.safetensors.index.json";
  ShardIndex index;
  index.weight_map = {{"x.weight", "s1.safetensors"}, {"y.weight", "s2.safetensors"}};
  index.total_size = 123456789012;
  ASSERT_TRUE(WriteShardIndex(path, index).ok());
  EXPECT_FALSE(fs::exists(path + ".tmp"));

  nlohmann::json written = nlohmann::json::parse(std::ifstream(path));
  EXPECT_EQ(written["metadata"]["total_size"], 123456789012u);
  EXPECT_EQ(written["weight_map"]["y.weight"], "s2.safetensors");

  absl::StatusOr<ShardIndex> parsed = ParseShardIndex(path);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->weight_map, index.weight_map);
  EXPECT_EQ(parsed->total_size, index.total_size);
}

TEST_F(ShardIndexTest, MetadataIsOptional) {
  std::string path = dir_ + "/index.json";
  WriteText(path, R"({"weight_map":{"a":"s.safetensors"}})");
  absl::StatusOr<ShardIndex> parsed = ParseShardIndex(path);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->total_size, 0u);
  EXPECT_EQ(parsed->weight_map.at("a"), "s.safetensors");
}

TEST_F(ShardIndexTest, RejectsBadIndexes) {
  std::string path = dir_ + "/index.json";
  auto error = [&](const std::string& text) {
    WriteText(path, text);
    std::string message = ErrorOf(ParseShardIndex(path).status());
    EXPECT_EQ(message.rfind(path + ": ", 0), 0u) << message;
    return message;
  };
  EXPECT_NE(error("{").find("not valid JSON"), std::string::npos);
  EXPECT_NE(error("[]").find("not a JSON object"), std::string::npos);
  EXPECT_NE(error("{}").find("\"weight_map\" is missing"), std::string::npos);
  EXPECT_NE(error(R"({"weight_map":{"a":1}})").find("entry for \"a\" is not a string"),
            std::string::npos);
  EXPECT_NE(error(R"({"weight_map":{"a":"../x.safetensors"}})")
                .find("tensor \"a\" maps to shard \"../x.safetensors\", which is not a plain file "
                      "name"),
            std::string::npos);
  EXPECT_NE(error(R"({"weight_map":{"a":"sub/x.safetensors"}})").find("not a plain file name"),
            std::string::npos);
  EXPECT_NE(error(R"({"weight_map":{"a":".."}})").find("not a plain file name"),
            std::string::npos);
  EXPECT_NE(error(R"({"weight_map":{"a":""}})").find("not a plain file name"), std::string::npos);
  EXPECT_NE(error(R"({"metadata":{"total_size":-1},"weight_map":{}})")
                .find("metadata.total_size is not a non-negative integer"),
            std::string::npos);
  EXPECT_NE(ErrorOf(ParseShardIndex(path + ".absent").status()).find(path + ".absent"),
            std::string::npos);
  // Names from the index are quoted as short escaped excerpts: a megabyte-long name with a
  // newline in it is neither repeated nor spliced into the message.
  const std::string huge = "x\\n" + std::string(1 << 20, 'y');
  EXPECT_EQ(error(R"({"weight_map":{")" + huge + R"(":"../s"}})"),
            path + ": tensor \"x\\n" + std::string(198, 'y') + "...\" maps to shard " +
                "\"../s\", which is not a plain file name");
}

TEST_F(ShardIndexTest, WriteRejectsPathsAsShardNames) {
  std::string path = dir_ + "/index.json";
  ShardIndex index;
  index.weight_map = {{"a", "/etc/passwd"}};
  EXPECT_NE(ErrorOf(WriteShardIndex(path, index)).find("not a plain file name"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(path));
}

// ---- CheckpointDir ----

TEST_F(CheckpointDirTest, OpensShardedCheckpoint) {
  const std::string& dir = dir_;
  MakeTwoShardDir(dir);
  WriteText(dir + "/config.json", R"({"model_type":"deepseek_v4","num_hidden_layers":2})");
  absl::StatusOr<std::unique_ptr<CheckpointDir>> ckpt = CheckpointDir::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->dir(), dir);
  EXPECT_EQ((*ckpt)->config()["model_type"], "deepseek_v4");
  EXPECT_EQ((*ckpt)->config()["num_hidden_layers"], 2);
  ASSERT_EQ((*ckpt)->shards().size(), 2u);
  EXPECT_EQ((*ckpt)->shards()[0]->path(), dir + "/model-00001-of-00002.safetensors");
  EXPECT_EQ((*ckpt)->shards()[1]->path(), dir + "/model-00002-of-00002.safetensors");
  const TensorView* cc = (*ckpt)->Find("cc");
  ASSERT_NE(cc, nullptr);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(cc->data), 2), "cc");
  EXPECT_EQ((*ckpt)->ShardOf("cc"), (*ckpt)->shards()[1].get());
  EXPECT_EQ((*ckpt)->ShardOf("aa"), (*ckpt)->shards()[0].get());
  EXPECT_EQ((*ckpt)->Find("dd"), nullptr);
  EXPECT_EQ((*ckpt)->ShardOf("dd"), nullptr);
}

// A job's own output read back beneath its handle: the same checkpoint as by path, and a file
// of it swapped for a link (to another model's shard) is refused, never followed.
TEST_F(CheckpointDirTest, OpensBeneathAHandleAndFollowsNoLink) {
  const std::string out = dir_ + "/out", other = dir_ + "/other";
  fs::create_directories(out);
  fs::create_directories(other);
  MakeTwoShardDir(out);
  MakeTwoShardDir(other);
  WriteText(out + "/config.json", R"({"model_type":"deepseek_v4"})");
  absl::StatusOr<DirHandle> handle = DirHandle::Open("output", out);
  ASSERT_TRUE(handle.ok()) << handle.status();
  absl::StatusOr<std::unique_ptr<CheckpointDir>> ckpt = CheckpointDir::Open(*handle);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->dir(), out);
  EXPECT_EQ((*ckpt)->config().at("model_type"), "deepseek_v4");
  ASSERT_EQ((*ckpt)->shards().size(), 2u);
  EXPECT_EQ((*ckpt)->shards()[1]->path(), out + "/model-00002-of-00002.safetensors");
  EXPECT_NE((*ckpt)->Find("cc"), nullptr);

  const std::string shard = "/model-00001-of-00002.safetensors";
  fs::remove(out + shard);
  fs::create_symlink(other + shard, out + shard);
  ckpt = CheckpointDir::Open(*handle);
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ErrorOf(ckpt.status()),
            "output: " + out + shard + ": cannot open: it is or passes through a symbolic link, "
            "which quantd does not follow here (was the output directory or a directory in it "
            "replaced by a link?)");
}

// A symbolic link inside the source is followed only while it leads inside the roots
// (source_roots.h); nullopt follows it anywhere.
TEST_F(CheckpointDirTest, LinksAreFollowedOnlyInsideTheRoots) {
  const std::string root = fs::canonical(dir_).string();
  const std::string other = root + "/other";
  const std::string src = root + "/tenant/src";
  fs::create_directories(other);
  fs::create_directories(src);
  MakeTwoShardDir(other);
  WriteText(other + "/config.json", R"({"model_type":"deepseek_v4"})");
  for (const fs::directory_entry& e : fs::directory_iterator(other)) {
    fs::create_symlink(e.path(), src + "/" + e.path().filename().string());
  }
  const SourceRoots tenant = std::vector<std::string>{root + "/tenant"};
  absl::StatusOr<std::unique_ptr<CheckpointDir>> ckpt = CheckpointDir::Open(src, tenant);
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(ErrorOf(ckpt.status()),
            "source: " + src + "/config.json leads outside the allowed roots of the caller that "
            "submitted the job (a symbolic link is followed only within them)");

  // config.json and the index the tenant's own, a shard a link outside: that shard is named.
  fs::remove(src + "/config.json");
  fs::remove(src + "/" + kIndexFileName);
  fs::copy_file(other + "/config.json", src + "/config.json");
  fs::copy_file(other + "/" + kIndexFileName, src + "/" + kIndexFileName);
  ckpt = CheckpointDir::Open(src, tenant);
  EXPECT_EQ(ErrorOf(ckpt.status()),
            "source: " + src + "/model-00001-of-00002.safetensors leads outside the allowed "
            "roots of the caller that submitted the job (a symbolic link is followed only within "
            "them)");

  // Roots that hold the targets, or none at all (a caller that may name any path): opened.
  ckpt = CheckpointDir::Open(src, std::vector<std::string>{root});
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->shards().size(), 2u);
  ckpt = CheckpointDir::Open(src);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  // No roots at all: nothing.
  ckpt = CheckpointDir::Open(other, std::vector<std::string>{});
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kPermissionDenied);
}

// The roots judge the file that was opened, not the path it was opened by: a link swapped
// between a check of the path and the open cannot lead the read elsewhere.
TEST_F(CheckpointDirTest, RootsJudgeTheOpenedFileNotItsPath) {
  const std::string root = fs::canonical(dir_).string();
  fs::create_directories(root + "/tenant");
  fs::create_directories(root + "/other");
  WriteText(root + "/tenant/mine.json", "{}");
  WriteText(root + "/other/theirs.json", "{}");
  const SourceRoots tenant = std::vector<std::string>{root + "/tenant"};
  struct stat st;
  absl::StatusOr<int> theirs = OpenRegularFile(root + "/other/theirs.json", true, &st);
  ASSERT_TRUE(theirs.ok()) << theirs.status();
  // Named by a path inside the roots, but the open file is the other tenant's: refused.
  absl::Status s = CheckOpenedInsideRoots("source", root + "/tenant/mine.json", *theirs, tenant);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(ErrorOf(s), "source: " + root + "/tenant/mine.json leads outside the allowed roots "
                        "of the caller that submitted the job (a symbolic link is followed only "
                        "within them)");
  EXPECT_TRUE(CheckOpenedInsideRoots("source", "x", *theirs, std::nullopt).ok());
  close(*theirs);
  absl::StatusOr<int> mine = OpenRegularFile(root + "/tenant/mine.json", true, &st);
  ASSERT_TRUE(mine.ok()) << mine.status();
  EXPECT_TRUE(CheckOpenedInsideRoots("source", "x", *mine, tenant).ok());
  close(*mine);
  // ReadFile and SafetensorsFile::Open check what they opened: a link to the other tenant's file
  // is refused, the tenant's own file read.
  fs::create_symlink(root + "/other/theirs.json", root + "/tenant/link.json");
  EXPECT_EQ(ReadFile(root + "/tenant/link.json", 100, tenant).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(*ReadFile(root + "/tenant/mine.json", 100, tenant), "{}");
  WriteShard(root + "/other/w.safetensors", {"aa"});
  fs::create_symlink(root + "/other/w.safetensors", root + "/tenant/w.safetensors");
  EXPECT_EQ(SafetensorsFile::Open(root + "/tenant/w.safetensors", tenant).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(SafetensorsFile::Open(root + "/tenant/w.safetensors").ok());
}

// A Hugging Face cache snapshot links each file to ../../blobs/<hash>: inside the roots, opened.
TEST_F(CheckpointDirTest, HuggingFaceSnapshotInsideTheRootsOpens) {
  const std::string root = fs::canonical(dir_).string();
  const std::string blobs = root + "/hub/models--a--b/blobs";
  const std::string snapshot = root + "/hub/models--a--b/snapshots/0123";
  fs::create_directories(blobs);
  fs::create_directories(snapshot);
  WriteShard(blobs + "/f00d", {"aa", "bb"});
  fs::create_symlink("../../blobs/f00d", snapshot + "/model.safetensors");
  absl::StatusOr<std::unique_ptr<CheckpointDir>> ckpt =
      CheckpointDir::Open(snapshot, std::vector<std::string>{root + "/hub"});
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  ASSERT_NE((*ckpt)->Find("bb"), nullptr);
  ckpt = CheckpointDir::Open(snapshot, std::vector<std::string>{snapshot});
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kPermissionDenied);
}

TEST_F(CheckpointDirTest, OpensSingleFileWithoutConfig) {
  const std::string& dir = dir_;
  WriteShard(dir + "/model.safetensors", {"aa", "bb"});
  absl::StatusOr<std::unique_ptr<CheckpointDir>> ckpt = CheckpointDir::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->config(), nlohmann::json::object());
  ASSERT_EQ((*ckpt)->shards().size(), 1u);
  ASSERT_NE((*ckpt)->Find("bb"), nullptr);
  EXPECT_EQ((*ckpt)->Find("bb")->size, 2u);
}

TEST_F(CheckpointDirTest, InvalidConfigNamesConfigJson) {
  const std::string& dir = dir_;
  WriteShard(dir + "/model.safetensors", {"aa"});
  WriteText(dir + "/config.json", R"({"model_type":)");
  std::string message = ErrorOf(CheckpointDir::Open(dir).status());
  EXPECT_EQ(message.rfind(dir + "/config.json: not valid JSON", 0), 0u) << message;
  WriteText(dir + "/config.json", "[1]");
  message = ErrorOf(CheckpointDir::Open(dir).status());
  EXPECT_EQ(message, dir + "/config.json: not a JSON object");
}

TEST_F(CheckpointDirTest, NotACheckpoint) {
  const std::string& dir = dir_;
  absl::Status status = CheckpointDir::Open(dir).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(std::string(status.message()),
            dir + ": not a checkpoint directory: neither model.safetensors.index.json nor "
                  "model.safetensors found");
}

TEST_F(CheckpointDirTest, MissingShardIsNamed) {
  const std::string& dir = dir_;
  MakeTwoShardDir(dir);
  fs::remove(dir + "/model-00002-of-00002.safetensors");
  absl::Status status = CheckpointDir::Open(dir).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(std::string(status.message()),
            dir + "/model.safetensors.index.json: shard \"model-00002-of-00002.safetensors\" is "
                  "missing (" + dir + "/model-00002-of-00002.safetensors)");
}

TEST_F(CheckpointDirTest, IndexedTensorAbsentFromItsShard) {
  const std::string& dir = dir_;
  MakeTwoShardDir(dir);
  ShardIndex index = *ParseShardIndex(dir + "/" + kIndexFileName);
  index.weight_map["dd"] = "model-00002-of-00002.safetensors";
  ASSERT_TRUE(WriteShardIndex(dir + "/" + kIndexFileName, index).ok());
  EXPECT_EQ(ErrorOf(CheckpointDir::Open(dir).status()),
            dir + "/model.safetensors.index.json: tensor \"dd\" is listed in shard "
                  "\"model-00002-of-00002.safetensors\" but absent from it");
}

TEST_F(CheckpointDirTest, TensorInTwoShards) {
  const std::string& dir = dir_;
  MakeTwoShardDir(dir);
  WriteShard(dir + "/model-00002-of-00002.safetensors", {"bb", "cc"});
  EXPECT_EQ(ErrorOf(CheckpointDir::Open(dir).status()),
            dir + "/model-00002-of-00002.safetensors: tensor \"bb\" is also in " + dir +
                "/model-00001-of-00002.safetensors");
}

TEST_F(CheckpointDirTest, ShardTensorTheIndexPlacesElsewhere) {
  const std::string& dir = dir_;
  MakeTwoShardDir(dir);
  ShardIndex index = *ParseShardIndex(dir + "/" + kIndexFileName);
  index.weight_map["bb"] = "model-00002-of-00002.safetensors";
  ASSERT_TRUE(WriteShardIndex(dir + "/" + kIndexFileName, index).ok());
  EXPECT_EQ(ErrorOf(CheckpointDir::Open(dir).status()),
            dir + "/model.safetensors.index.json: tensor \"bb\" is in shard "
                  "\"model-00001-of-00002.safetensors\" but the index maps it to "
                  "\"model-00002-of-00002.safetensors\"");
  index.weight_map.erase("bb");
  ASSERT_TRUE(WriteShardIndex(dir + "/" + kIndexFileName, index).ok());
  EXPECT_NE(ErrorOf(CheckpointDir::Open(dir).status()).find("\"bb\" is in shard "
                                                           "\"model-00001-of-00002.safetensors\" "
                                                           "but the index does not list it"),
            std::string::npos);
}

TEST_F(CheckpointDirTest, ShardNameWithPathIsRejected) {
  const std::string& dir = dir_;
  MakeTwoShardDir(dir);
  WriteText(dir + "/" + kIndexFileName,
            R"({"weight_map":{"aa":"../model-00001-of-00002.safetensors"}})");
  EXPECT_NE(ErrorOf(CheckpointDir::Open(dir).status()).find("not a plain file name"),
            std::string::npos);
}

TEST_F(CheckpointDirTest, CorruptShardErrorNamesShard) {
  const std::string& dir = dir_;
  MakeTwoShardDir(dir);
  WriteText(dir + "/model-00002-of-00002.safetensors", "garbage!garbage");
  std::string message = ErrorOf(CheckpointDir::Open(dir).status());
  EXPECT_EQ(message.rfind(dir + "/model-00002-of-00002.safetensors: header length", 0), 0u)
      << message;
}

// ---- atomic files ----

TEST_F(AtomicFileTest, WritesReplacesAndReads) {
  std::string path = dir_ + "/f.txt";
  ASSERT_TRUE(WriteFileAtomically(path, "first").ok());
  ASSERT_TRUE(WriteFileAtomically(path, std::string("se\0cond", 7)).ok());
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  absl::StatusOr<std::string> read = ReadFile(path, 1 << 20);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, std::string("se\0cond", 7));
}

TEST_F(AtomicFileTest, ReplacesStaleTmp) {
  std::string path = dir_ + "/f.txt";
  WriteText(path + ".tmp", "stale contents that are longer");
  ASSERT_TRUE(WriteFileAtomically(path, "new").ok());
  EXPECT_EQ(*ReadFile(path, 1 << 20), "new");
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

TEST_F(AtomicFileTest, ErrorsNameThePath) {
  const std::string& dir = dir_;
  absl::Status status = ReadFile(dir + "/absent", 1 << 20).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(std::string(status.message()).rfind(dir + "/absent: cannot open", 0), 0u) << status;
  status = WriteFileAtomically(dir + "/no/dir/f", "x");
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(std::string(status.message()).rfind(dir + "/no/dir/f.tmp: cannot create", 0), 0u)
      << status;
  status = CommitTmpFile(dir + "/absent.tmp", dir + "/absent");
  EXPECT_NE(std::string(status.message()).find(dir + "/absent.tmp"), std::string::npos) << status;
}

TEST_F(AtomicFileTest, ReadsLargeFile) {
  std::string path = dir_ + "/large.bin";
  std::string contents(300000, '\0');
  for (size_t i = 0; i < contents.size(); ++i) contents[i] = static_cast<char>(i * 7);
  ASSERT_TRUE(WriteFileAtomically(path, contents).ok());
  EXPECT_EQ(*ReadFile(path, 1 << 20), contents);
}

}  // namespace
}  // namespace quantd::checkpoint
