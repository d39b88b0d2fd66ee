// The device seam of a CUDA build (v4_device_forward.h).
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/base/status_macros.h"
#include "server/model/v4_device_context.h"
#include "server/model/v4_device_forward.h"
#include "server/model/v4_device_weights.h"
#include "server/model/v4_layer_cuda.h"

namespace quantd::model {

absl::StatusOr<std::shared_ptr<DeviceForwardContext>> OpenDeviceForward(compute::Device& device,
                                                                        Numerics numerics) {
  ASSIGN_OR_RETURN(DeviceForwardContext ctx, MakeDeviceForwardContext(device, numerics, nullptr));
  return std::make_shared<DeviceForwardContext>(std::move(ctx));
}

absl::StatusOr<std::shared_ptr<const V4DeviceLayerWeights>> MakeLayerResident(
    compute::Device& device, const V4Config& config, V4LayerWeights layer) {
  ASSIGN_OR_RETURN(const DeviceForwardContext ctx,
                   MakeDeviceForwardContext(device, Numerics::kOfficial, nullptr));
  ASSIGN_OR_RETURN(V4DeviceLayerWeights w, UploadLayer(ctx, config, std::move(layer)));
  return std::make_shared<const V4DeviceLayerWeights>(std::move(w));
}

absl::StatusOr<V4Activations> RunDeviceLayer(const ForwardContext& ctx, const V4Config& config,
                                             const V4LayerWeights& layer, const V4Activations& in) {
  if (ctx.device == nullptr || layer.device == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layer ", layer.layer, ": ",
        ctx.device == nullptr ? "weights loaded on a CUDA device need a context on it"
                              : "a CUDA context needs the layer loaded on its device"));
  }
  DeviceForwardContext& d = *ctx.device;
  d.gemm = ctx.gemm;
  d.numerics = ctx.numerics;
  d.observer = ctx.observer;
  d.observe_all_experts = ctx.observe_all_experts;
  return RunLayerOnDevice(d, config, *layer.device, in);
}

}  // namespace quantd::model
