#include "server/pipeline/output_marker.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <optional>
#include <system_error>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "server/checkpoint/json_file.h"

namespace quantd::pipeline {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// What a marker file says.
struct MarkerContent {
  JobIdentity job;
  std::set<std::string> foreign;
};

// Reads the whole marker through `fd` (at most kMaxMarkerBytes).
absl::StatusOr<std::string> ReadMarker(int fd, const std::string& path) {
  std::string text;
  char buffer[1 << 16];
  for (off_t offset = 0;;) {
    const ssize_t n = pread(fd, buffer, sizeof(buffer), offset);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::ErrnoToStatus(errno, absl::StrCat(path, ": read failed"));
    if (n == 0) return text;
    text.append(buffer, static_cast<size_t>(n));
    offset += n;
    if (text.size() > OutputMarker::kMaxMarkerBytes) {
      return absl::FailedPreconditionError(
          absl::StrCat(path, ": larger than ", OutputMarker::kMaxMarkerBytes,
                       " bytes, not a quantd marker"));
    }
  }
}

absl::StatusOr<MarkerContent> ParseMarker(const std::string& text, const std::string& path) {
  absl::StatusOr<json> j = checkpoint::ParseJsonText(text, path);
  const auto not_ours = [&] {
    return absl::FailedPreconditionError(absl::StrCat(path, ": not a quantd marker"));
  };
  if (!j.ok() || !j->is_object()) return not_ours();
  MarkerContent m;
  const auto id = j->find("job_id");
  const auto created = j->find("created_ms");
  const auto store = j->find("store");
  const auto foreign = j->find("foreign");
  if (id == j->end() || !id->is_number_integer() || created == j->end() ||
      !created->is_number_integer() || store == j->end() || !store->is_string() ||
      foreign == j->end() || !foreign->is_array()) {
    return not_ours();
  }
  m.job = {id->get<int64_t>(), created->get<int64_t>(), store->get<std::string>()};
  for (const json& name : *foreign) {
    if (!name.is_string()) return not_ours();
    m.foreign.insert(name.get<std::string>());
  }
  return m;
}

// Replaces the marker's content through `fd` and makes it durable.
absl::Status WriteMarker(int fd, const std::string& path, const MarkerContent& m) {
  const json j = {{"job_id", m.job.job_id},
                  {"created_ms", m.job.created_ms},
                  {"store", m.job.store},
                  {"foreign", m.foreign}};
  const std::string text = j.dump() + "\n";
  if (ftruncate(fd, 0) != 0) return absl::ErrnoToStatus(errno, absl::StrCat(path, ": truncate"));
  for (size_t done = 0; done < text.size();) {
    const ssize_t n = pwrite(fd, text.data() + done, text.size() - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::ErrnoToStatus(errno, absl::StrCat(path, ": write failed"));
    done += static_cast<size_t>(n);
  }
  if (fsync(fd) != 0) return absl::ErrnoToStatus(errno, absl::StrCat(path, ": fsync failed"));
  return absl::OkStatus();
}

// The top-level entries of `dir` but the marker.
absl::StatusOr<std::set<std::string>> ListEntries(const checkpoint::DirHandle& dir) {
  absl::StatusOr<std::vector<checkpoint::DirEntry>> entries = dir.List();
  if (!entries.ok()) return absl::FailedPreconditionError(entries.status().message());
  std::set<std::string> names;
  for (const checkpoint::DirEntry& e : *entries) {
    if (e.name != OutputMarker::kFileName) names.insert(e.name);
  }
  return names;
}

// Whether `entries` (a directory without a marker) hold only what `own` adopts; sets *foreign to
// the *.tmp entries that are not the job's own temporary names. Otherwise sets *refused to the
// first entry that is neither a checked output nor a *.tmp file.
bool Adoptable(const std::set<std::string>& entries, const OwnFiles& own,
               std::set<std::string>* foreign, std::string* refused) {
  constexpr absl::string_view kTmp = ".tmp";
  if (own.outputs.empty()) return false;
  for (const std::string& name : entries) {
    if (own.outputs.count(name) != 0) continue;
    if (!absl::EndsWith(name, kTmp)) {
      *refused = name;
      return false;
    }
    if (own.written.count(name.substr(0, name.size() - kTmp.size())) == 0) foreign->insert(name);
  }
  return true;
}

// Creates `dir` and its missing parents; true when `dir` itself was created. An absolute path is
// created one component at a time from "/" without following a symbolic link (a parent swapped
// for a link cannot make quantd create directories elsewhere); a relative one (specs stored by an
// earlier release) with std::filesystem.
absl::StatusOr<bool> CreateDirectories(const std::string& field, const std::string& dir) {
  if (dir.empty() || dir.front() != '/') {
    std::error_code ec;
    const bool created = fs::create_directories(dir, ec);
    if (ec) {
      return absl::FailedPreconditionError(
          absl::StrCat(field, ": cannot create directory ", dir, ": ", ec.message()));
    }
    return created;
  }
  absl::string_view rel(dir);
  while (!rel.empty() && rel.front() == '/') rel.remove_prefix(1);
  while (!rel.empty() && rel.back() == '/') rel.remove_suffix(1);
  if (rel.empty()) return false;
  absl::StatusOr<checkpoint::DirHandle> root = checkpoint::DirHandle::Open(field, "/");
  if (!root.ok()) return root.status();
  const bool absent = absl::IsNotFound(root->Stat(rel).status());
  if (absl::Status s = root->MakeDirs(rel); !s.ok()) return s;
  return absent;
}

}  // namespace

absl::StatusOr<std::unique_ptr<OutputMarker>> OutputMarker::Claim(const std::string& field,
                                                                  const std::string& dir,
                                                                  const JobIdentity& job,
                                                                  bool overwrite,
                                                                  const OwnFiles& own) {
  absl::StatusOr<bool> made = CreateDirectories(field, dir);
  if (!made.ok()) return absl::FailedPreconditionError(made.status().message());
  const bool created_dir = *made;
  // From here on every name in the directory is resolved beneath this handle: the directory
  // cannot be swapped for a link to somewhere else under the job.
  absl::StatusOr<checkpoint::DirHandle> handle = checkpoint::DirHandle::Open(field, dir);
  if (!handle.ok()) return absl::FailedPreconditionError(handle.status().message());
  const std::string path = absl::StrCat(dir, "/", kFileName);
  const int flags = O_RDWR | O_NONBLOCK;
  bool created = true;
  absl::StatusOr<int> opened = handle->OpenAt(kFileName, flags | O_CREAT | O_EXCL, 0644);
  if (absl::IsAlreadyExists(opened.status())) {
    created = false;
    opened = handle->OpenAt(kFileName, flags);
  }
  if (!opened.ok()) return absl::FailedPreconditionError(opened.status().message());
  const int fd = *opened;
  // From here on, a refusal closes the file and removes it when this call created it, then the
  // directory when this call created it and it is empty again.
  const auto refuse = [&](const std::string& message) {
    close(fd);
    if (created) handle->Remove(kFileName).IgnoreError();
    if (created_dir) rmdir(dir.c_str());  // fails, harmlessly, unless it is empty or a link
    return absl::FailedPreconditionError(absl::StrCat(field, ": ", message));
  };
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    return refuse(absl::StrCat(path, " is not a regular file"));
  }
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    return refuse(absl::StrCat(dir, " is being written by another quantd process (", path,
                               " is locked)"));
  }
  absl::StatusOr<std::string> text = ReadMarker(fd, path);
  if (!text.ok()) return refuse(std::string(text.status().message()));
  std::optional<MarkerContent> previous;
  if (!text->empty()) {
    absl::StatusOr<MarkerContent> parsed = ParseMarker(*text, path);
    if (!parsed.ok()) return refuse(std::string(parsed.status().message()));
    previous = *std::move(parsed);
    if (previous->job == job) {
      return std::unique_ptr<OutputMarker>(new OutputMarker(field, dir, *std::move(handle), fd,
                                                            std::move(previous->foreign),
                                                            /*adopted=*/false,
                                                            /*wrote_marker=*/false, created_dir));
    }
  }
  absl::StatusOr<std::set<std::string>> entries = ListEntries(*handle);
  if (!entries.ok()) return refuse(std::string(entries.status().message()));
  std::set<std::string> adopted_foreign;
  std::string not_adopted;  // the entry that stopped an adoption
  const bool adopt = !previous.has_value() && !entries->empty() && !overwrite &&
                     Adoptable(*entries, own, &adopted_foreign, &not_adopted);
  if (!entries->empty() && !overwrite && !adopt) {
    std::string whose =
        previous.has_value()
            ? absl::StrCat("holds the output of job ", previous->job.job_id, " of ",
                           previous->job.store)
            : absl::StrCat("is not empty (", entries->size(),
                           " entries) and holds no quantd marker");
    if (!not_adopted.empty()) {
      absl::StrAppend(&whose, "; ", dir, "/", not_adopted,
                      " is not an output this job finished (with its recorded size and SHA-256), "
                      "so quantd does not adopt the directory");
    }
    return refuse(absl::StrCat(dir, " ", whose,
                               "; use an empty directory, or set overwrite to write next to "
                               "the files there (quantd never replaces or deletes them)"));
  }
  MarkerContent mine{job, adopt ? std::move(adopted_foreign) : *std::move(entries)};
  if (absl::Status s = WriteMarker(fd, path, mine); !s.ok()) {
    return refuse(std::string(s.message()));
  }
  return std::unique_ptr<OutputMarker>(new OutputMarker(
      field, dir, *std::move(handle), fd, std::move(mine.foreign), adopt, /*wrote_marker=*/true,
      created_dir));
}

