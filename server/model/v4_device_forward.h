// The seam between the layer API (v4_layer.h) and the forward on a CUDA device: MakeForwardContext,
// LoadLayer and RunLayer call these for a CUDA device. Implemented by v4_device_forward_cuda.cc
// (v4_device_context.h, v4_device_weights.h, v4_layer_cuda.h) in CUDA builds and by
// v4_device_forward_no_cuda.cc (Unavailable: such a build has no CUDA devices) otherwise.
#ifndef QUANTD_SERVER_MODEL_V4_DEVICE_FORWARD_H_
#define QUANTD_SERVER_MODEL_V4_DEVICE_FORWARD_H_

#include <memory>

#include "absl/status/statusor.h"
#include "server/compute/device.h"
#include "server/model/v4_layer.h"

namespace quantd::model {

// MakeForwardContext's device part: a context on CUDA device `device`.
absl::StatusOr<std::shared_ptr<DeviceForwardContext>> OpenDeviceForward(compute::Device& device,
                                                                        Numerics numerics);

// LoadLayer's device part: `layer`'s weights resident on `device` (its linears keep the values
// the device decoded; the host copies are dropped).
absl::StatusOr<std::shared_ptr<const V4DeviceLayerWeights>> MakeLayerResident(
    compute::Device& device, const V4Config& config, V4LayerWeights layer);

// RunLayer with a device context (ctx.device) and device-resident weights (layer.device).
// FailedPrecondition when one of them is missing.
absl::StatusOr<V4Activations> RunDeviceLayer(const ForwardContext& ctx, const V4Config& config,
                                             const V4LayerWeights& layer, const V4Activations& in);

}  // namespace quantd::model

#endif  // QUANTD_SERVER_MODEL_V4_DEVICE_FORWARD_H_
