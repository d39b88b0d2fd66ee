#include "server/model/v4_activations.h"

#include <string.h>

#include "absl/strings/str_cat.h"
#include "server/base/status_macros.h"
#include "server/checkpoint/safetensors_reader.h"
#include "server/checkpoint/safetensors_writer.h"

namespace quantd::model {
namespace {

constexpr char kTokenIds[] = "token_ids";
constexpr char kStreams[] = "streams";

}  // namespace

absl::Status SpillActivations(const V4Activations& a, const std::string& path) {
  if (static_cast<int64_t>(a.token_ids.size()) != a.tokens() ||
      static_cast<int64_t>(a.streams.size()) != a.tokens() * a.hc_mult * a.hidden_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("activations for ", path, ": buffer sizes disagree with the shape"));
  }
  using checkpoint::Dtype;
  ASSIGN_OR_RETURN(
      auto writer,
      checkpoint::SafetensorsWriter::Create(
          path, {{kTokenIds, Dtype::kI32, {a.sequences, a.seq_len}},
                 {kStreams, Dtype::kF32, {a.sequences, a.seq_len, a.hc_mult, a.hidden_size}}}));
  RETURN_IF_ERROR(writer->WriteTensor(kTokenIds, a.token_ids.data(), a.token_ids.size() * 4));
  RETURN_IF_ERROR(writer->WriteTensor(kStreams, a.streams.data(), a.streams.size() * 4));
  return writer->Finish();
}

absl::StatusOr<V4Activations> ReadActivations(const std::string& path) {
  ASSIGN_OR_RETURN(auto file, checkpoint::SafetensorsFile::Open(path));
  const checkpoint::TensorView* ids = file->Find(kTokenIds);
  const checkpoint::TensorView* streams = file->Find(kStreams);
  if (ids == nullptr || ids->dtype != checkpoint::Dtype::kI32 || ids->shape.size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": tensor ", kTokenIds, " must be I32 [sequences, seq_len]"));
  }
  if (streams == nullptr || streams->dtype != checkpoint::Dtype::kF32 ||
      streams->shape.size() != 4 || streams->shape[0] != ids->shape[0] ||
      streams->shape[1] != ids->shape[1]) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": tensor ", kStreams, " must be F32 [sequences, seq_len, hc_mult, hidden]"));
  }
  V4Activations a;
  a.sequences = streams->shape[0];
  a.seq_len = streams->shape[1];
  a.hc_mult = streams->shape[2];
  a.hidden_size = streams->shape[3];
  a.token_ids.resize(static_cast<size_t>(ids->numel()));
  memcpy(a.token_ids.data(), ids->data, ids->size);
  a.streams.resize(static_cast<size_t>(streams->numel()));
  memcpy(a.streams.data(), streams->data, streams->size);
  return a;
}

}  // namespace quantd::model
