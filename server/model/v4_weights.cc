#include "server/model/v4_weights.h"

#include <string.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/formats.h"
#include "server/base/excerpt.h"
#include "server/base/status_macros.h"

namespace quantd::model {
namespace {

absl::Status TensorShapeError(const std::string& name, const std::vector<int64_t>& got,
                              const std::vector<int64_t>& want, const std::string& dtype) {
  return absl::InvalidArgumentError(absl::StrCat("tensor ", name, ": ", dtype, " ",
                                                 checkpoint::ShapeString(got), ", expected ",
                                                 checkpoint::ShapeString(want)));
}

// Linear `module` when it is NVFP4 (read by LoadNvfp4Linear), else nullptr (FindSourceWeight's).
const checkpoint::LinearModule* FindNvfp4(const V4Checkpoint& ckpt, const std::string& module) {
  const checkpoint::LinearModule* m = checkpoint::FindLinear(ckpt.inventory, module);
  return m != nullptr && (m->format == checkpoint::TensorFormat::kNvfp4 ||
                          m->format == checkpoint::TensorFormat::kNvfp4CompressedTensors)
             ? m
             : nullptr;
}

// InvalidArgument naming the weight unless `m` is [out, in].
absl::Status CheckShape(const checkpoint::LinearModule& m, int64_t out, int64_t in) {
  if (m.out_features == out && m.in_features == in) return absl::OkStatus();
  return TensorShapeError(m.tensors.front(), {m.out_features, m.in_features}, {out, in},
                          checkpoint::FormatName(m.format));
}

// A one-element F32 scale of an NVFP4 module (ModelOpt: [], compressed-tensors: [1]), checked
// finite and positive; `reciprocal` for compressed-tensors' global scales (1 / ModelOpt's).
absl::StatusOr<float> LoadNvfp4Scalar(const V4Checkpoint& ckpt, const std::string& name,
                                      bool reciprocal) {
  const checkpoint::TensorView* t = ckpt.dir->Find(name);
  if (t == nullptr || t->dtype != checkpoint::Dtype::kF32 || t->size != sizeof(float)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", name, ": expected one F32 value in ", ckpt.dir->dir()));
  }
  float v;
  memcpy(&v, t->data, sizeof(v));
  if (!formats::IsFinite(v) || !(v > 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", name, ": ", v, " is not finite and positive"));
  }
  return reciprocal ? 1.0f / v : v;
}

// An NVFP4 weight (`m`, as the inventory classified it) decoded to float32 with the backend's
// Nvfp4Dequant (into `spare` when it is large enough); the input scale, when the module has one,
// into w->input_scale.
absl::Status LoadNvfp4Linear(const V4Checkpoint& ckpt, kernels::Backend& backend,
                             const checkpoint::LinearModule& m, kernels::Buffer spare,
                             LinearWeight* w) {
  const bool ct = m.format == checkpoint::TensorFormat::kNvfp4CompressedTensors;
  const std::string& weight_name = m.tensors.front();
  const std::string scale_name = m.name + ".weight_scale";
  const checkpoint::TensorView* weight = ckpt.dir->Find(weight_name);
  const checkpoint::TensorView* scales = ckpt.dir->Find(scale_name);
  const uint64_t elements = static_cast<uint64_t>(m.out_features * m.in_features);
  if (weight == nullptr || weight->size != elements / 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", weight_name, ": expected ", elements / 2, " bytes"));
  }
  if (scales == nullptr || scales->size != elements / kernels::kNvfp4BlockSize) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor ", scale_name, ": expected ", elements / kernels::kNvfp4BlockSize, " bytes"));
  }
  kernels::Nvfp4Tensor src;
  src.rows = m.out_features;
  src.cols = m.in_features;
  ASSIGN_OR_RETURN(src.scale_2, LoadNvfp4Scalar(ckpt, m.name + (ct ? ".weight_global_scale"
                                                                    : ".weight_scale_2"),
                                                ct));
  const std::string input_name = m.name + (ct ? ".input_global_scale" : ".input_scale");
  if (ckpt.dir->Find(input_name) != nullptr) {
    ASSIGN_OR_RETURN(w->input_scale, LoadNvfp4Scalar(ckpt, input_name, ct));
  }
  kernels::Buffer data_holder, scales_holder;
  ASSIGN_OR_RETURN(const void* data,
                   checkpoint::ToBackend(backend, weight->data, weight->size, 1, &data_holder));
  ASSIGN_OR_RETURN(const void* scale_bytes,
                   checkpoint::ToBackend(backend, scales->data, scales->size, 1, &scales_holder));
  src.data = static_cast<const uint8_t*>(data);
  src.scales = static_cast<const uint8_t*>(scale_bytes);
  checkpoint::DenseWeight& dense = w->decoded;
  dense.bytes = static_cast<size_t>(elements) * sizeof(float);
  if (spare.size() >= dense.bytes) {
    dense.holder = std::move(spare);
  } else {
    ASSIGN_OR_RETURN(dense.holder, backend.Allocate(dense.bytes));
  }
  dense.tensor = {dense.holder.data(), kernels::FloatType::kF32, m.out_features, m.in_features};
  if (absl::Status s = backend.Nvfp4Dequant(src, {dense.holder.data(), kernels::FloatType::kF32});
      !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("tensor ", weight_name, ": ", s.message()));
  }
  w->view = dense.tensor;
  ReleasePages(ckpt, *weight);
  ReleasePages(ckpt, *scales);
  return absl::OkStatus();
}

}  // namespace

