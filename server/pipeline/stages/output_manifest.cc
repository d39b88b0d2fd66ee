#include "server/pipeline/stages/output_manifest.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"
#include "server/base/excerpt.h"
#include "server/base/utf8.h"
#include "server/checkpoint/atomic_file.h"
#include "server/checkpoint/sha256.h"

namespace quantd::pipeline {
namespace {

using nlohmann::json;
using nlohmann::ordered_json;

absl::Status ManifestError(const std::string& origin, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(origin, ": ", what));
}

bool IsSha256Hex(const std::string& s) {
  return s.size() == 64 && std::all_of(s.begin(), s.end(), [](char c) {
           return absl::ascii_isdigit(c) || (c >= 'a' && c <= 'f');
         });
}

// A relative path that stays beneath the directory: not empty, not absolute, no empty, "." or
// ".." component, valid UTF-8.
bool IsPathBeneath(const std::string& path) {
  if (path.empty() || path.front() == '/' || base::FirstInvalidUtf8(path).has_value()) {
    return false;
  }
  for (absl::string_view part : absl::StrSplit(path, '/')) {
    if (part.empty() || part == "." || part == "..") return false;
  }
  return true;
}

}  // namespace

std::string ManifestText(std::vector<ManifestEntry> files) {
  std::sort(files.begin(), files.end(),
            [](const ManifestEntry& a, const ManifestEntry& b) { return a.path < b.path; });
  ordered_json listed = ordered_json::object();
  for (const ManifestEntry& f : files) listed[f.path] = {{"size", f.size}, {"sha256", f.sha256}};
  const ordered_json doc = {{"format", kManifestFormat}, {"files", std::move(listed)}};
  return doc.dump(2) + "\n";
}

absl::StatusOr<std::vector<ManifestEntry>> ParseManifest(const std::string& text,
                                                         const std::string& origin) {
  if (text.size() > kMaxManifestBytes) {
    return ManifestError(origin, absl::StrCat(text.size(), " bytes, more than the limit of ",
                                              kMaxManifestBytes, " for a manifest"));
  }
  const json doc = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object()) {
    return ManifestError(origin, "not a JSON object");
  }
  const auto format = doc.find("format");
  if (format == doc.end() || !format->is_string() || *format != kManifestFormat) {
    return ManifestError(origin, absl::StrCat("field 'format' must be \"", kManifestFormat, "\""));
  }
  const auto files = doc.find("files");
  if (files == doc.end() || !files->is_object()) {
    return ManifestError(origin, "field 'files' must be an object");
  }
  if (files->size() > kMaxManifestFiles) {
    return ManifestError(origin, absl::StrCat("field 'files' lists ", files->size(),
                                              " files, more than ", kMaxManifestFiles));
  }
  std::vector<ManifestEntry> out;
  for (const auto& [path, entry] : files->items()) {
    if (!IsPathBeneath(path)) {
      return ManifestError(origin, absl::StrCat("field 'files': ", base::Excerpt(path),
                                                " is not a relative path beneath the directory"));
    }
    const std::string field = absl::StrCat("field 'files' entry ", base::Excerpt(path));
    if (!entry.is_object()) return ManifestError(origin, field + " must be an object");
    const auto size = entry.find("size");
    if (size == entry.end() || !size->is_number_unsigned()) {
      return ManifestError(origin, field + ": 'size' must be a non-negative integer");
    }
    const auto sha = entry.find("sha256");
    if (sha == entry.end() || !sha->is_string() || !IsSha256Hex(sha->get<std::string>())) {
      return ManifestError(origin, field + ": 'sha256' must be 64 lowercase hex digits");
    }
    out.push_back({path, size->get<uint64_t>(), sha->get<std::string>()});
  }
  return out;
}

absl::StatusOr<std::vector<ManifestMismatch>> CheckManifestFiles(
    const std::string& dir, const std::vector<ManifestEntry>& files, bool deep,
    const std::function<absl::Status(uint64_t)>& on_chunk) {
  std::vector<ManifestMismatch> out;
  for (const ManifestEntry& f : files) {
    const std::string path = absl::StrCat(dir, "/", f.path);
    struct stat st;
    absl::StatusOr<int> fd = checkpoint::OpenRegularFile(path, /*follow_symlink=*/false, &st);
    if (!fd.ok()) {
      out.push_back({f.path, std::string(fd.status().message())});
      continue;
    }
    close(*fd);
    if (static_cast<uint64_t>(st.st_size) != f.size) {
      out.push_back({f.path, absl::StrCat(st.st_size, " bytes, the manifest says ", f.size)});
      continue;
    }
    if (!deep) continue;
    absl::Status stopped;  // on_chunk's error: the check ends with it
    absl::StatusOr<std::string> sha = checkpoint::Sha256File(path, [&](uint64_t n) {
      if (on_chunk) stopped = on_chunk(n);
      return stopped;
    });
    if (!stopped.ok()) return stopped;
    if (!sha.ok()) {
      out.push_back({f.path, std::string(sha.status().message())});
      continue;
    }
    if (*sha != f.sha256) {
      out.push_back({f.path, absl::StrCat("SHA-256 ", *sha, ", the manifest says ", f.sha256)});
    }
  }
  return out;
}

}  // namespace quantd::pipeline
