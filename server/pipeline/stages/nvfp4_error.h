// The error of one NVFP4 module against the values it was quantized from, measured by the quantize
// stage while it holds both: the reference (the source as the quantizer saw it: FP8-block and
// MXFP4 weights decoded to BF16, BF16 and F32 weights as stored) and the NVFP4 values, block
// scales and weight_scale_2 as readers apply it (1 / weight_global_scale for compressed-tensors)
// are decoded in row chunks, so the float32 copies stay bounded by a chunk, and compared element
// by element (verify_rules.h ErrorStats).
#ifndef QUANTD_SERVER_PIPELINE_STAGES_NVFP4_ERROR_H_
#define QUANTD_SERVER_PIPELINE_STAGES_NVFP4_ERROR_H_

#include <stdint.h>

#include <string>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "server/store/job_store.h"

namespace quantd::pipeline {

// `reference` and `nvfp4` (rows x cols like the reference) live in the backend's memory. The row
// is named `tensor`.
absl::StatusOr<store::TensorStatsRow> MeasureNvfp4Error(kernels::Backend& backend,
                                                        const kernels::DenseTensor& reference,
                                                        const kernels::Nvfp4Tensor& nvfp4,
                                                        const std::string& tensor);

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_STAGES_NVFP4_ERROR_H_
