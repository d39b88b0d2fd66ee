// Layer checkpoints: the output activations of every slice of a decoder layer, kept on disk at a
// layer boundary, so that a restarted job resumes after the last layer whose outputs survive
// instead of from layer 0, with the bytes an uninterrupted run gives (the next layer reads the
// same activations, batch by batch, whether from memory, a spill file or a checkpoint). Written
// for the calibrate stage's (layer, slice) tasks; any layer-wise stage whose slice tasks hand
// their outputs to the next layer through an ActivationStore can use it the same way (the
// evaluate stage does, one "slice" per layer holding both models' outputs:
// evaluation/job_evaluation.h).
//
// Files, in the stage's checkpoint directory (LayerCheckpoints::dir()):
//   layer<L>.slice<S>.batch<i>.safetensors   one output batch (model::SpillActivations format)
//   layer<L>.slice<S>.json                   the slice's manifest:
//       {"layer": L, "slice": S, "batches": [{"file", "bytes", "tokens", "sha256"}...]}
// The manifest is the slice task's output: its path, size and SHA-256 are committed with the
// task (TaskOutput), so a restart trusts a batch file only through a chain of checksums: the
// store's for the manifest, the manifest's for each batch.
//
// When (ShouldPersist): a layer is checkpointed when `checkpoint_seconds` is 0, or when at least
// that many seconds passed since the last boundary was committed (or since the process started
// the job); the first slice of the layer to ask decides for all of them. A slice whose output is
// already spilled whole is checkpointed whatever the clock says: its spill files are hard-linked,
// nothing is written. A layer is a boundary once every slice of it is committed with a checkpoint
// (OnBoundaryCommitted); the checkpoints of earlier layers are then removed, so at most two
// boundaries are on disk: the last committed one and the one being written.
//
// Resume (ResumeLayers, in the source phase of a restart, files only): the last layer L whose
// every slice is DONE with a checkpoint that exists and matches the recorded size and SHA-256
// (and whose batch files match the manifest) is the resume point; a later candidate that fails
// any check is never trusted, the next earlier one is tried (a boundary removed on purpose fails
// as well), and with none the stage starts from layer 0. L's outputs go into the new
// ActivationStore (as files it reads but never removes), every other layer's checkpoint files are
// removed, and the caller requeues the DONE tasks after L (the store's requeue also requeues the
// tasks that depend on them). Tasks up to L stay DONE with their committed results.
#ifndef QUANTD_SERVER_CALIBRATION_LAYER_CHECKPOINT_H_
#define QUANTD_SERVER_CALIBRATION_LAYER_CHECKPOINT_H_

#include <stdint.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/calibration/activation_store.h"
#include "server/calibration/calibrate_layer.h"
#include "server/store/job_store.h"

namespace quantd::calibration {

// Milliseconds of a monotonic clock (std::chrono::steady_clock); tests pass their own.
using MonotonicMs = std::function<int64_t()>;
int64_t SteadyNowMs();

// Largest manifest read back (about 200 bytes per batch).
inline constexpr uint64_t kMaxCheckpointManifestBytes = 16ull << 20;

// A written checkpoint: the manifest, as the slice task records it (TaskOutput).
struct CheckpointFile {
  std::string path;
  uint64_t bytes = 0;     // the manifest's size
  std::string sha256;     // the manifest's SHA-256, hex
  int64_t batch_bytes = 0;  // bytes of the batch files it lists
};

class LayerCheckpoints {
 public:
  // Checkpoints in `dir` (created). `checkpoint_seconds`: calibration.checkpoint_seconds.
  static absl::StatusOr<std::unique_ptr<LayerCheckpoints>> Create(
      const std::string& dir, int64_t checkpoint_seconds, MonotonicMs now_ms = SteadyNowMs);
  LayerCheckpoints(const LayerCheckpoints&) = delete;
  LayerCheckpoints& operator=(const LayerCheckpoints&) = delete;

  const std::string& dir() const { return dir_; }

  // Whether a slice of `layer` whose output is spilled whole (`all_spilled`) or not checkpoints
  // it (see the policy above). Thread-safe.
  bool ShouldPersist(int64_t layer, bool all_spilled) ABSL_LOCKS_EXCLUDED(mu_);

  // Writes the checkpoint of (layer, slice): every batch (host ones written, spilled ones
  // hard-linked, or read back and written where the file system has no links), then the manifest
  // (atomically, last). Replaces an earlier checkpoint of the same slice. `on_batch` (may be
  // empty) is called after each batch file (the task's heartbeat). Thread-safe.
  absl::StatusOr<CheckpointFile> Persist(int64_t layer, int64_t slice,
                                         const std::vector<BatchActivations>& batches,
                                         const std::function<void()>& on_batch = nullptr) const;

  // Every slice of `layer` is committed with its checkpoint: the clock restarts and the
  // checkpoints of the layers before it are removed. Thread-safe.
  void OnBoundaryCommitted(int64_t layer) ABSL_LOCKS_EXCLUDED(mu_);

  // Removes the checkpoint files of every layer but `keep` (-1: of every layer), and the .tmp
  // files interrupted writes left.
  void RemoveAllBut(int64_t keep) const;

 private:
  LayerCheckpoints(std::string dir, int64_t checkpoint_seconds, MonotonicMs now_ms);
  // Removes the checkpoint files whose layer `drop` selects.
  void RemoveLayers(const std::function<bool(int64_t layer)>& drop) const;

  const std::string dir_;                 // where the files are
  const int64_t checkpoint_ms_;           // calibration.checkpoint_seconds, in ms
  const MonotonicMs now_ms_;              // the clock

  absl::Mutex mu_;  // guards the members below
  int64_t last_boundary_ms_ ABSL_GUARDED_BY(mu_);  // last OnBoundaryCommitted, or creation
  std::map<int64_t, bool> decided_ ABSL_GUARDED_BY(mu_);  // layer -> its clock decision
};

// A layer task of the stage as stored: its layer, its slice and its row (state, id, output).
struct LayerTask {
  int64_t layer = 0;
  int64_t slice = 0;
  store::TaskRow row;
};

// Where a layer-wise stage resumes.
struct ResumePoint {
  // Every layer task is DONE: nothing resumes, no activations are needed.
  bool finished = false;
  // The last layer whose checkpoints were verified and loaded; -1: the stage starts at layer 0.
  int64_t layer = -1;
  // The DONE layer tasks after `layer`: their inputs are gone, the caller requeues them.
  std::vector<int64_t> requeue;
  // One line per later boundary candidate that was not trusted, naming the file and the check.
  std::vector<std::string> rejected;
};

// Finds the resume point of the stage's layer tasks (`slices` per layer; every task of every
// layer), puts its layer's outputs into `store` (ActivationStore::PutCheckpointed) and removes
// the other layers' checkpoints (RemoveAllBut). Reads and hashes the candidate checkpoints: call it
// off the store's thread.
ResumePoint ResumeLayers(const std::vector<LayerTask>& tasks, int64_t slices,
                         const LayerCheckpoints& checkpoints, ActivationStore& store);

}  // namespace quantd::calibration

#endif  // QUANTD_SERVER_CALIBRATION_LAYER_CHECKPOINT_H_
