#include "server/pipeline/stages/nvfp4_error.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/formats.h"
#include "server/base/status_macros.h"
#include "server/pipeline/stages/shard_io.h"
#include "server/pipeline/stages/verify_rules.h"

namespace quantd::pipeline {
namespace {

// Elements decoded and compared per chunk: 16 MiB of float32 on each side.
constexpr int64_t kChunkElements = int64_t{1} << 22;

absl::Status Measure(kernels::Backend& backend, const kernels::DenseTensor& reference,
                     const kernels::Nvfp4Tensor& nvfp4, ErrorStats* stats) {
  const int64_t rows = reference.rows;
  const int64_t cols = reference.cols;
  if (nvfp4.rows != rows || nvfp4.cols != cols) {
    return absl::InternalError(absl::StrCat("NVFP4 output is ", nvfp4.rows, " x ", nvfp4.cols,
                                            ", its reference ", rows, " x ", cols));
  }
  const bool bf16 = reference.type == kernels::FloatType::kBF16;
  const size_t element = bf16 ? 2 : 4;
  const int64_t chunk_rows = std::max<int64_t>(1, kChunkElements / cols);
  std::vector<float> ref, got;
  std::vector<uint8_t> ref_staging;
  kernels::Buffer got_holder;
  for (int64_t r0 = 0; r0 < rows; r0 += chunk_rows) {
    const int64_t r1 = std::min(rows, r0 + chunk_rows);
    const size_t n = static_cast<size_t>((r1 - r0) * cols);
    ASSIGN_OR_RETURN(const void* ref_host,
                     ToHost(backend, static_cast<const uint8_t*>(reference.data) +
                                         static_cast<size_t>(r0 * cols) * element,
                            n * element, &ref_staging));
    const float* ref_rows = static_cast<const float*>(ref_host);
    if (bf16) {
      ref.resize(n);
      const uint16_t* src = static_cast<const uint16_t*>(ref_host);
      for (size_t i = 0; i < n; ++i) ref[i] = formats::Bf16ToFloat(src[i]);
      ref_rows = ref.data();
    }
    got.resize(n);
    void* out = got.data();
    if (!ComputesOnHost(backend)) {
      if (got_holder.size() < n * sizeof(float)) {
        ASSIGN_OR_RETURN(got_holder, backend.Allocate(n * sizeof(float)));
      }
      out = got_holder.data();
    }
    const kernels::Nvfp4Tensor rows_of{
        nvfp4.data + r0 * cols / 2, nvfp4.scales + r0 * cols / kernels::kNvfp4BlockSize,
        nvfp4.scale_2, r1 - r0, cols};
    RETURN_IF_ERROR(backend.Nvfp4Dequant(rows_of, {out, kernels::FloatType::kF32}));
    if (out != got.data()) RETURN_IF_ERROR(backend.CopyToHost(got.data(), out, n * sizeof(float)));
    stats->Add(ref_rows, got.data(), static_cast<int64_t>(n));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<store::TensorStatsRow> MeasureNvfp4Error(kernels::Backend& backend,
                                                        const kernels::DenseTensor& reference,
                                                        const kernels::Nvfp4Tensor& nvfp4,
                                                        const std::string& tensor) {
  ErrorStats stats;
  if (absl::Status s = Measure(backend, reference, nvfp4, &stats); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(tensor, ": error statistics: ", s.message()));
  }
  return stats.Row(tensor);
}

}  // namespace quantd::pipeline
