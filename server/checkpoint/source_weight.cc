#include "server/checkpoint/source_weight.h"

#include <algorithm>
#include <filesystem>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"

namespace quantd::checkpoint {
namespace {

// The element of `items` (sorted by NaturalLess on .name) named `name`, or nullptr.
template <typename T>
const T* FindByName(const std::vector<T>& items, const std::string& name) {
  auto it = std::lower_bound(
      items.begin(), items.end(), name,
      [](const T& item, const std::string& n) { return NaturalLess(item.name, n); });
  // Names that differ only in leading zeros compare equal; look through the run of them.
  for (; it != items.end() && !NaturalLess(name, it->name); ++it) {
    if (it->name == name) return &*it;
  }
  return nullptr;
}

uint64_t CeilDiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

// Bytes of the weight and of its scale tensor that a module's format and shape imply.
absl::Status ExpectedBytes(const LinearModule& m, uint64_t* weight, uint64_t* scale) {
  const uint64_t out = static_cast<uint64_t>(m.out_features);
  const uint64_t in = static_cast<uint64_t>(m.in_features);
  const uint64_t fp8_blocks =
      CeilDiv(out, kernels::kFp8BlockSize) * CeilDiv(in, kernels::kFp8BlockSize);
  switch (m.format) {
    case TensorFormat::kFp8BlockE8m0:
      *weight = out * in;
      *scale = fp8_blocks;
      return absl::OkStatus();
    case TensorFormat::kFp8BlockF32:
      *weight = out * in;
      *scale = fp8_blocks * sizeof(float);
      return absl::OkStatus();
    case TensorFormat::kMxfp4:
      *weight = out * in / 2;
      *scale = out * in / kernels::kMxfp4BlockSize;
      return absl::OkStatus();
    case TensorFormat::kBf16:
      *weight = out * in * 2;
      *scale = 0;
      return absl::OkStatus();
    case TensorFormat::kF32:
      *weight = out * in * sizeof(float);
      *scale = 0;
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "module ", m.name, " is stored as ", FormatName(m.format), ", which cannot be decoded"));
  }
}

}  // namespace

const TensorInfo* FindTensorInfo(const TensorInventory& inventory, const std::string& name) {
  return FindByName(inventory.tensors, name);
}

const LinearModule* FindLinear(const TensorInventory& inventory, const std::string& name) {
  return FindByName(inventory.linears, name);
}

std::string SourceShardOf(const CheckpointDir& source, const std::string& tensor) {
  const SafetensorsFile* file = source.ShardOf(tensor);
  return file == nullptr ? std::string() : std::filesystem::path(file->path()).filename().string();
}

absl::Status TensorError(const std::string& shard, const std::string& tensor,
                         const absl::Status& status) {
  return absl::Status(status.code(),
                      absl::StrCat(shard, ": tensor ", tensor, ": ", status.message()));
}

absl::Status WeightError(const SourceWeight& w, const absl::Status& status) {
  return TensorError(w.shard, w.weight->name, status);
}

absl::StatusOr<SourceWeight> FindSourceWeight(const CheckpointDir& source,
                                              const TensorInventory& inventory,
                                              const std::string& module) {
  SourceWeight w;
  w.module = FindLinear(inventory, module);
  if (w.module == nullptr || w.module->tensors.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("module ", module, " is not a linear module of ", source.dir()));
  }
  const std::string& weight_name = w.module->tensors.front();
  w.weight = source.Find(weight_name);
  if (w.weight == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", weight_name, " is missing from ", source.dir()));
  }
  w.shard = SourceShardOf(source, weight_name);
  uint64_t weight_bytes = 0, scale_bytes = 0;
  if (absl::Status s = ExpectedBytes(*w.module, &weight_bytes, &scale_bytes); !s.ok()) {
    return WeightError(w, s);
  }
  if (w.weight->size != weight_bytes) {
    return WeightError(w, absl::InvalidArgumentError(
                              absl::StrCat(w.weight->size, " bytes, expected ", weight_bytes,
                                           " for a ", FormatName(w.module->format), " weight of ",
                                           w.module->out_features, "x", w.module->in_features)));
  }
  if (scale_bytes == 0) return w;
  if (w.module->tensors.size() < 2) {
    return WeightError(w, absl::InvalidArgumentError("its scale tensor is missing"));
  }
  const std::string& scale_name = w.module->tensors[1];
  w.scale = source.Find(scale_name);
  if (w.scale == nullptr || w.scale->size != scale_bytes) {
    return TensorError(SourceShardOf(source, scale_name), scale_name,
                       absl::InvalidArgumentError(absl::StrCat(
                           w.scale == nullptr ? "missing" : absl::StrCat(w.scale->size, " bytes"),
                           ", expected ", scale_bytes, " for the scales of ", weight_name)));
  }
  return w;
}

