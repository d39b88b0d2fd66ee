#include "server/job/job_paths.h"

#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/base/utf8.h"

namespace quantd::job {
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

// A path field of a spec.
struct PathField {
  std::string name;   // as errors name it
  std::string* path;  // in the spec
};

// PathFields lists what a job writes (source included) before the files it only reads, which
// start at this index.
constexpr size_t kFirstInputField = 4;

// Every path field of `spec`.
std::vector<PathField> PathFields(JobSpec* spec) {
  CalibrationSpec& cal = spec->calibration;
  std::vector<PathField> fields = {{"source", &spec->source},
                                   {"output", &spec->output},
                                   {"materialize_bf16", &spec->materialize_bf16},
                                   {"calibration.amax_out", &cal.amax_out},
                                   {"calibration.amax_file", &cal.amax_file},
                                   {"calibration.dataset", &cal.dataset}};
  for (size_t i = 0; i < cal.datasets.size(); ++i) {
    fields.push_back({absl::StrCat("calibration.datasets[", i, "].path"), &cal.datasets[i].path});
  }
  return fields;
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

absl::Status CheckPathText(absl::string_view field, const std::string& path) {
  if (path.size() > kMaxPathBytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", path.size(),
                                                   " bytes, longer than the limit of ",
                                                   kMaxPathBytes, " (PATH_MAX)"));
  }
  if (path.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": contains a NUL byte"));
  }
  if (base::FirstInvalidUtf8(path).has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": is not valid UTF-8"));
  }
  return absl::OkStatus();
}

absl::Status ResolveJobPaths(JobSpec* spec, bool allow_relative) {
  const std::vector<PathField> fields = PathFields(spec);
  for (const PathField& f : fields) {
    if (absl::Status s = Resolve(f.name, allow_relative, f.path); !s.ok()) return s;
  }
  const CalibrationSpec& cal = spec->calibration;
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
    for (size_t i = kFirstInputField; i < fields.size(); ++i) {
      const PathField& input = fields[i];
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

absl::Status CheckJobPathsUnchanged(const JobSpec& spec) {
  JobSpec stored = spec;
  for (const PathField& f : PathFields(&stored)) {
    const fs::path path(*f.path);
    if (path.empty() || path.is_relative()) continue;
    // The path was canonical at submit: no component of it was a symbolic link then.
    fs::path prefix;
    for (const fs::path& component : path) {
      prefix /= component;
      struct stat st;
      if (lstat(prefix.c_str(), &st) != 0) break;  // absent: created later by the job itself
      if (!S_ISLNK(st.st_mode)) continue;
      std::error_code ec;
      const fs::path target = fs::read_symlink(prefix, ec);
      return absl::FailedPreconditionError(absl::StrCat(
          f.name, ": ", path.string(), " now leads through the symbolic link ", prefix.string(),
          " (to ", ec ? "?" : target.string(),
          "), which was not there when the job was submitted; quantd does not follow it"));
    }
  }
  if (absl::Status s = ResolveJobPaths(&stored, /*allow_relative=*/true); !s.ok()) {
    return absl::FailedPreconditionError(s.message());
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
        return absl::FailedPreconditionError(absl::StrCat(
            field, ": ", *path, " ", how, " ", c.dir,
            c.amax_out ? ", the calibration.amax_out of job " : ", an output of job ", c.job_id,
            c.amax_out ? " (delete that job first to reuse its file)"
                       : " (delete that job first to reuse its directory)"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace quantd::job
