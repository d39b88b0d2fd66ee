#include "server/checkpoint/tensor_inventory.h"

#include <algorithm>
#include <map>
#include <optional>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace quantd::checkpoint {

std::string FormatName(TensorFormat f) {
  switch (f) {
    case TensorFormat::kFp8BlockE8m0: return "fp8_block_e8m0";
    case TensorFormat::kFp8BlockF32: return "fp8_block_f32";
    case TensorFormat::kMxfp4: return "mxfp4";
    case TensorFormat::kNvfp4: return "nvfp4";
    case TensorFormat::kNvfp4CompressedTensors: return "nvfp4_compressed_tensors";
    case TensorFormat::kBf16: return "bf16";
    case TensorFormat::kF32: return "f32";
    case TensorFormat::kScale: return "scale";
    case TensorFormat::kOther: return "other";
  }
  return "other";
}

std::string ArchName(ModelArch a) {
  switch (a) {
    case ModelArch::kDeepseekV4: return "deepseek_v4";
    case ModelArch::kDeepseekV3: return "deepseek_v3";
    case ModelArch::kUnknown: return "unknown";
  }
  return "unknown";
}

bool NaturalLess(absl::string_view a, absl::string_view b) {
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const bool da = absl::ascii_isdigit(a[i]), db = absl::ascii_isdigit(b[j]);
    if (da && db) {
      size_t ie = i, je = j;
      while (ie < a.size() && absl::ascii_isdigit(a[ie])) ++ie;
      while (je < b.size() && absl::ascii_isdigit(b[je])) ++je;
      // Compare the numbers without leading zeros: shorter is smaller, then digit by digit.
      size_t is = i, js = j;
      while (is + 1 < ie && a[is] == '0') ++is;
      while (js + 1 < je && b[js] == '0') ++js;
      const absl::string_view na = a.substr(is, ie - is), nb = b.substr(js, je - js);
      if (na.size() != nb.size()) return na.size() < nb.size();
      if (na != nb) return na < nb;
      i = ie;
      j = je;
      continue;
    }
    if (a[i] != b[j]) return static_cast<unsigned char>(a[i]) < static_cast<unsigned char>(b[j]);
    ++i;
    ++j;
  }
  return a.size() - i < b.size() - j;
}

std::string LeafName(const std::string& name) {
  const size_t dot = name.rfind('.');
  return dot == std::string::npos ? name : name.substr(dot + 1);
}

