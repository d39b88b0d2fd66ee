// The output manifest: quantd_manifest.json, written by the export stage beside the checkpoint,
// lists every file of the output with its size and SHA-256 as the job recorded them (the shards'
// digests were taken while they were written, each byte hashed once). The SHA-256 of a file is
// its Git LFS object id ("oid sha256:<hex>"), the figure the Hugging Face Hub shows for a large
// file, so an upload can be checked against the job without reading it back:
//
//   {"format": "quantd-manifest-1",
//    "files": {"config.json": {"size": 1234, "sha256": "<64 hex>"}, ...}}
//
// `quantd verify DIR` checks a manifest it finds: every listed file present with its size, and
// with --deep every byte re-hashed.
#ifndef QUANTD_SERVER_PIPELINE_STAGES_OUTPUT_MANIFEST_H_
#define QUANTD_SERVER_PIPELINE_STAGES_OUTPUT_MANIFEST_H_

#include <stdint.h>

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace quantd::pipeline {

inline constexpr char kManifestName[] = "quantd_manifest.json";
inline constexpr char kManifestFormat[] = "quantd-manifest-1";
inline constexpr size_t kMaxManifestBytes = 16 << 20;
inline constexpr size_t kMaxManifestFiles = 100000;

struct ManifestEntry {
  std::string path;  // relative to the output directory, '/'-separated
  uint64_t size = 0;
  std::string sha256;  // 64 lowercase hex digits
};

// The manifest's text, files sorted by path.
std::string ManifestText(std::vector<ManifestEntry> files);

// The entries of a manifest's text. InvalidArgument naming `origin` and the field for text that
// is not such a manifest: not JSON, another format, a path that is absolute, empty, has a ".."
// component or is not UTF-8, a size that is not a non-negative integer, a digest that is not 64
// lowercase hex digits, more than kMaxManifestBytes or kMaxManifestFiles. Never quotes a value
// beyond an excerpt of a path.
absl::StatusOr<std::vector<ManifestEntry>> ParseManifest(const std::string& text,
                                                         const std::string& origin);

// What CheckManifestFiles found wrong with one file: its path and why.
struct ManifestMismatch {
  std::string path;
  std::string message;
};

// Checks the files beneath `dir` against `files`: each is a regular file (no symbolic link
// followed) of the listed size and, when `deep`, of the listed SHA-256 (every byte read;
// `on_chunk` gets the byte count of each chunk read and may stop the check by returning an
// error). Returns the mismatches in manifest order; an error only from on_chunk.
absl::StatusOr<std::vector<ManifestMismatch>> CheckManifestFiles(
    const std::string& dir, const std::vector<ManifestEntry>& files, bool deep,
    const std::function<absl::Status(uint64_t)>& on_chunk = {});

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_STAGES_OUTPUT_MANIFEST_H_
