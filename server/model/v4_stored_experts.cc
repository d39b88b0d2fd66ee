#include "server/model/v4_stored_experts.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "server/base/status_macros.h"

namespace quantd::model {
namespace {

size_t Aligned(size_t n) {
  return (n + StoredExperts::kAlignment - 1) / StoredExperts::kAlignment *
         StoredExperts::kAlignment;
}

}  // namespace

absl::StatusOr<StoredExperts> StoredExperts::Upload(const RoutedExperts& experts,
                                                    kernels::Backend& backend) {
  const V4Checkpoint* ckpt = experts.checkpoint();
  if (ckpt == nullptr) return absl::FailedPreconditionError("routed experts without a checkpoint");
  StoredExperts out;
  out.backend_ = &backend;
  out.ckpt_ = ckpt;
  out.prefix_ = experts.prefix();
  out.count_ = experts.size();
  const int64_t d = ckpt->config.hidden_size, inter = experts.inter();
  size_t offset = 0;
  for (int64_t e = 0; e < experts.size(); ++e) {
    const std::string p = absl::StrCat(experts.prefix(), "experts.", e, ".");
    for (const auto& [name, rows, cols] : {std::tuple<const char*, int64_t, int64_t>{"w1", inter, d},
                                           {"w2", d, inter},
                                           {"w3", inter, d}}) {
      Linear l;
      ASSIGN_OR_RETURN(l.stored, FindStoredLinear(*ckpt, p + name, rows, cols));
      l.weight_offset = offset;
      offset = Aligned(offset + l.stored.weight->size);
      if (l.stored.scale != nullptr) {
        l.scale_offset = offset;
        offset = Aligned(offset + l.stored.scale->size);
      }
      out.linears_.push_back(std::move(l));
    }
  }
  absl::StatusOr<kernels::Buffer> buffer = backend.Allocate(offset);
  if (!buffer.ok()) {
    return absl::Status(buffer.status().code(),
                        absl::StrCat(experts.prefix(), "experts: ", offset,
                                     " bytes of stored experts: ", buffer.status().message()));
  }
  out.buffer_ = std::move(*buffer);
  char* base = static_cast<char*>(out.buffer_.data());
  for (const Linear& l : out.linears_) {
    const checkpoint::TensorView* tensors[2] = {l.stored.weight, l.stored.scale};
    const size_t offsets[2] = {l.weight_offset, l.scale_offset};
    for (int i = 0; i < 2 && tensors[i] != nullptr; ++i) {
      if (absl::Status s = backend.CopyToBackend(base + offsets[i], tensors[i]->data,
                                                 tensors[i]->size);
          !s.ok()) {
        return absl::Status(s.code(), absl::StrCat("tensor ", tensors[i]->name, ": ", s.message()));
      }
      ReleasePages(*ckpt, *tensors[i]);
    }
  }
  return out;
}

bool StoredExperts::Holds(const RoutedExperts& experts) const {
  return ckpt_ == experts.checkpoint() && prefix_ == experts.prefix() && count_ == experts.size();
}

absl::StatusOr<ExpertWeights> StoredExperts::Decode(int64_t e, ExpertWeights previous) const {
  if (e < 0 || e >= count_) {
    return absl::OutOfRangeError(absl::StrCat(prefix_, "experts: no expert ", e));
  }
  const char* base = static_cast<const char*>(buffer_.data());
  const auto decode = [&](int i, LinearWeight& spare) -> absl::StatusOr<LinearWeight> {
    const Linear& l = linears_[static_cast<size_t>(e * 3 + i)];
    return DecodeStoredLinear(*backend_, l.stored, base + l.weight_offset,
                              l.stored.scale != nullptr ? base + l.scale_offset : nullptr,
                              std::move(spare.decoded.holder));
  };
  ExpertWeights w;
  ASSIGN_OR_RETURN(w.w1, decode(0, previous.w1));
  ASSIGN_OR_RETURN(w.w2, decode(1, previous.w2));
  ASSIGN_OR_RETURN(w.w3, decode(2, previous.w3));
  return w;
}

}  // namespace quantd::model
