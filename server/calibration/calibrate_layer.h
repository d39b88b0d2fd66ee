// One calibration step: a decoder layer over a slice of the samples. Loads the layer on a device,
// runs the slice's batches through it with an AmaxObserver, and hands back the layer's amax table
// for the slice and the output activations: in host memory, or spilled to files checked by
// SHA-256 when read back. The calibrate stage runs one per (layer, slice) task; `quantd
// calibrate` runs them in order on the CPU.
#ifndef QUANTD_SERVER_CALIBRATION_CALIBRATE_LAYER_H_
#define QUANTD_SERVER_CALIBRATION_CALIBRATE_LAYER_H_

#include <stdint.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/calibration/amax_table.h"
#include "server/compute/device.h"
#include "server/model/v4_activations.h"
#include "server/model/v4_numerics.h"
#include "server/model/v4_weights.h"

namespace quantd::calibration {

// Activations of one batch (sequences of equal length) between layers: in memory, or spilled.
struct BatchActivations {
  model::V4Activations host;  // empty (no sequences) when spilled
  std::string spill_path;     // "" when in host memory
  std::string spill_sha256;   // lowercase hex of the spill file
  int64_t tokens = 0;         // sequences * seq_len, in either state
};

// The sequences of a slice grouped into batches of equal length, each batch's working memory at
// most `batch_bytes` (EstimateBatchBytes; a sequence over the budget gets a batch of its own).
// `sample_ids` are the token ids of the slice's samples in order; sample k lands in the batch
// order of first appearance of its length. Every sample must be non-empty.
absl::StatusOr<std::vector<BatchActivations>> EmbedSlice(
    const model::V4Checkpoint& ckpt, const std::vector<std::vector<int32_t>>& sample_ids,
    int64_t batch_bytes);

// Bytes one RunLayer call needs for `sequences` sequences of `seq_len` tokens, an upper-bound
// estimate: the streams in and out, the attention and MoE intermediates per token, and the
// attention scores per sequence.
int64_t EstimateBatchBytes(const model::V4Config& config, int64_t sequences, int64_t seq_len);

struct SliceOptions {
  model::Numerics numerics = model::Numerics::kOfficial;
  std::string slice;      // names the slice in the amax table: "layer 3 slice 0 of 2"
  int64_t slice_index = 0;  // names its spill files
  std::string spill_dir;  // "" keeps the output in host memory; else it is spilled here
  // calibrate_all_experts: every routed expert's amax also covers the tokens not routed to it
  // (ForwardContext::observe_all_experts); the output is unchanged.
  bool all_experts = false;
};

// Wall time of one slice, in seconds.
struct SliceTiming {
  double load = 0.0;     // LoadLayer: read and decode the weights
  double forward = 0.0;  // RunLayer, less the time spent recording amax
  double record = 0.0;   // the observer
  double spill = 0.0;    // reading spilled inputs and writing spilled outputs
};

struct SliceResult {
  AmaxTable amax;                        // the layer's rows for this slice, named options.slice
  std::vector<BatchActivations> output;  // one per input batch, in order
  SliceTiming timing;
};

// Runs decoder layer `layer` over `input` (a slice's batches, in memory or spilled; spilled inputs
// are verified against their SHA-256 and removed once read). Output spill files are named
// "<spill_dir>/layer<L>.slice<S>.batch<i>.safetensors". Errors name the layer; an observer
// violation (w2 bound, non-finite input) fails the slice.
absl::StatusOr<SliceResult> CalibrateLayerSlice(const model::V4Checkpoint& ckpt, int64_t layer,
                                                std::vector<BatchActivations> input,
                                                compute::Device& device,
                                                const SliceOptions& options);

// Drops the batches' activations: frees the host copies and removes the spill files.
void ReleaseBatches(std::vector<BatchActivations>& batches);

}  // namespace quantd::calibration

#endif  // QUANTD_SERVER_CALIBRATION_CALIBRATE_LAYER_H_
