// The forward's operations on a CUDA device (v4_forward_ops.h; CUDA builds, else Unavailable):
// device memory, the kernels of kernels/cuda/v4_*_blocks.h on the legacy default stream (the
// stream cuBLAS's handle uses, so kernels and products run in program order), products on
// cuBLAS.
//
// Products: an F32 weight multiplies the F32 input (cuBLAS sgemm, no TF32). A BF16 weight in
// official numerics multiplies the input narrowed to BF16 (cublasGemmEx, BF16 operands, fp32
// accumulation): official inputs are BF16-representable (model dtype, or FP8-simulated), so the
// narrowing is exact and only the accumulation order differs from the host. A BF16 weight in math
// numerics is widened to F32 into scratch for an sgemm, as the host's Gemm widens it per tile.
// The NVFP4 W4A4 activation quantization runs on a host copy (kernels/nvfp4_fake_quant.h has no
// device kernel), bit-identical to the host's.
//
// The observer sees host copies (each observed product copies its input to the host). Weights
// are decoded on the device (LoadLinear with its backend) and stay there. A layer's routed
// experts are uploaded in their stored form (codes and scales, StoredExperts) on the layer's
// first expert decode, in one buffer, and stay there while the layer is among the two used last;
// each expert a token reaches is decoded from that buffer by the dequant kernels
// (kernels/cuda/dequant.cu) into the previous expert's device buffers, one expert at a time as on
// the host. Small parameters (norm and mHC weights, sinks, ape, router bias, tid2eid, the RoPE
// table) are copied on their first use and kept for the ops' lifetime (ParameterCache), so a
// layer task copies each once; uploads() counts both. Where indexer scores tie at the top-k boundary,
// the device picks the lower entry ids (LaunchSelectTopEntries' total order), the host
// libstdc++'s selection. The ops are used by one thread at a time (the worker owning the device).
#ifndef QUANTD_SERVER_MODEL_V4_CUDA_OPS_H_
#define QUANTD_SERVER_MODEL_V4_CUDA_OPS_H_

#include <memory>

#include "absl/status/statusor.h"
#include "server/compute/device.h"
#include "server/model/v4_forward_ops.h"

namespace quantd::model {

// The ops of CUDA device `device`. FailedPrecondition unless it is a CUDA device with a Gemm;
// Unavailable from the device, or in a build without CUDA.
absl::StatusOr<std::shared_ptr<ForwardOps>> MakeCudaOps(compute::Device& device);

}  // namespace quantd::model

#endif  // QUANTD_SERVER_MODEL_V4_CUDA_OPS_H_
