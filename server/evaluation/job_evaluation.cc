#include "server/evaluation/job_evaluation.h"

#include <utility>

#include "server/base/status_macros.h"
#include "server/calibration/calibrate_layer.h"

namespace quantd::evaluation {

absl::StatusOr<std::unique_ptr<JobEvaluation>> JobEvaluation::Create(
    const std::string& output_dir) {
  // No spill directory: every output stays in host memory.
  ASSIGN_OR_RETURN(std::unique_ptr<calibration::ActivationStore> store,
                   calibration::ActivationStore::Create("", 0));
  return std::unique_ptr<JobEvaluation>(new JobEvaluation(output_dir, std::move(store)));
}

absl::StatusOr<const model::V4Checkpoint*> JobEvaluation::Quantized() {
  absl::MutexLock lock(&mu_);
  if (quantized_ == nullptr) {
    ASSIGN_OR_RETURN(quantized_, model::OpenV4Checkpoint(output_dir_));
  }
  return quantized_.get();
}

void JobEvaluation::PutOutput(int64_t layer, Batches source, Batches quantized) {
  for (const Batches* batches : {&source, &quantized}) {
    for (const calibration::BatchActivations& b : *batches) {
      activations_->ReserveHost(calibration::HostBytes(b.host));  // never refused: no spill dir
    }
  }
  activations_->Put(layer, kSourceSlot, std::move(source));
  activations_->Put(layer, kQuantizedSlot, std::move(quantized));
}

std::optional<EvaluationBatches> JobEvaluation::Output(int64_t layer) const {
  EvaluationBatches batches{activations_->Get(layer, kSourceSlot),
                            activations_->Get(layer, kQuantizedSlot)};
  if (batches.source == nullptr || batches.quantized == nullptr) return std::nullopt;
  return batches;
}

void JobEvaluation::OnTaskDone(const pipeline::TaskOutput& output) {
  absl::MutexLock lock(&mu_);
  if (output.evaluation_layer.has_value()) {
    const int64_t layer = output.evaluation_layer->layer;
    layers_[layer] = *output.evaluation_layer;
    if (layer > 0) activations_->ReleaseLayer(layer - 1);
  }
  if (output.evaluation.has_value()) {
    figures_ = output.evaluation;
    if (!layers_.empty()) activations_->ReleaseLayer(layers_.rbegin()->first);
  }
}

std::map<int64_t, store::EvaluationLayerRow> JobEvaluation::Layers() const {
  absl::MutexLock lock(&mu_);
  return layers_;
}

std::optional<store::EvaluationRow> JobEvaluation::Figures() const {
  absl::MutexLock lock(&mu_);
  return figures_;
}

}  // namespace quantd::evaluation
