#include "server/model/v4_memory.h"

#include <algorithm>
#include <map>
#include <set>
#include <string>

#include "absl/strings/match.h"

namespace quantd::model {
namespace {

constexpr char kRoutedInfix[] = "ffn.experts.";

int64_t DecodedValueBytes(checkpoint::TensorFormat format, DecodedWidth width) {
  if (width == DecodedWidth::kFloat32) return 4;
  switch (format) {
    case checkpoint::TensorFormat::kF32:
    case checkpoint::TensorFormat::kNvfp4:
    case checkpoint::TensorFormat::kNvfp4CompressedTensors:
      return 4;
    default:
      return 2;
  }
}

}  // namespace

LayerMemory EstimateLayerMemory(const checkpoint::TensorInventory& inventory,
                                const std::string& prefix, DecodedWidth width) {
  LayerMemory m;
  const std::string routed = prefix + kRoutedInfix;
  std::map<std::string, int64_t> experts;  // "layers.3.ffn.experts.7" -> decoded bytes
  std::set<std::string> linears;
  for (const checkpoint::LinearModule& l : inventory.linears) {
    if (!absl::StartsWith(l.name, prefix)) continue;
    linears.insert(l.name);
    const int64_t bytes = l.out_features * l.in_features * DecodedValueBytes(l.format, width);
    if (absl::StartsWith(l.name, routed)) {
      experts[l.name.substr(0, l.name.rfind('.'))] += bytes;
      m.stored_expert_bytes += static_cast<int64_t>(l.bytes);
    } else {
      m.dense_bytes += bytes;
    }
  }
  for (const auto& [expert, bytes] : experts) m.expert_bytes = std::max(m.expert_bytes, bytes);
  // Norms, mixers, sinks, biases, tid2eid: float32 / int32 copies of every value.
  for (const checkpoint::TensorInfo& t : inventory.tensors) {
    if (!absl::StartsWith(t.name, prefix) || t.format == checkpoint::TensorFormat::kScale ||
        linears.count(t.module) > 0) {
      continue;
    }
    int64_t values = 1;
    for (int64_t d : t.shape) values *= d;
    m.dense_bytes += 4 * values;
  }
  return m;
}

}  // namespace quantd::model
