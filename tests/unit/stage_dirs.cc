#include "tests/unit/stage_dirs.h"

#include <gtest/gtest.h>

#include <deque>
#include <filesystem>
#include <string>

namespace quantd::testing_util {
namespace {

namespace fs = std::filesystem;

// `dir` opened for `field` (created when absent); null when `dir` is empty.
const checkpoint::DirHandle* Open(const std::string& field, const std::string& dir,
                                  bool create) {
  static std::deque<checkpoint::DirHandle> handles;  // the binary's life
  if (dir.empty()) return nullptr;
  if (create) fs::create_directories(dir);
  absl::StatusOr<checkpoint::DirHandle> handle = checkpoint::DirHandle::Open(field, dir);
  EXPECT_TRUE(handle.ok()) << handle.status();
  if (!handle.ok()) return nullptr;
  handles.push_back(*std::move(handle));
  return &handles.back();
}

}  // namespace

void OpenStageDirs(pipeline::StageContext* ctx) {
  const job::JobSpec& spec = *ctx->spec;
  ctx->source_dir = Open("source", spec.source, /*create=*/false);
  ctx->output_dir = Open("output", spec.output, /*create=*/true);
  ctx->materialize_bf16_dir = Open("materialize_bf16", spec.materialize_bf16, /*create=*/true);
}

}  // namespace quantd::testing_util
