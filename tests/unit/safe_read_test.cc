// Reads that must not block, wander or crash: special files, size caps, symlinks, JSON errors that
// quote nothing, and a mapped shard truncated while it is read (issue 9, "Reads").
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "server/checkpoint/atomic_file.h"
#include "server/checkpoint/checkpoint_dir.h"
#include "server/checkpoint/json_file.h"
#include "server/checkpoint/safetensors_reader.h"
#include "server/checkpoint/safetensors_writer.h"
#include "tests/unit/test_dirs.h"

namespace quantd::checkpoint {
namespace {

namespace fs = std::filesystem;
using SafeReadTest = testing_util::TempDirTest;

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

std::string MessageOf(const absl::Status& s) { return std::string(s.message()); }

TEST_F(SafeReadTest, SpecialFilesAreRefusedWithoutBlocking) {
  const std::string fifo = dir_ + "/config.json";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  // No writer ever opens the FIFO: a blocking open would hang the test here.
  absl::StatusOr<std::string> read = ReadFile(fifo, 1 << 20);
  EXPECT_EQ(read.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MessageOf(read.status()), fifo + ": is a FIFO; only regular files are read");

  EXPECT_EQ(MessageOf(ReadFile("/dev/zero", 1 << 20).status()),
            "/dev/zero: is a device; only regular files are read");
  EXPECT_EQ(MessageOf(ReadFile(dir_, 1 << 20).status()),
            dir_ + ": is a directory; only regular files are read");
  EXPECT_EQ(MessageOf(SafetensorsFile::Open(fifo).status()),
            fifo + ": is a FIFO; only regular files are read");
  EXPECT_EQ(MessageOf(SafetensorsFile::Open("/dev/zero").status()),
            "/dev/zero: is a device; only regular files are read");
}

TEST_F(SafeReadTest, ReadFileEnforcesItsCap) {
  const std::string path = dir_ + "/f.json";
  WriteText(path, std::string(1000, ' '));
  EXPECT_TRUE(ReadFile(path, 1000).ok());
  absl::Status s = ReadFile(path, 999).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MessageOf(s), path + ": larger than the limit of 999 bytes for this file");
}

TEST_F(SafeReadTest, OpenRegularFileRefusesSymlinksWhenAsked) {
  const std::string target = dir_ + "/target", link = dir_ + "/link";
  WriteText(target, "x");
  fs::create_symlink(target, link);
  struct stat st;
  absl::StatusOr<int> fd = OpenRegularFile(link, /*follow_symlink=*/true, &st);
  ASSERT_TRUE(fd.ok()) << fd.status();
  close(*fd);
  EXPECT_EQ(MessageOf(OpenRegularFile(link, /*follow_symlink=*/false, &st).status()),
            link + ": is a symbolic link, which quantd does not follow here");
}

TEST_F(SafeReadTest, WritesNeverFollowAPlantedSymlink) {
  const std::string victim = dir_ + "/victim", out = dir_ + "/out.json";
  WriteText(victim, "precious");
  fs::create_symlink(victim, out + ".tmp");
  EXPECT_FALSE(WriteFileAtomically(out, "new").ok());
  std::ifstream in(victim);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), "precious");
}

TEST_F(SafeReadTest, WritesRefuseAPlantedFifoWithoutBlocking) {
  // E.g. calibration.amax_out's "<file>.tmp" in a directory other users can write to.
  const std::string out = dir_ + "/amax.json";
  ASSERT_EQ(mkfifo((out + ".tmp").c_str(), 0600), 0);
  // No reader ever opens the FIFO: a blocking open would hang the test here.
  absl::Status s = WriteFileAtomically(out, "{}");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MessageOf(s), out + ".tmp: is a FIFO; only regular files are written");
  EXPECT_FALSE(fs::exists(out));
  // With a reader the open succeeds; the write is still refused before any byte.
  const int reader = open((out + ".tmp").c_str(), O_RDONLY | O_NONBLOCK);
  ASSERT_GE(reader, 0);
  EXPECT_EQ(MessageOf(CreateForWrite(out + ".tmp").status()),
            out + ".tmp: is a FIFO; only regular files are written");
  close(reader);
  EXPECT_EQ(MessageOf(CreateForWrite("/dev/null").status()),
            "/dev/null: is a device; only regular files are written");
}

