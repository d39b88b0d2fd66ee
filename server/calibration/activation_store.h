// A calibrating job's activations between decoder layers: the output batches of every (layer,
// slice) task, kept until every slice of the next layer has read them. Outputs stay in host memory
// while the job's host budget allows and are spilled (checksummed safetensors files, see
// calibrate_layer.h) into the store's own spill directory beyond it. Thread-safe: slices of a layer
// run on several workers at once while the scheduler releases the layer before.
//
// Spill files live only as long as the process: the store removes every spill file it wrote when
// a layer is released and when it is destroyed (the job ended, was paused, or the process stops),
// and a new store removes what an earlier one left in the job's work directory (a crash). What
// outlives the process is a layer checkpoint (layer_checkpoint.h): a restart puts the resume
// layer's checkpoint files into the new store (PutCheckpointed), which reads them but leaves their
// removal to the checkpoints.
#ifndef QUANTD_SERVER_CALIBRATION_ACTIVATION_STORE_H_
#define QUANTD_SERVER_CALIBRATION_ACTIVATION_STORE_H_

#include <stdint.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/calibration/calibrate_layer.h"

namespace quantd::calibration {

class ActivationStore {
 public:
  using Batches = std::vector<BatchActivations>;

  // A store spilling into a new directory "spill-<pid>-<n>" of `work_dir` (created), after
  // removing the spill directories earlier stores left there. `work_dir` "": nothing is ever
  // spilled (every output stays in host memory, whatever the budget).
  static absl::StatusOr<std::unique_ptr<ActivationStore>> Create(const std::string& work_dir,
                                                                 int64_t host_budget_bytes);
  ~ActivationStore();
  ActivationStore(const ActivationStore&) = delete;
  ActivationStore& operator=(const ActivationStore&) = delete;

  // Reserves `bytes` of the host budget for an output batch; false (nothing reserved) when they
  // do not fit: the batch is then spilled.
  bool ReserveHost(int64_t bytes);
  // Returns reserved bytes whose batch was never stored (its task failed).
  void UnreserveHost(int64_t bytes);

  // Stores (layer, slice)'s output, whose host batches were reserved. Replaces (and releases) what
  // an earlier run of the same task stored.
  void Put(int64_t layer, int64_t slice, Batches batches);
  // Stores (layer, slice)'s output read from a layer checkpoint: spilled batches whose files the
  // store reads (verified against their SHA-256, as spill files are) but never removes.
  void PutCheckpointed(int64_t layer, int64_t slice, Batches batches);
  // The output of (layer, slice), or nullptr when it is not here (never produced, released, or
  // lost with an earlier process).
  std::shared_ptr<const Batches> Get(int64_t layer, int64_t slice) const;
  // Drops every slice's output of `layer`: its host bytes return to the budget, its spill files
  // are removed.
  void ReleaseLayer(int64_t layer);

  // "" when the store never spills.
  const std::string& spill_dir() const { return spill_dir_; }
  int64_t host_bytes() const;
  // Peak of host_bytes() so far.
  int64_t peak_host_bytes() const;

 private:
  ActivationStore(std::string spill_dir, int64_t host_budget_bytes)
      : spill_dir_(std::move(spill_dir)), budget_(host_budget_bytes) {}
  struct Output {
    std::shared_ptr<const Batches> batches;  // shared with the tasks reading them
    bool owns_files = true;                  // false: the files belong to a layer checkpoint
  };
  // Stores `output` under (layer, slice), dropping what was there.
  void Store(int64_t layer, int64_t slice, Output output) ABSL_LOCKS_EXCLUDED(mu_);
  // Frees one stored output: host bytes unreserved, its own spill files removed.
  void Drop(const Output& output) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string spill_dir_;  // this store's own directory
  const int64_t budget_;         // host bytes the outputs may take

  mutable absl::Mutex mu_;  // guards the members below
  int64_t reserved_ ABSL_GUARDED_BY(mu_) = 0;  // host bytes reserved or stored
  int64_t peak_ ABSL_GUARDED_BY(mu_) = 0;      // largest reserved_ seen
  // (layer, slice) -> its output.
  std::map<std::pair<int64_t, int64_t>, Output> outputs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace quantd::calibration

#endif  // QUANTD_SERVER_CALIBRATION_ACTIVATION_STORE_H_
