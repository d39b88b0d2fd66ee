// The device seam of a build without nvcc: there are no CUDA devices to run on.
#include "server/model/v4_device_forward.h"

namespace quantd::model {
namespace {

absl::Status NoCuda() {
  return absl::UnavailableError("quantd was built without CUDA (QUANTD_CUDA=OFF or no nvcc)");
}

}  // namespace

absl::StatusOr<std::shared_ptr<DeviceForwardContext>> OpenDeviceForward(compute::Device& device,
                                                                        Numerics numerics) {
  (void)device;
  (void)numerics;
  return NoCuda();
}

absl::StatusOr<std::shared_ptr<const V4DeviceLayerWeights>> MakeLayerResident(
    compute::Device& device, const V4Config& config, V4LayerWeights layer) {
  (void)device;
  (void)config;
  (void)layer;
  return NoCuda();
}

absl::StatusOr<V4Activations> RunDeviceLayer(const ForwardContext& ctx, const V4Config& config,
                                             const V4LayerWeights& layer, const V4Activations& in) {
  (void)ctx;
  (void)config;
  (void)layer;
  (void)in;
  return NoCuda();
}

}  // namespace quantd::model
