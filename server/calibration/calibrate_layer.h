// One calibration step: a decoder layer over a slice of the samples. Loads the layer on a device,
// runs the slice's batches through it with an AmaxObserver, and hands back the layer's amax table
// for the slice and the output activations: in host memory, or spilled to files checked by
// SHA-256 when read back. The calibrate stage runs one per (layer, slice) task; `quantd
// calibrate` runs them in order on the CPU.
#ifndef QUANTD_SERVER_CALIBRATION_CALIBRATE_LAYER_H_
#define QUANTD_SERVER_CALIBRATION_CALIBRATE_LAYER_H_

#include <stdint.h>

#include <atomic>
#include <functional>
#include <string>
#include <utility>
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

// Working memory per RunLayer call when the caller does not say (quantd calibrate --batch-bytes,
// the calibrate stage).
inline constexpr int64_t kDefaultBatchBytes = int64_t{1} << 30;

// The samples grouped into batches of equal length, each batch's working memory at most
// `batch_bytes` (EstimateBatchBytes; a sequence over the budget gets a batch of its own): the
// indices into `lengths` of each batch's samples. Lengths appear in order of first appearance,
// samples in their order. The batches alone fix the forward's result (a sequence's GEMMs may
// differ in the last bit with the sequences that share them), so data-parallel slices are
// contiguous runs of whole batches (SliceBatches), never regrouped. Every length must be > 0.
absl::StatusOr<std::vector<std::vector<size_t>>> PlanBatches(const model::V4Config& config,
                                                             const std::vector<int64_t>& lengths,
                                                             int64_t batch_bytes);

// Batches [first, end) of slice `slice` of `slices` over `batches` batches: contiguous, in order,
// sizes differing by at most one.
std::pair<int64_t, int64_t> SliceBatches(int64_t batches, int64_t slice, int64_t slices);

// The embedding of one planned batch: the samples `members` of `sample_ids`, equal in length.
absl::StatusOr<BatchActivations> EmbedBatch(const model::V4Checkpoint& ckpt,
                                            const std::vector<std::vector<int32_t>>& sample_ids,
                                            const std::vector<size_t>& members);

// Bytes a batch's activations take in host memory.
int64_t HostBytes(const model::V4Activations& acts);

// Every planned batch of the samples, embedded (PlanBatches, then EmbedBatch each).
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
  std::string spill_dir;  // where outputs that do not stay in host memory are spilled
  // Asked once per output batch with its HostBytes: true keeps it in host memory (the callee
  // accounts for it), false spills it into spill_dir. Unset: spill when spill_dir is set.
  std::function<bool(int64_t bytes)> keep_in_host;
  // Called after each batch with the token rows it moved through the layer (progress).
  std::function<void(int64_t tokens)> on_batch;
  // Called while the layer loads (per expert) and inside each batch (per product): the task's
  // sign of life between batches that may take minutes at the real width. May be empty.
  std::function<void()> alive;
  // The last layer's output is needed by nobody: drop it instead of keeping or spilling it.
  bool discard_output = false;
  // calibrate_all_experts: every routed expert's amax also covers the tokens not routed to it
  // (ForwardContext::observe_all_experts); the output is unchanged.
  bool all_experts = false;
};

// Wall time of one slice, in seconds.
struct SliceTiming {
  double load = 0.0;     // LoadLayer: read and decode the weights
  double decode = 0.0;   // decoding routed experts inside RunLayer (one at a time)
  double forward = 0.0;  // RunLayer, less decoding and recording amax
  double record = 0.0;   // the observer
  double spill = 0.0;    // reading spilled inputs and writing spilled outputs
};

struct SliceResult {
  AmaxTable amax;                        // the layer's rows for this slice, named options.slice
  std::vector<BatchActivations> output;  // one per input batch, in order (none when discarded)
  int64_t tokens = 0;                    // token rows the slice moved through the layer
  SliceTiming timing;
};

// Runs decoder layer `layer` over `input` (a slice's batches, in memory or spilled; spilled
// inputs are verified against their SHA-256). The input is left as it is, so a failed slice can
// run again on it. Output spill files are named "<spill_dir>/layer<L>.slice<S>.batch<i>.safetensors".
// Errors name the layer; an observer violation (w2 bound, non-finite input) fails the slice.
// `cancelled` (may be nullptr) stops it between batches with Cancelled.
absl::StatusOr<SliceResult> CalibrateLayerSlice(const model::V4Checkpoint& ckpt, int64_t layer,
                                                const std::vector<BatchActivations>& input,
                                                compute::Device& device,
                                                const SliceOptions& options,
                                                const std::atomic<bool>* cancelled = nullptr);

// Drops the batches' activations: frees the host copies and removes the spill files.
void ReleaseBatches(std::vector<BatchActivations>& batches);

}  // namespace quantd::calibration

#endif  // QUANTD_SERVER_CALIBRATION_CALIBRATE_LAYER_H_