absl::StatusOr<const void*> ToBackend(kernels::Backend& backend, const void* host, size_t bytes,
                                      size_t align, kernels::Buffer* holder) {
  if (backend.host_memory() && reinterpret_cast<uintptr_t>(host) % align == 0) return host;
  absl::StatusOr<kernels::Buffer> buffer = backend.Allocate(bytes);
  if (!buffer.ok()) return buffer.status();
  if (absl::Status s = backend.CopyToBackend(buffer->data(), host, bytes); !s.ok()) return s;
  *holder = std::move(*buffer);
  return static_cast<const void*>(holder->data());
}

absl::StatusOr<const void*> ToHost(kernels::Backend& backend, const void* data, size_t bytes,
                                   std::vector<uint8_t>* staging) {
  if (backend.host_memory()) return data;
  staging->resize(bytes);
  if (absl::Status s = backend.CopyToHost(staging->data(), data, bytes); !s.ok()) return s;
  return static_cast<const void*>(staging->data());
}

namespace {

// StageMxfp4 for rows [row_begin, row_end) (whole tensors: 0, out_features).
absl::StatusOr<BackendMxfp4> StageMxfp4Rows(kernels::Backend& backend, const SourceWeight& w,
                                            int64_t row_begin, int64_t row_end) {
  const int64_t cols = w.module->in_features;
  const size_t rows = static_cast<size_t>(row_end - row_begin);
  const size_t data_bytes = rows * static_cast<size_t>(cols / 2);
  const size_t scale_bytes = rows * static_cast<size_t>(cols / kernels::kMxfp4BlockSize);
  BackendMxfp4 out;
  absl::StatusOr<const void*> data = ToBackend(
      backend, w.weight->data + row_begin * (cols / 2), data_bytes, 1, &out.data_holder);
  if (!data.ok()) return WeightError(w, data.status());
  absl::StatusOr<const void*> scales =
      ToBackend(backend, w.scale->data + row_begin * (cols / kernels::kMxfp4BlockSize),
                scale_bytes, 1, &out.scales_holder);
  if (!scales.ok()) return WeightError(w, scales.status());
  out.tensor.data = static_cast<const uint8_t*>(*data);
  out.tensor.scales = static_cast<const uint8_t*>(*scales);
  out.tensor.rows = row_end - row_begin;
  out.tensor.cols = cols;
  return out;
}

}  // namespace

absl::StatusOr<BackendMxfp4> StageMxfp4(kernels::Backend& backend, const SourceWeight& w) {
  return StageMxfp4Rows(backend, w, 0, w.module->out_features);
}

absl::StatusOr<DenseWeight> DecodeWeight(kernels::Backend& backend, const SourceWeight& w) {
  return DecodeWeightRows(backend, w, 0, w.module->out_features);
}