absl::StatusOr<std::unique_ptr<OutputMarker>> OutputMarker::Join(const std::string& field,
                                                                 const std::string& dir,
                                                                 const JobIdentity& job) {
  absl::StatusOr<checkpoint::DirHandle> handle = checkpoint::DirHandle::Open(field, dir);
  if (!handle.ok()) return absl::FailedPreconditionError(handle.status().message());
  const std::string path = absl::StrCat(dir, "/", kFileName);
  struct stat st;
  absl::StatusOr<int> fd = handle->OpenRegularFile(kFileName, &st);
  if (!fd.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat(field, ": ", path, " cannot be read (", fd.status().message(),
                     "); does this node mount the coordinator's storage at the same path?"));
  }
  absl::StatusOr<std::string> text = ReadMarker(*fd, path);
  absl::StatusOr<MarkerContent> marker =
      text.ok() ? ParseMarker(*text, path) : absl::StatusOr<MarkerContent>(text.status());
  if (!marker.ok()) {
    close(*fd);
    return absl::FailedPreconditionError(absl::StrCat(field, ": ", marker.status().message()));
  }
  if (!(marker->job == job)) {
    close(*fd);
    return absl::FailedPreconditionError(absl::StrCat(
        field, ": ", path, " names job ", marker->job.job_id, " of ", marker->job.store,
        ", not job ", job.job_id, " of ", job.store,
        "; does this node mount the coordinator's storage at the same path?"));
  }
  return std::unique_ptr<OutputMarker>(new OutputMarker(field, dir, *std::move(handle), *fd,
                                                        std::move(marker->foreign),
                                                        /*adopted=*/false,
                                                        /*wrote_marker=*/false,
                                                        /*created_dir=*/false));
}

OutputMarker::~OutputMarker() { close(fd_); }

void OutputMarker::Withdraw() {
  if (!wrote_marker_ || adopted_) return;
  // Removed while still locked, so no other process claims it in between. Failures leave the
  // claim in place, which a rerun of the job takes again.
  handle_.Remove(kFileName).IgnoreError();
  wrote_marker_ = false;
  if (created_dir_) rmdir(dir_.c_str());  // fails, harmlessly, unless it is empty or a link
  created_dir_ = false;
}

absl::Status OutputMarker::RefuseForeign(const std::vector<std::string>& names) const {
  for (const std::string& name : names) {
    for (const std::string& written : {name, absl::StrCat(name, ".tmp")}) {
      if (!IsForeign(written)) continue;
      return absl::FailedPreconditionError(absl::StrCat(
          field_, ": ", dir_, "/", written,
          " was there before quantd claimed the directory and this job would replace it; "
          "quantd never replaces files it did not write: move it away or use another directory"));
    }
  }
  return absl::OkStatus();
}

}  // namespace quantd::pipeline
