// The runtime state of one job's evaluate stage in this process (owned by its
// pipeline::PreparedJob, shared by the worker threads; thread-safe):
//   - the job's output opened as a DeepSeek-V4 model (on first use, by the first evaluate task,
//     which runs after export);
//   - both models' activations between decoder layers (a calibration::ActivationStore in host
//     memory: slot kSourceSlot and kQuantizedSlot of each layer);
//   - the figures of the evaluate tasks whose completion was committed, which the head and gate
//     tasks read.
// The stage's tasks run one after the other (each depends on the one before). The scheduler
// reports each finished evaluate task (OnTaskDone, after its completion is committed): a layer's
// releases the activations of the layer before, the head's those of the last layer.
//
// Held-out activations never spill: two copies (one per model) of num_samples x seq_len tokens of
// hc_mult x hidden_size floats (DeepSeek-V4 Pro, 32 x 512 tokens: 2 x 1.9 GB).
#ifndef QUANTD_SERVER_EVALUATION_JOB_EVALUATION_H_
#define QUANTD_SERVER_EVALUATION_JOB_EVALUATION_H_

#include <stdint.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/calibration/activation_store.h"
#include "server/evaluation/evaluation_batches.h"
#include "server/model/v4_weights.h"
#include "server/pipeline/stage.h"
#include "server/store/job_store.h"

namespace quantd::evaluation {

class JobEvaluation {
 public:
  // `output_dir`: the job's output checkpoint.
  static absl::StatusOr<std::unique_ptr<JobEvaluation>> Create(const std::string& output_dir);

  // The output as a V4 model, opened on the first call.
  absl::StatusOr<const model::V4Checkpoint*> Quantized() ABSL_LOCKS_EXCLUDED(mu_);

  // Stores both models' outputs of `layer` (replacing an earlier run's).
  void PutOutput(int64_t layer, Batches source, Batches quantized);
  // Both models' outputs of `layer`; nullopt when they are not in this process.
  std::optional<EvaluationBatches> Output(int64_t layer) const;

  // An evaluate task's completion was committed with `output` (its figures).
  void OnTaskDone(const pipeline::TaskOutput& output) ABSL_LOCKS_EXCLUDED(mu_);
  // The committed figures of every layer so far, by layer.
  std::map<int64_t, store::EvaluationLayerRow> Layers() const ABSL_LOCKS_EXCLUDED(mu_);
  // The head's committed figures; nullopt before it finished in this process.
  std::optional<store::EvaluationRow> Figures() const ABSL_LOCKS_EXCLUDED(mu_);

  static constexpr int64_t kSourceSlot = 0;     // ActivationStore slice of the source model
  static constexpr int64_t kQuantizedSlot = 1;  // and of the quantized model

 private:
  JobEvaluation(std::string output_dir, std::unique_ptr<calibration::ActivationStore> store)
      : output_dir_(std::move(output_dir)), activations_(std::move(store)) {}

  const std::string output_dir_;                                  // the job's output
  const std::unique_ptr<calibration::ActivationStore> activations_;  // thread-safe itself

  mutable absl::Mutex mu_;  // guards the members below
  std::unique_ptr<model::V4Checkpoint> quantized_ ABSL_GUARDED_BY(mu_);  // opened on first use
  std::map<int64_t, store::EvaluationLayerRow> layers_ ABSL_GUARDED_BY(mu_);
  std::optional<store::EvaluationRow> figures_ ABSL_GUARDED_BY(mu_);
};

}  // namespace quantd::evaluation

#endif  // QUANTD_SERVER_EVALUATION_JOB_EVALUATION_H_
