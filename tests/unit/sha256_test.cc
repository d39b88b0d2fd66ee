// SHA-256 against the FIPS 180-2 test vectors, incrementally and over a file.
#include "server/checkpoint/sha256.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>

namespace quantd::checkpoint {
namespace {

TEST(Sha256Test, KnownVectors) {
  Sha256 empty;
  EXPECT_EQ(empty.HexDigest(), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  Sha256 abc;
  abc.Update("a", 1);
  abc.Update("bc", 2);  // split across updates
  EXPECT_EQ(abc.HexDigest(), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(Sha256Test, FileOfAMillionAs) {
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("quantd_sha_" + std::to_string(getpid()))).string();
  {
    FILE* f = fopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    std::string a(1000000, 'a');
    fwrite(a.data(), 1, a.size(), f);
    fclose(f);
  }
  auto digest = Sha256File(path);
  std::filesystem::remove(path);
  ASSERT_TRUE(digest.ok());
  EXPECT_EQ(*digest, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  auto missing = Sha256File(path);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find(path), std::string::npos);
}

}  // namespace
}  // namespace quantd::checkpoint