void ReleasePages(const V4Checkpoint& ckpt, const checkpoint::TensorView& tensor) {
  if (const checkpoint::SafetensorsFile* f = ckpt.dir->ShardOf(tensor.name); f != nullptr) {
    f->ReleasePages(tensor);
  }
}

namespace {

// `dir`, opened from `path`, as a V4 model.
absl::StatusOr<std::unique_ptr<V4Checkpoint>> AsV4Checkpoint(
    const std::string& path, absl::StatusOr<std::shared_ptr<const checkpoint::CheckpointDir>> dir) {
  auto ckpt = std::make_unique<V4Checkpoint>();
  ASSIGN_OR_RETURN(ckpt->dir, std::move(dir));
  ASSIGN_OR_RETURN(ckpt->inventory, checkpoint::BuildInventory(*ckpt->dir));
  if (ckpt->inventory.arch != checkpoint::ModelArch::kDeepseekV4) {
    return absl::InvalidArgumentError(absl::StrCat(path,
                                                   ": not a DeepSeek-V4 checkpoint (model_type ",
                                                   base::Excerpt(ckpt->inventory.model_type), ")"));
  }
  ASSIGN_OR_RETURN(ckpt->config,
                   ParseV4Config(ckpt->dir->config(), absl::StrCat(path, "/config.json")));
  return ckpt;
}

}  // namespace

absl::StatusOr<std::unique_ptr<V4Checkpoint>> OpenV4Checkpoint(const std::string& path,
                                                            const checkpoint::SourceRoots& roots) {
  return AsV4Checkpoint(path, checkpoint::CheckpointDir::Open(path, roots));
}

absl::StatusOr<std::unique_ptr<V4Checkpoint>> OpenV4Checkpoint(const checkpoint::DirHandle& dir) {
  return AsV4Checkpoint(dir.path(), checkpoint::CheckpointDir::Open(dir));
}

absl::StatusOr<std::unique_ptr<V4Checkpoint>> OpenV4Checkpoint(
    std::shared_ptr<const checkpoint::CheckpointDir> dir) {
  if (dir == nullptr) return absl::InternalError("no source checkpoint is open");
  const std::string path = dir->dir();
  return AsV4Checkpoint(path, std::move(dir));
}

absl::Status CheckLinear(const V4Checkpoint& ckpt, const std::string& module, int64_t out,
                         int64_t in) {
  if (const checkpoint::LinearModule* m = FindNvfp4(ckpt, module); m != nullptr) {
    return CheckShape(*m, out, in);
  }
  ASSIGN_OR_RETURN(const checkpoint::SourceWeight source,
                   checkpoint::FindSourceWeight(*ckpt.dir, ckpt.inventory, module));
  return CheckShape(*source.module, out, in);
}

absl::StatusOr<LinearWeight> LoadLinear(const V4Checkpoint& ckpt, kernels::Backend& backend,
                                        const std::string& module, int64_t out, int64_t in,
                                        kernels::Buffer spare) {
  LinearWeight w;
  w.module = module;
  if (const checkpoint::LinearModule* m = FindNvfp4(ckpt, module); m != nullptr) {
    RETURN_IF_ERROR(CheckShape(*m, out, in));
    RETURN_IF_ERROR(LoadNvfp4Linear(ckpt, backend, *m, std::move(spare), &w));
    return w;
  }
  ASSIGN_OR_RETURN(checkpoint::SourceWeight source,
                   checkpoint::FindSourceWeight(*ckpt.dir, ckpt.inventory, module));
  const checkpoint::LinearModule& m = *source.module;
  RETURN_IF_ERROR(CheckShape(m, out, in));
  w.quantized_source = m.format == checkpoint::TensorFormat::kFp8BlockE8m0 ||
                       m.format == checkpoint::TensorFormat::kFp8BlockF32 ||
                       m.format == checkpoint::TensorFormat::kMxfp4;
  ASSIGN_OR_RETURN(w.decoded, checkpoint::DecodeWeightRows(backend, source, 0, m.out_features,
                                                           std::move(spare)));
  w.view = w.decoded.tensor;
  if (w.view.data == source.weight->data) {  // read in place from the mapped shard
    const auto* bytes = static_cast<const uint8_t*>(w.view.data);
    w.copy.assign(bytes, bytes + w.decoded.bytes);
    w.view.data = w.copy.data();
  }
  checkpoint::ReleaseSource(*ckpt.dir, source);
  return w;
}