std::string ModuleOf(const std::string& name) {
  const size_t dot = name.rfind('.');
  return dot == std::string::npos ? "" : name.substr(0, dot);
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

namespace {

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// DtypeName returns a std::string_view, which absl::StrCat does not take.
std::string DtypeStr(Dtype d) { return std::string(DtypeName(d)); }

// Last name components that only scale tensors have.
bool IsScaleLeaf(const std::string& leaf) {
  static const std::set<std::string> kLeaves = {"scale",        "weight_scale_inv",
                                                "weight_scale", "weight_scale_2",
                                                "input_scale",  "weight_global_scale",
                                                "input_global_scale"};
  return kLeaves.count(leaf) > 0;
}

// Classifies weights and claims their scale tensors, collecting every problem found.
class Classifier {
 public:
  explicit Classifier(std::map<std::string, TensorInfo>& infos) : infos_(infos) {}

  // Classifies the weight `w` (leaf "weight" or "weight_packed"); returns its linear module when
  // it is 2-D.
  std::optional<LinearModule> Weight(TensorInfo& w) {
    const std::string module = ModuleOf(w.name);
    const bool packed = LeafName(w.name) == "weight_packed";
    LinearModule m;
    m.name = module;
    m.tensors.push_back(w.name);
    m.bytes = w.bytes;
    bool fp4 = false;
    if (packed) {
      w.format = TensorFormat::kNvfp4CompressedTensors;
      fp4 = true;
      if (!Expect2d(w, Dtype::kU8)) return std::nullopt;
      ExpectScale(w, module + ".weight_scale", {Dtype::kF8E4M3}, BlockShape(w, 16), m);
      ExpectScale(w, module + ".weight_global_scale", {Dtype::kF32}, {}, m);
      OptionalScale(w, module + ".input_global_scale", m);
    } else if (w.dtype == Dtype::kF8E4M3) {
      if (!Expect2d(w, Dtype::kF8E4M3)) return std::nullopt;
      std::string scale = module + ".scale";
      if (infos_.count(scale) == 0) scale = w.name + "_scale_inv";
      if (infos_.count(scale) == 0) {
        errors_.push_back(absl::StrCat("FP8 weight ", w.name, " has no block scale (expected ",
                                       module, ".scale or ", w.name, "_scale_inv)"));
        return std::nullopt;
      }
      const Dtype sd = infos_.at(scale).dtype;
      w.format = sd == Dtype::kF8E8M0 ? TensorFormat::kFp8BlockE8m0 : TensorFormat::kFp8BlockF32;
      ExpectScale(w, scale, {Dtype::kF8E8M0, Dtype::kF32},
                  {CeilDiv(w.shape[0], 128), CeilDiv(w.shape[1], 128)}, m);
    } else if (w.dtype == Dtype::kI8) {
      w.format = TensorFormat::kMxfp4;
      fp4 = true;
      if (!Expect2d(w, Dtype::kI8)) return std::nullopt;
      ExpectScale(w, module + ".scale", {Dtype::kF8E8M0}, BlockShape(w, 32), m);
    } else if (w.dtype == Dtype::kU8) {
      w.format = TensorFormat::kNvfp4;
      fp4 = true;
      if (!Expect2d(w, Dtype::kU8)) return std::nullopt;
      ExpectScale(w, module + ".weight_scale", {Dtype::kF8E4M3}, BlockShape(w, 16), m);
      ExpectScale(w, module + ".weight_scale_2", {Dtype::kF32}, {}, m);
      OptionalScale(w, module + ".input_scale", m);
    } else {
      w.format = w.dtype == Dtype::kBF16  ? TensorFormat::kBf16
                 : w.dtype == Dtype::kF32 ? TensorFormat::kF32
                                          : TensorFormat::kOther;
      if (w.shape.size() != 2) return std::nullopt;
    }
    m.format = w.format;
    m.out_features = w.shape[0];
    m.in_features = w.shape[1] * (fp4 ? 2 : 1);
    return m;
  }

  std::vector<std::string>& errors() { return errors_; }

 private:
  // Quantized weights are matrices.
  bool Expect2d(const TensorInfo& w, Dtype d) {
    if (w.shape.size() == 2) return true;
    errors_.push_back(absl::StrCat(w.name, ": ", DtypeStr(d),
                                   " quantized weight must be 2-D, got ", ShapeString(w.shape)));
    return false;
  }

  // Scale shape [out, in / block] of a packed FP4 weight [out, in / 2].
  std::vector<int64_t> BlockShape(const TensorInfo& w, int64_t block) {
    const int64_t in = w.shape[1] * 2;
    if (in % block != 0) {
      errors_.push_back(absl::StrCat(w.name, ": input dimension ", in,
                                     " is not a multiple of the block size ", block));
    }
    return {w.shape[0], in / block};
  }

  // Claims `scale` for weight `w`; `shape` empty means "one element" ([] or [1]).
  void ExpectScale(const TensorInfo& w, const std::string& scale, std::vector<Dtype> dtypes,
                   const std::vector<int64_t>& shape, LinearModule& m) {
    auto it = infos_.find(scale);
    if (it == infos_.end()) {
      errors_.push_back(absl::StrCat(FormatName(w.format), " weight ", w.name, " has no ", scale));
      return;
    }
    TensorInfo& s = it->second;
    s.format = TensorFormat::kScale;
    s.owner = w.name;
    m.tensors.push_back(s.name);
    m.bytes += s.bytes;
    if (std::find(dtypes.begin(), dtypes.end(), s.dtype) == dtypes.end()) {
      std::vector<std::string> names;
      for (Dtype d : dtypes) names.push_back(DtypeStr(d));
      errors_.push_back(absl::StrCat("scale ", scale, " of ", w.name, " is ",
                                     DtypeStr(s.dtype), ", expected ",
                                     absl::StrJoin(names, " or ")));
    }
    const bool ok = shape.empty() ? Numel(s.shape) == 1 : s.shape == shape;
    if (!ok) {
      errors_.push_back(absl::StrCat("scale ", scale, " of ", w.name, " ",
                                     ShapeString(w.shape), " has shape ", ShapeString(s.shape),
                                     ", expected ", shape.empty() ? "[] or [1]" : ShapeString(shape)));
    }
  }

  void OptionalScale(const TensorInfo& w, const std::string& scale, LinearModule& m) {
    if (infos_.count(scale) > 0) ExpectScale(w, scale, {Dtype::kF32}, {}, m);
  }

  std::map<std::string, TensorInfo>& infos_;  // every tensor of the checkpoint, by name
  std::vector<std::string> errors_;           // problems found so far
};

ModelArch DetectArch(const std::string& model_type, const std::map<std::string, TensorInfo>& t) {
  if (model_type == "deepseek_v4") return ModelArch::kDeepseekV4;
  if (absl::StartsWith(model_type, "deepseek_v3")) return ModelArch::kDeepseekV3;
  if (!model_type.empty()) return ModelArch::kUnknown;
  // No config.json: recognize the naming schemes.
  if (t.count("layers.0.attn.wq_a.weight") > 0) return ModelArch::kDeepseekV4;
  if (t.count("model.layers.0.self_attn.q_a_proj.weight") > 0) return ModelArch::kDeepseekV3;
  return ModelArch::kUnknown;
}

}  // namespace

absl::StatusOr<TensorInventory> BuildInventory(const CheckpointDir& dir) {
  TensorInventory inv;
  const nlohmann::json& config = dir.config();
  if (auto it = config.find("model_type"); it != config.end() && it->is_string()) {
    inv.model_type = it->get<std::string>();
  }
  if (auto it = config.find("num_hidden_layers");
      it != config.end() && it->is_number_integer()) {
    inv.num_hidden_layers = it->get<int64_t>();
  }

  std::map<std::string, TensorInfo> infos;
  for (const auto& shard : dir.shards()) {
    const std::string& path = shard->path();
    const std::string file = path.substr(path.rfind('/') + 1);
    for (const TensorView& v : shard->tensors()) {
      TensorInfo info;
      info.name = v.name;
      info.dtype = v.dtype;
      info.shape = v.shape;
      info.bytes = v.size;
      info.shard = file;
      info.format = TensorFormat::kOther;
      info.module = ModuleOf(v.name);
      infos.emplace(v.name, std::move(info));
    }
  }
  inv.arch = DetectArch(inv.model_type, infos);

  // Weights first, so that every scale is claimed before the rest is looked at.
  Classifier classifier(infos);
  for (auto& [name, info] : infos) {
    const std::string leaf = LeafName(name);
    if (leaf != "weight" && leaf != "weight_packed") continue;
    if (std::optional<LinearModule> m = classifier.Weight(info)) {
      inv.linears.push_back(std::move(*m));
    }
  }
  std::vector<std::string>& errors = classifier.errors();
  for (auto& [name, info] : infos) {
    const std::string leaf = LeafName(name);
    if (leaf == "weight" || leaf == "weight_packed" || info.format == TensorFormat::kScale) {
      continue;
    }
    if (leaf == "k_scale" || leaf == "v_scale") {
      info.format = TensorFormat::kScale;
    } else if (IsScaleLeaf(leaf)) {
      errors.push_back(absl::StrCat("scale tensor ", name, " belongs to no quantized weight (",
                                    info.module, ".weight is missing or not quantized)"));
    } else {
      info.format = info.dtype == Dtype::kBF16  ? TensorFormat::kBf16
                    : info.dtype == Dtype::kF32 ? TensorFormat::kF32
                                                : TensorFormat::kOther;
    }
  }
  if (!errors.empty()) {
    const size_t shown = std::min<size_t>(errors.size(), 5);
    return absl::InvalidArgumentError(absl::StrCat(
        dir.dir(), ": ", errors.size(), " invalid quantized tensor(s): ",
        absl::StrJoin(errors.begin(), errors.begin() + shown, "; "),
        errors.size() > shown ? absl::StrCat("; and ", errors.size() - shown, " more") : ""));
  }

  for (auto& [name, info] : infos) inv.tensors.push_back(std::move(info));
  std::sort(inv.tensors.begin(), inv.tensors.end(),
            [](const TensorInfo& a, const TensorInfo& b) { return NaturalLess(a.name, b.name); });
  std::sort(inv.linears.begin(), inv.linears.end(),
            [](const LinearModule& a, const LinearModule& b) { return NaturalLess(a.name, b.name); });
  return inv;
}

}  // namespace quantd::checkpoint