absl::StatusOr<DenseWeight> DecodeWeightRows(kernels::Backend& backend, const SourceWeight& w,
                                             int64_t row_begin, int64_t row_end,
                                             kernels::Buffer spare) {
  const LinearModule& m = *w.module;
  const int64_t cols = m.in_features;
  const bool fp8 =
      m.format == TensorFormat::kFp8BlockE8m0 || m.format == TensorFormat::kFp8BlockF32;
  const auto whole_fp8_blocks = [&](int64_t row) {
    return row % kernels::kFp8BlockSize == 0 || row == m.out_features;
  };
  if (row_begin < 0 || row_end < row_begin || row_end > m.out_features ||
      (fp8 && (row_begin % kernels::kFp8BlockSize != 0 || !whole_fp8_blocks(row_end)))) {
    return WeightError(w, absl::InvalidArgumentError(absl::StrCat(
                              "rows [", row_begin, ", ", row_end, ") of ", m.out_features,
                              " cannot be decoded on their own")));
  }
  const int64_t rows = row_end - row_begin;
  DenseWeight out;
  out.tensor.rows = rows;
  out.tensor.cols = cols;
  if (m.format == TensorFormat::kBf16 || m.format == TensorFormat::kF32) {
    const bool bf16 = m.format == TensorFormat::kBf16;
    const size_t elem = bf16 ? 2 : 4;
    out.tensor.type = bf16 ? kernels::FloatType::kBF16 : kernels::FloatType::kF32;
    out.bytes = static_cast<size_t>(rows * cols) * elem;
    absl::StatusOr<const void*> data =
        ToBackend(backend, w.weight->data + static_cast<size_t>(row_begin * cols) * elem,
                  out.bytes, elem, &out.holder);
    if (!data.ok()) return WeightError(w, data.status());
    out.tensor.data = *data;
    return out;
  }

  out.tensor.type = kernels::FloatType::kBF16;
  out.bytes = static_cast<size_t>(rows * cols) * 2;
  if (spare.size() >= out.bytes) {
    out.holder = std::move(spare);
  } else {
    absl::StatusOr<kernels::Buffer> buffer = backend.Allocate(out.bytes);
    if (!buffer.ok()) return WeightError(w, buffer.status());
    out.holder = std::move(*buffer);
  }
  out.tensor.data = out.holder.data();
  const kernels::DenseOut dst{out.holder.data(), kernels::FloatType::kBF16};
  absl::Status status;
  if (m.format == TensorFormat::kMxfp4) {
    absl::StatusOr<BackendMxfp4> src = StageMxfp4Rows(backend, w, row_begin, row_end);
    if (!src.ok()) return src.status();
    status = backend.Mxfp4Dequant(src->tensor, dst);
  } else {
    const bool e8m0 = m.format == TensorFormat::kFp8BlockE8m0;
    const size_t scale_elem = e8m0 ? 1 : 4;
    const size_t scales_per_block_row = static_cast<size_t>(CeilDiv(cols, kernels::kFp8BlockSize));
    const size_t block_row_begin = static_cast<size_t>(row_begin / kernels::kFp8BlockSize);
    const size_t block_rows = static_cast<size_t>(CeilDiv(rows, kernels::kFp8BlockSize));
    kernels::Buffer data_holder, scales_holder;
    absl::StatusOr<const void*> data =
        ToBackend(backend, w.weight->data + static_cast<size_t>(row_begin * cols),
                  static_cast<size_t>(rows * cols), 1, &data_holder);
    if (!data.ok()) return WeightError(w, data.status());
    absl::StatusOr<const void*> scales = ToBackend(
        backend, w.scale->data + block_row_begin * scales_per_block_row * scale_elem,
        block_rows * scales_per_block_row * scale_elem, scale_elem, &scales_holder);
    if (!scales.ok()) return WeightError(w, scales.status());
    kernels::Fp8BlockTensor src;
    src.data = static_cast<const uint8_t*>(*data);
    src.scales = *scales;
    src.scale_type = e8m0 ? kernels::Fp8ScaleType::kE8M0 : kernels::Fp8ScaleType::kF32;
    src.rows = rows;
    src.cols = cols;
    status = backend.Fp8BlockDequant(src, dst);
  }
  if (!status.ok()) return WeightError(w, status);
  return out;
}

absl::StatusOr<HostWeight> DecodeWeightToHost(kernels::Backend& backend, const SourceWeight& w,
                                              kernels::Buffer spare) {
  if (w.module == nullptr) return absl::InvalidArgumentError("no module to decode");
  absl::StatusOr<DenseWeight> dense =
      DecodeWeightRows(backend, w, 0, w.module->out_features, std::move(spare));
  if (!dense.ok()) return dense.status();
  HostWeight out;
  out.dense = std::move(*dense);
  absl::StatusOr<const void*> host =
      ToHost(backend, out.dense.tensor.data, out.dense.bytes, &out.staging);
  if (!host.ok()) return WeightError(w, host.status());
  out.data = *host;
  return out;
}

void ReleaseSource(const CheckpointDir& source, const TensorView* tensor) {
  if (tensor == nullptr) return;
  if (const SafetensorsFile* f = source.ShardOf(tensor->name); f != nullptr) {
    f->ReleasePages(*tensor);
  }
}

void ReleaseSource(const CheckpointDir& source, const SourceWeight& w) {
  ReleaseSource(source, w.weight);
  ReleaseSource(source, w.scale);
}

}  // namespace quantd::checkpoint