absl::StatusOr<StoredLinear> FindStoredLinear(const V4Checkpoint& ckpt, const std::string& module,
                                              int64_t out, int64_t in) {
  StoredLinear s;
  s.module = module;
  s.out = out;
  s.in = in;
  if (const checkpoint::LinearModule* m = FindNvfp4(ckpt, module); m != nullptr) {
    RETURN_IF_ERROR(CheckShape(*m, out, in));
    const bool ct = m->format == checkpoint::TensorFormat::kNvfp4CompressedTensors;
    const std::string& weight_name = m->tensors.front();
    const std::string scale_name = m->name + ".weight_scale";
    s.format = m->format;
    s.weight = ckpt.dir->Find(weight_name);
    s.scale = ckpt.dir->Find(scale_name);
    const uint64_t elements = static_cast<uint64_t>(out * in);
    if (s.weight == nullptr || s.weight->size != elements / 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", weight_name, ": expected ", elements / 2, " bytes"));
    }
    if (s.scale == nullptr || s.scale->size != elements / kernels::kNvfp4BlockSize) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", scale_name, ": expected ", elements / kernels::kNvfp4BlockSize, " bytes"));
    }
    ASSIGN_OR_RETURN(s.scale_2, LoadNvfp4Scalar(ckpt, m->name + (ct ? ".weight_global_scale"
                                                                      : ".weight_scale_2"),
                                                ct));
    const std::string input_name = m->name + (ct ? ".input_global_scale" : ".input_scale");
    if (ckpt.dir->Find(input_name) != nullptr) {
      ASSIGN_OR_RETURN(s.input_scale, LoadNvfp4Scalar(ckpt, input_name, ct));
    }
    return s;
  }
  ASSIGN_OR_RETURN(const checkpoint::SourceWeight source,
                   checkpoint::FindSourceWeight(*ckpt.dir, ckpt.inventory, module));
  RETURN_IF_ERROR(CheckShape(*source.module, out, in));
  s.format = source.module->format;
  s.weight = source.weight;
  s.scale = source.scale;
  s.quantized_source = s.format == checkpoint::TensorFormat::kFp8BlockE8m0 ||
                       s.format == checkpoint::TensorFormat::kFp8BlockF32 ||
                       s.format == checkpoint::TensorFormat::kMxfp4;
  return s;
}

absl::StatusOr<LinearWeight> DecodeStoredLinear(kernels::Backend& backend, const StoredLinear& s,
                                                const void* weight, const void* scales,
                                                kernels::Buffer spare) {
  using checkpoint::TensorFormat;
  LinearWeight w;
  w.module = s.module;
  w.quantized_source = s.quantized_source;
  w.input_scale = s.input_scale;
  checkpoint::DenseWeight& dense = w.decoded;
  const bool f32 = s.format == TensorFormat::kF32 || s.format == TensorFormat::kNvfp4 ||
                   s.format == TensorFormat::kNvfp4CompressedTensors;
  const kernels::FloatType type = f32 ? kernels::FloatType::kF32 : kernels::FloatType::kBF16;
  dense.bytes = static_cast<size_t>(s.out * s.in) * (f32 ? 4 : 2);
  if (s.format == TensorFormat::kBf16 || s.format == TensorFormat::kF32) {
    dense.tensor = {weight, type, s.out, s.in};
    w.view = dense.tensor;
    return w;
  }
  if (spare.size() >= dense.bytes) {
    dense.holder = std::move(spare);
  } else {
    ASSIGN_OR_RETURN(dense.holder, backend.Allocate(dense.bytes));
  }
  dense.tensor = {dense.holder.data(), type, s.out, s.in};
  const kernels::DenseOut dst{dense.holder.data(), type};
  absl::Status status;
  switch (s.format) {
    case TensorFormat::kMxfp4: {
      kernels::Mxfp4Tensor src;
      src.data = static_cast<const uint8_t*>(weight);
      src.scales = static_cast<const uint8_t*>(scales);
      src.rows = s.out;
      src.cols = s.in;
      status = backend.Mxfp4Dequant(src, dst);
      break;
    }
    case TensorFormat::kFp8BlockE8m0:
    case TensorFormat::kFp8BlockF32: {
      kernels::Fp8BlockTensor src;
      src.data = static_cast<const uint8_t*>(weight);
      src.scales = scales;
      src.scale_type = s.format == TensorFormat::kFp8BlockE8m0 ? kernels::Fp8ScaleType::kE8M0
                                                               : kernels::Fp8ScaleType::kF32;
      src.rows = s.out;
      src.cols = s.in;
      status = backend.Fp8BlockDequant(src, dst);
      break;
    }
    case TensorFormat::kNvfp4:
    case TensorFormat::kNvfp4CompressedTensors: {
      kernels::Nvfp4Tensor src;
      src.data = static_cast<const uint8_t*>(weight);
      src.scales = static_cast<const uint8_t*>(scales);
      src.scale_2 = s.scale_2;
      src.rows = s.out;
      src.cols = s.in;
      status = backend.Nvfp4Dequant(src, dst);
      break;
    }
    default:
      status = absl::InvalidArgumentError(absl::StrCat(
          "stored as ", checkpoint::FormatName(s.format), ", which cannot be decoded"));
  }
  if (!status.ok()) {
    return absl::Status(status.code(),
                        absl::StrCat("tensor ", s.weight->name, ": ", status.message()));
  }
  w.view = dense.tensor;
  return w;
}