TEST_F(SafeReadTest, JsonErrorsGiveAnOffsetAndQuoteNothing) {
  const std::string path = dir_ + "/secret.json";
  WriteText(path, "{\"password\": hunter2}");
  absl::Status s = ReadJsonFile(path, 1 << 20).status();
  EXPECT_EQ(MessageOf(s), path + ": not valid JSON (syntax error at byte 14)");
  WriteText(path, std::string(40, '[') + std::string(40, ']'));
  EXPECT_EQ(MessageOf(ReadJsonFile(path, 1 << 20).status()),
            path + ": JSON nests deeper than 32 levels");
}

TEST(JsonFieldsTest, CountsAndNamesAreReadOnlyWhenPresentAndOfTheirKind) {
  const nlohmann::json j = nlohmann::json::parse(
      R"({"n": 7, "zero": 0, "neg": -1, "real": 1.5, "text": "7", "kind": "head"})");
  int64_t count = 42;
  EXPECT_TRUE(GetCount(j, "n", &count));
  EXPECT_EQ(count, 7);
  EXPECT_TRUE(GetCount(j, "zero", &count));
  EXPECT_EQ(count, 0);
  for (const char* field : {"neg", "real", "text", "absent"}) {
    count = 42;
    EXPECT_FALSE(GetCount(j, field, &count)) << field;
    EXPECT_EQ(count, 42) << field;
  }
  EXPECT_FALSE(GetCount(nlohmann::json::array({7}), "n", &count));

  const char* const names[] = {"layer", "head", "gate"};
  int index = -1;
  EXPECT_TRUE(GetName(j, "kind", names, 3, &index));
  EXPECT_EQ(index, 1);
  index = -1;
  EXPECT_FALSE(GetName(j, "kind", names, 1, &index));  // "head" is not among the first one
  EXPECT_FALSE(GetName(j, "n", names, 3, &index));     // not a string
  EXPECT_FALSE(GetName(j, "absent", names, 3, &index));
  EXPECT_FALSE(GetName(nlohmann::json("head"), "kind", names, 3, &index));
  EXPECT_EQ(index, -1);
}

TEST_F(SafeReadTest, ConfigAndIndexAreCapped) {
  WriteText(dir_ + "/config.json", "{}");
  WriteText(dir_ + "/" + kIndexFileName, std::string(kMaxIndexFileBytes + 1, ' '));
  absl::Status s = CheckpointDir::Open(dir_).status();
  EXPECT_EQ(MessageOf(s), dir_ + "/" + kIndexFileName + ": larger than the limit of " +
                              std::to_string(kMaxIndexFileBytes) + " bytes for this file");
}

// A shard truncated while mapped: reading its data yields zeros instead of SIGBUS, and the file
// reports DataLoss naming itself.
TEST_F(SafeReadTest, TruncatedShardIsDataLossNotACrash) {
  const std::string path = dir_ + "/model.safetensors";
  const size_t n = 1 << 20;  // several pages
  std::vector<uint8_t> bytes(n, 0xAB);
  {
    auto writer = SafetensorsWriter::Create(path, {{"w", Dtype::kU8, {static_cast<int64_t>(n)}}});
    ASSERT_TRUE(writer.ok()) << writer.status();
    ASSERT_TRUE((*writer)->WriteTensor("w", bytes.data(), n).ok());
    ASSERT_TRUE((*writer)->Finish().ok());
  }
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE((*file)->CheckIntact().ok());
  const TensorView* w = (*file)->Find("w");
  ASSERT_NE(w, nullptr);
  ASSERT_EQ(truncate(path.c_str(), 4096), 0);
  uint64_t sum = 0;
  for (uint64_t i = 0; i < w->size; ++i) sum += w->data[i];  // SIGBUS without the guard
  EXPECT_LT(sum, uint64_t{0xAB} * n);
  absl::Status s = (*file)->CheckIntact();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(MessageOf(s).rfind(path + ": the file shrank below its ", 0), 0u) << s;
  // Other files are unaffected, and a reopened file is intact.
  auto again = SafetensorsFile::Open(path);
  EXPECT_FALSE(again.ok());  // now too short for its header: a plain InvalidArgument
}

}  // namespace
}  // namespace quantd::checkpoint
