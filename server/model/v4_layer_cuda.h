// RunLayer (v4_layer.h) on a CUDA device (CUDA builds only): one decoder layer with its weights
// resident in device memory (UploadLayer, v4_device_weights.h) and the batch's hc streams
// uploaded, moved through every block on the device (mHC, RMSNorm, attention, MoE: the kernels of
// kernels/cuda/v4_*_blocks.h and the products on cuBLAS), and the output streams brought back to
// host memory, where activations live between layers (V4Activations).
//
// The layer API reaches it through v4_device_forward.h: MakeForwardContext, LoadLayer and RunLayer
// on a CUDA device. Embed and HeadForward stay host functions.
#ifndef QUANTD_SERVER_MODEL_V4_LAYER_CUDA_H_
#define QUANTD_SERVER_MODEL_V4_LAYER_CUDA_H_

#include "absl/status/statusor.h"
#include "server/model/v4_activations.h"
#include "server/model/v4_config.h"
#include "server/model/v4_device_context.h"
#include "server/model/v4_device_weights.h"

namespace quantd::model {

// Runs one layer over a batch on ctx's device. InvalidArgument as RunLayer: `in` does not match
// the config, a token id outside the vocabulary (hash layers), a non-finite activation;
// FailedPrecondition for weights on another device; errors of the device (ResourceExhausted when
// its memory runs out, Internal for a failed kernel) name the step.
absl::StatusOr<V4Activations> RunLayerOnDevice(const DeviceForwardContext& ctx,
                                               const V4Config& config,
                                               const V4DeviceLayerWeights& layer,
                                               const V4Activations& in);

}  // namespace quantd::model

#endif  // QUANTD_SERVER_MODEL_V4_LAYER_CUDA_H_
