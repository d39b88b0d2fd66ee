// quantd_manifest.json: its text round-trips, hostile texts are refused naming the field without
// quoting more than an excerpt, and CheckManifestFiles finds a missing file, a wrong size, a
// symbolic link and (deep only) changed bytes, against digests computed here by OpenSSL's
// SHA-256 of known strings.
#include "server/pipeline/stages/output_manifest.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace quantd::pipeline {
namespace {

namespace fs = std::filesystem;

// SHA-256("abc") and SHA-256("") (FIPS 180-2 examples).
constexpr char kAbc[] = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
constexpr char kEmpty[] = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

TEST(OutputManifestTest, TextRoundTripsSortedByPath) {
  const std::string text =
      ManifestText({{"z/b.json", 3, kAbc}, {"a.safetensors", 0, kEmpty}});
  EXPECT_EQ(text, absl::StrCat("{\n  \"format\": \"quantd-manifest-1\",\n  \"files\": {\n"
                               "    \"a.safetensors\": {\n      \"size\": 0,\n      \"sha256\": \"",
                               kEmpty, "\"\n    },\n    \"z/b.json\": {\n      \"size\": 3,\n"
                               "      \"sha256\": \"", kAbc, "\"\n    }\n  }\n}\n"));
  absl::StatusOr<std::vector<ManifestEntry>> parsed = ParseManifest(text, "m.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ASSERT_EQ(parsed->size(), 2u);
  EXPECT_EQ((*parsed)[0].path, "a.safetensors");
  EXPECT_EQ((*parsed)[0].size, 0u);
  EXPECT_EQ((*parsed)[1].path, "z/b.json");
  EXPECT_EQ((*parsed)[1].size, 3u);
  EXPECT_EQ((*parsed)[1].sha256, kAbc);
}

TEST(OutputManifestTest, HostileTextsAreRefusedNamingTheField) {
  const auto error = [](const std::string& text) {
    return std::string(ParseManifest(text, "m.json").status().message());
  };
  const std::string ok_entry = absl::StrCat("{\"size\": 3, \"sha256\": \"", kAbc, "\"}");
  const auto with = [&](const std::string& path, const std::string& entry) {
    return absl::StrCat("{\"format\": \"quantd-manifest-1\", \"files\": {\"", path, "\": ", entry,
                        "}}");
  };
  EXPECT_EQ(error("[1"), "m.json: not a JSON object");
  EXPECT_EQ(error("{\"files\": {}}"), "m.json: field 'format' must be \"quantd-manifest-1\"");
  EXPECT_EQ(error("{\"format\": \"quantd-manifest-1\", \"files\": []}"),
            "m.json: field 'files' must be an object");
  EXPECT_EQ(error(with("../x", ok_entry)),
            "m.json: field 'files': \"../x\" is not a relative path beneath the directory");
  EXPECT_EQ(error(with("/etc/passwd", ok_entry)),
            "m.json: field 'files': \"/etc/passwd\" is not a relative path beneath the directory");
  EXPECT_EQ(error(with("a//b", ok_entry)),
            "m.json: field 'files': \"a//b\" is not a relative path beneath the directory");
  EXPECT_EQ(error(with("", ok_entry)),
            "m.json: field 'files': \"\" is not a relative path beneath the directory");
  EXPECT_EQ(error(with("a", "{\"size\": -1, \"sha256\": \"x\"}")),
            "m.json: field 'files' entry \"a\": 'size' must be a non-negative integer");
  EXPECT_EQ(error(with("a", "{\"size\": 1.5, \"sha256\": \"x\"}")),
            "m.json: field 'files' entry \"a\": 'size' must be a non-negative integer");
  EXPECT_EQ(error(with("a", "{\"size\": 1, \"sha256\": \"BA7816BF\"}")),
            "m.json: field 'files' entry \"a\": 'sha256' must be 64 lowercase hex digits");
  EXPECT_EQ(error(with("a", "7")), "m.json: field 'files' entry \"a\" must be an object");
  EXPECT_EQ(error(std::string(kMaxManifestBytes + 1, ' ')),
            "m.json: 16777217 bytes, more than the limit of 16777216 for a manifest");
  // A long path is quoted only as an excerpt.
  const std::string long_name(5000, 'p');
  EXPECT_LT(error(with(long_name, "7")).size(), 400u);
}

class ManifestFilesTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::TempDir() + "/manifest_files_" + std::to_string(getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_ + "/sub");
    std::ofstream(dir_ + "/sub/abc.json") << "abc";
    std::ofstream(dir_ + "/empty.safetensors");
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string dir_;
};

TEST_F(ManifestFilesTest, SizesAlwaysAndDigestsWhenDeep) {
  const std::vector<ManifestEntry> files = {{"sub/abc.json", 3, kAbc},
                                            {"empty.safetensors", 0, kEmpty}};
  for (bool deep : {false, true}) {
    absl::StatusOr<std::vector<ManifestMismatch>> m = CheckManifestFiles(dir_, files, deep);
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_TRUE(m->empty());
  }
  // Same size, other bytes: only a deep check sees it.
  std::ofstream(dir_ + "/sub/abc.json") << "abd";
  EXPECT_TRUE(CheckManifestFiles(dir_, files, false)->empty());
  absl::StatusOr<std::vector<ManifestMismatch>> m = CheckManifestFiles(dir_, files, true);
  ASSERT_TRUE(m.ok());
  ASSERT_EQ(m->size(), 1u);
  EXPECT_EQ((*m)[0].path, "sub/abc.json");
  EXPECT_EQ((*m)[0].message.substr(0, 7), "SHA-256");
  EXPECT_NE((*m)[0].message.find(absl::StrCat("the manifest says ", kAbc)), std::string::npos);

  // Another size, a missing file, a symbolic link in place of a file.
  std::ofstream(dir_ + "/sub/abc.json") << "abcd";
  fs::remove(dir_ + "/empty.safetensors");
  fs::create_symlink("sub/abc.json", dir_ + "/link.json");
  m = CheckManifestFiles(dir_, {{"sub/abc.json", 3, kAbc}, {"empty.safetensors", 0, kEmpty},
                                {"link.json", 4, kAbc}},
                         false);
  ASSERT_TRUE(m.ok());
  ASSERT_EQ(m->size(), 3u);
  EXPECT_EQ((*m)[0].message, "4 bytes, the manifest says 3");
  EXPECT_EQ((*m)[1].path, "empty.safetensors");
  EXPECT_EQ((*m)[2].path, "link.json");
}

TEST_F(ManifestFilesTest, AnErrorFromOnChunkStopsTheCheck) {
  absl::StatusOr<std::vector<ManifestMismatch>> m =
      CheckManifestFiles(dir_, {{"sub/abc.json", 3, kAbc}}, true,
                         [](uint64_t) { return absl::CancelledError("stop"); });
  EXPECT_EQ(m.status().code(), absl::StatusCode::kCancelled);
}

}  // namespace
}  // namespace quantd::pipeline
