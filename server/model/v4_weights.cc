#include "server/model/v4_weights.h"

#include <string.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/formats.h"
#include "server/base/status_macros.h"
#include "server/pipeline/stage.h"

namespace quantd::model {
namespace {

absl::Status TensorShapeError(const std::string& name, const std::vector<int64_t>& got,
                              const std::vector<int64_t>& want, const std::string& dtype) {
  return absl::InvalidArgumentError(absl::StrCat("tensor ", name, ": ", dtype, " ",
                                                 pipeline::ShapeString(got), ", expected ",
                                                 pipeline::ShapeString(want)));
}

}  // namespace

void ReleasePages(const V4Checkpoint& ckpt, const checkpoint::TensorView& tensor) {
  if (const checkpoint::SafetensorsFile* f = ckpt.dir->ShardOf(tensor.name); f != nullptr) {
    f->ReleasePages(tensor);
  }
}

absl::StatusOr<std::unique_ptr<V4Checkpoint>> OpenV4Checkpoint(const std::string& path) {
  auto ckpt = std::make_unique<V4Checkpoint>();
  ASSIGN_OR_RETURN(ckpt->dir, checkpoint::CheckpointDir::Open(path));
  ASSIGN_OR_RETURN(ckpt->inventory, pipeline::BuildInventory(*ckpt->dir));
  if (ckpt->inventory.arch != pipeline::ModelArch::kDeepseekV4) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": not a DeepSeek-V4 checkpoint (model_type \"", ckpt->inventory.model_type, "\")"));
  }
  ASSIGN_OR_RETURN(ckpt->config,
                   ParseV4Config(ckpt->dir->config(), absl::StrCat(path, "/config.json")));
  return ckpt;
}

absl::StatusOr<LinearWeight> LoadLinear(const V4Checkpoint& ckpt, kernels::Backend& backend,
                                        const std::string& module, int64_t out, int64_t in) {
  pipeline::StageContext ctx;
  ctx.source = ckpt.dir.get();
  ctx.inventory = &ckpt.inventory;
  ctx.backend = &backend;
  ASSIGN_OR_RETURN(pipeline::SourceWeight source, pipeline::FindSourceWeight(ctx, module));
  const pipeline::LinearModule& m = *source.module;
  if (m.out_features != out || m.in_features != in) {
    return TensorShapeError(m.tensors.front(), {m.out_features, m.in_features}, {out, in},
                            pipeline::FormatName(m.format));
  }
  LinearWeight w;
  w.module = module;
  w.quantized_source = m.format == pipeline::TensorFormat::kFp8BlockE8m0 ||
                       m.format == pipeline::TensorFormat::kFp8BlockF32 ||
                       m.format == pipeline::TensorFormat::kMxfp4;
  ASSIGN_OR_RETURN(w.host, pipeline::DecodeWeightToHost(backend, source));
  w.view = w.host.dense.tensor;
  w.view.data = w.host.data;
  if (w.host.data == source.weight->data) {  // read in place from the mapped shard
    const auto* bytes = static_cast<const uint8_t*>(w.host.data);
    w.copy.assign(bytes, bytes + w.host.dense.bytes);
    w.view.data = w.copy.data();
  }
  pipeline::ReleaseSource(ctx, source);
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