absl::StatusOr<std::vector<float>> LoadFloats(const V4Checkpoint& ckpt, const std::string& name,
                                              const std::vector<int64_t>& shape) {
  const checkpoint::TensorView* t = ckpt.dir->Find(name);
  if (t == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", name, " is missing from ", ckpt.dir->dir()));
  }
  const bool bf16 = t->dtype == checkpoint::Dtype::kBF16;
  if ((!bf16 && t->dtype != checkpoint::Dtype::kF32) || t->shape != shape) {
    return TensorShapeError(name, t->shape, shape, std::string(checkpoint::DtypeName(t->dtype)));
  }
  std::vector<float> out(static_cast<size_t>(t->numel()));
  if (bf16) {
    for (size_t i = 0; i < out.size(); ++i) {
      uint16_t b;
      memcpy(&b, t->data + 2 * i, 2);
      out[i] = formats::Bf16ToFloat(b);
    }
  } else {
    memcpy(out.data(), t->data, out.size() * sizeof(float));
  }
  ReleasePages(ckpt, *t);
  for (size_t i = 0; i < out.size(); ++i) {
    if (!formats::IsFinite(out[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", name, ": non-finite value at flat index ", i));
    }
  }
  return out;
}

absl::StatusOr<std::vector<float>> LoadFloatsOr(const V4Checkpoint& ckpt, const std::string& name,
                                                const std::vector<int64_t>& shape, float fallback) {
  if (ckpt.dir->Find(name) != nullptr) return LoadFloats(ckpt, name, shape);
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return std::vector<float>(static_cast<size_t>(n), fallback);
}

absl::StatusOr<std::vector<int32_t>> LoadExpertIds(const V4Checkpoint& ckpt,
                                                   const std::string& name, int64_t vocab,
                                                   int64_t topk, int64_t experts) {
  const checkpoint::TensorView* t = ckpt.dir->Find(name);
  if (t == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", name, " is missing from ", ckpt.dir->dir()));
  }
  const bool i64 = t->dtype == checkpoint::Dtype::kI64;
  if ((!i64 && t->dtype != checkpoint::Dtype::kI32) ||
      t->shape != std::vector<int64_t>{vocab, topk}) {
    return TensorShapeError(name, t->shape, {vocab, topk},
                            std::string(checkpoint::DtypeName(t->dtype)));
  }
  std::vector<int32_t> ids(static_cast<size_t>(vocab * topk));
  for (int64_t r = 0; r < vocab; ++r) {
    for (int64_t k = 0; k < topk; ++k) {
      const size_t i = static_cast<size_t>(r * topk + k);
      int64_t id;
      if (i64) {
        memcpy(&id, t->data + 8 * i, 8);
      } else {
        int32_t v;
        memcpy(&v, t->data + 4 * i, 4);
        id = v;
      }
      bool repeated = false;
      for (int64_t j = 0; j < k; ++j) repeated |= ids[static_cast<size_t>(r * topk + j)] == id;
      if (id < 0 || id >= experts || repeated) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor ", name, ": [", r, ", ", k, "]: ",
                         repeated ? "repeats an expert of its row"
                                  : absl::StrCat("expert id outside [0, ", experts, ")")));
      }
      ids[i] = static_cast<int32_t>(id);
    }
  }
  ReleasePages(ckpt, *t);
  return ids;
}

}  // namespace quantd::model
