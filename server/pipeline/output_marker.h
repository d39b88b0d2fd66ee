// OutputMarker: the claim a job lays on a directory it writes (its output, its materialize_bf16
// copy), so that quantd never writes into a directory that holds someone else's files by accident
// and two processes never write one directory at once.
//
// The claim is <dir>/.quantd-job, a JSON file
// {"job_id": N, "created_ms": T, "store": PATH, "foreign": [NAME...]} written before anything
// else in the directory (JobIdentity: which job of which state database), and flock'ed for as long as the OutputMarker lives (the job's process
// writes there). Claim():
//   absent or empty directory                 claimed (created when absent)
//   the marker of this job                    claimed again: a rerun resumes there
//   no marker, and every entry a done output of this job whose size and SHA-256 match the store
//   (or a *.tmp file)                         adopted: a job an earlier release began (it wrote no
//                                             marker) resumes there; *.tmp files that are not the
//                                             job's own temporary names are recorded as foreign
//   otherwise non-empty (no marker, or another job's)
//                                             refused, naming the first entry that stopped an
//                                             adoption, unless `overwrite`; with it, claimed, and
//                                             every entry present now is recorded as foreign
//   the lock held by another process          refused
// Foreign entries are files quantd did not write: the job never deletes, truncates or replaces
// them (RefuseForeign before any task runs, IsForeign when sweeping .tmp files).
#ifndef QUANTD_SERVER_PIPELINE_OUTPUT_MARKER_H_
#define QUANTD_SERVER_PIPELINE_OUTPUT_MARKER_H_

#include <stdint.h>

#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "server/checkpoint/dir_handle.h"

namespace quantd::pipeline {

// The job a marker names. Job ids are per state database, and the id of a deleted job may be
// given again, so its creation time is part of its identity.
struct JobIdentity {
  int64_t job_id = 0;
  int64_t created_ms = 0;
  std::string store;  // the state database, absolute

  bool operator==(const JobIdentity& other) const {
    return job_id == other.job_id && created_ms == other.created_ms && store == other.store;
  }
};

// What a job has written into a directory as far as its store knows, for adopting the directory.
struct OwnFiles {
  // Top-level names of the job's done outputs there whose size and SHA-256 were just checked
  // against the store. Empty: there is nothing to adopt.
  std::set<std::string> outputs;
  // Every top-level name the job writes there: "<name>.tmp" of one of them is the job's own.
  std::set<std::string> written;
};

class OutputMarker {
 public:
  static constexpr char kFileName[] = ".quantd-job";
  // A marker larger than this is not quantd's.
  static constexpr uint64_t kMaxMarkerBytes = 16 << 20;

  // Claims `dir` (absolute, canonical) for `job`. `field` ("output", "materialize_bf16") names
  // the directory in errors, which are FailedPrecondition. A refusal removes the marker this call
  // created, then `dir` when this call created it and it is empty.
  static absl::StatusOr<std::unique_ptr<OutputMarker>> Claim(const std::string& field,
                                                             const std::string& dir,
                                                             const JobIdentity& job,
                                                             bool overwrite,
                                                             const OwnFiles& own = {});
  // For a remote worker (`quantd worker`) of a job whose coordinator holds the claim: opens `dir`
  // (absolute) and checks that its marker names `job`, without the lock (the coordinator holds
  // it) and without writing anything. FailedPrecondition naming `field` and the directory when
  // the marker is missing or names another job (not the same storage as the coordinator's).
  static absl::StatusOr<std::unique_ptr<OutputMarker>> Join(const std::string& field,
                                                            const std::string& dir,
                                                            const JobIdentity& job);
  // Releases the lock; the file stays, so that a rerun of the job finds its claim.
  ~OutputMarker();
  OutputMarker(const OutputMarker&) = delete;
  OutputMarker& operator=(const OutputMarker&) = delete;

  // The claimed directory, opened once by Claim (checkpoint/dir_handle.h): the job writes,
  // renames and removes its files only beneath it.
  const checkpoint::DirHandle& dir() const { return handle_; }
  // Whether Claim adopted a directory without a marker (see the table above).
  bool adopted() const { return adopted_; }
  // Whether the top-level entry `name` was in the directory before quantd claimed it.
  bool IsForeign(const std::string& name) const { return foreign_.count(name) > 0; }
  // FailedPrecondition naming the first of `names` (top-level entries the job will write, each
  // also through `<name>.tmp`) that is foreign.
  absl::Status RefuseForeign(const std::vector<std::string>& names) const;

  // For a job that fails before any of its tasks ran: undoes what this claim created, and nothing
  // else. Removes the marker when this Claim wrote it (not the job's own marker from an earlier
  // start, nor one in an adopted directory), then the directory when this Claim created it and it
  // is empty. The lock is held until the OutputMarker is destroyed.
  void Withdraw();

 private:
  OutputMarker(std::string field, std::string dir, checkpoint::DirHandle handle, int fd,
               std::set<std::string> foreign, bool adopted, bool wrote_marker, bool created_dir)
      : field_(std::move(field)),
        dir_(std::move(dir)),
        handle_(std::move(handle)),
        fd_(fd),
        foreign_(std::move(foreign)),
        adopted_(adopted),
        wrote_marker_(wrote_marker),
        created_dir_(created_dir) {}

  std::string field_;              // spec field naming the directory, for errors
  std::string dir_;                // the claimed directory
  checkpoint::DirHandle handle_;   // dir_, opened once
  int fd_;                         // the open, flock'ed marker file
  std::set<std::string> foreign_;  // entries present before the claim (overwrite or adoption)
  bool adopted_;                   // claimed by adoption
  bool wrote_marker_;              // the marker is this Claim's (the job had none there)
  bool created_dir_;               // Claim created the directory itself
};

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_OUTPUT_MARKER_H_
