#include "server/pipeline/job_paths.h"

#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"

namespace quantd::pipeline {
namespace {

namespace fs = std::filesystem;

// `path` without a trailing separator ("/a/b/" -> "/a/b"), so that components compare.
fs::path WithoutTrailingSlash(const fs::path& path) {
  fs::path p = path.lexically_normal();
  return p.has_filename() || p == p.root_path() ? p : p.parent_path();
}

// Whether `inner` is `outer` or lies inside it (see the file comment). Both canonical.
bool SameOrInside(const fs::path& inner, const fs::path& outer) {
  if (std::mismatch(outer.begin(), outer.end(), inner.begin(), inner.end()).first == outer.end()) {
    return true;
  }
  struct stat outer_st;
  if (stat(outer.c_str(), &outer_st) != 0) return false;  // absent: components decided it
  for (fs::path p = inner;; p = p.parent_path()) {
    struct stat st;
    if (stat(p.c_str(), &st) == 0 && st.st_dev == outer_st.st_dev &&
        st.st_ino == outer_st.st_ino) {
      return true;
    }
    if (p == p.root_path() || !p.has_relative_path()) return false;
  }
}

// How `path` (the field) relates to `other`, as words for an error; "" when they do not overlap.
std::string Overlap(const fs::path& path, const fs::path& other) {
  const bool inside = SameOrInside(path, other);
  const bool contains = SameOrInside(other, path);
  if (inside && contains) return "is";
  if (inside) return "lies inside";
  if (contains) return "contains";
  return "";
}

absl::Status Resolve(absl::string_view field, bool allow_relative, std::string* path) {
  if (path->empty()) return absl::OkStatus();
  if (absl::Status s = CheckPathText(field, *path); !s.ok()) return s;
  fs::path p(*path);
  if (p.is_relative() && !allow_relative) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": must be an absolute path (the daemon does not know the caller's directory)"));
  }
  std::error_code ec;
  p = fs::absolute(p, ec);
  if (!ec) p = fs::weakly_canonical(p, ec);
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": cannot resolve ", *path, ": ", ec.message()));
  }
  p = WithoutTrailingSlash(p);
  if (p.native().size() > kMaxPathBytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": resolves to a path longer than ",
                                                   kMaxPathBytes, " bytes"));
  }
  *path = p.string();
  return absl::OkStatus();
}

}  // namespace

bool IsValidUtf8(std::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    int extra = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if (c >= 0xC2 && c <= 0xDF) {
      extra = 1;
      cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
      extra = 2;
      cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      extra = 3;
      cp = c & 0x07;
    } else {
      return false;  // a continuation byte, an overlong lead (C0, C1) or beyond U+10FFFF
    }
    if (i + extra >= text.size()) return false;  // a truncated sequence
    for (int k = 1; k <= extra; ++k) {
      const unsigned char cc = static_cast<unsigned char>(text[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    if ((extra == 2 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) ||
        (extra == 3 && (cp < 0x10000 || cp > 0x10FFFF))) {
      return false;  // overlong, a surrogate, or too large
    }
    i += extra + 1;
  }
  return true;
}

absl::Status CheckPathText(absl::string_view field, const std::string& path) {
  if (path.size() > kMaxPathBytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", path.size(),
                                                   " bytes, longer than the limit of ",
                                                   kMaxPathBytes, " (PATH_MAX)"));
  }
  if (path.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": contains a NUL byte"));
  }
  if (!IsValidUtf8(path)) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": is not valid UTF-8"));
  }
  return absl::OkStatus();
}

absl::Status ResolveJobPaths(JobSpec* spec, bool allow_relative) {
  struct Field {
    std::string name;
    std::string* path;
  };
  CalibrationSpec& cal = spec->calibration;
  std::vector<Field> inputs = {{"calibration.amax_file", &cal.amax_file},
                               {"calibration.dataset", &cal.dataset}};
  for (size_t i = 0; i < cal.datasets.size(); ++i) {
    inputs.push_back({absl::StrCat("calibration.datasets[", i, "].path"), &cal.datasets[i].path});
  }
  std::vector<Field> fields = {{"source", &spec->source},
                               {"output", &spec->output},
                               {"materialize_bf16", &spec->materialize_bf16},
                               {"calibration.amax_out", &cal.amax_out}};
  fields.insert(fields.end(), inputs.begin(), inputs.end());
  for (const Field& f : fields) {
    if (absl::Status s = Resolve(f.name, allow_relative, f.path); !s.ok()) return s;
  }
  const fs::path source(spec->source), output(spec->output);
  if (std::string how = Overlap(output, source); !how.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("output: ", spec->output, " ", how,
                                                   " the source directory ", spec->source));
  }
  if (!spec->materialize_bf16.empty()) {
    const fs::path bf16(spec->materialize_bf16);
    for (const auto& [name, dir] : {std::pair<const char*, const fs::path*>{"source", &source},
                                    {"output", &output}}) {
      if (std::string how = Overlap(bf16, *dir); !how.empty()) {
        return absl::InvalidArgumentError(absl::StrCat("materialize_bf16: ",
                                                       spec->materialize_bf16, " ", how, " the ",
                                                       name, " directory ", dir->string()));
      }
    }
  }
  if (!cal.amax_out.empty()) {
    const fs::path amax_out(cal.amax_out);
    if (std::string how = Overlap(amax_out, source); !how.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("calibration.amax_out: ", cal.amax_out, " ",
                                                     how, " the source directory ",
                                                     spec->source));
    }
    for (const Field& input : inputs) {
      if (!input.path->empty() && Overlap(amax_out, fs::path(*input.path)) == "is") {
        return absl::InvalidArgumentError(absl::StrCat("calibration.amax_out: ", cal.amax_out,
                                                       " is ", input.name,
                                                       "; the job would overwrite its input"));
      }
    }
    std::error_code ec;
    if (fs::is_directory(amax_out, ec)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "calibration.amax_out: ", cal.amax_out, " is a directory; name the file to write"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckDirsUnclaimed(const JobSpec& spec, const std::vector<ClaimedDir>& claimed) {
  for (const auto& [field, path] : {std::pair<const char*, const std::string*>{"output", &spec.output},
                                    {"materialize_bf16", &spec.materialize_bf16},
                                    {"calibration.amax_out", &spec.calibration.amax_out}}) {
    if (path->empty()) continue;
    for (const ClaimedDir& c : claimed) {
      if (std::string how = Overlap(fs::path(*path), fs::path(c.dir)); !how.empty()) {
        return absl::FailedPreconditionError(
            absl::StrCat(field, ": ", *path, " ", how, " ", c.dir, ", an output of job ",
                         c.job_id, " (delete that job first to reuse its directory)"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace quantd::pipeline
