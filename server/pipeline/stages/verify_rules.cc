#include "server/pipeline/stages/verify_rules.h"

#include <dirent.h>
#include <errno.h>
#include <string.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <regex>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "kernels/formats.h"
#include "server/base/excerpt.h"
#include "server/checkpoint/atomic_file.h"
#include "server/checkpoint/checkpoint_dir.h"
#include "server/checkpoint/tensor_inventory.h"
#include "server/pipeline/recipe.h"
#include "server/pipeline/stages/output_manifest.h"

namespace quantd::pipeline {

using checkpoint::LeafName;
using checkpoint::ModuleOf;
using checkpoint::NaturalLess;
using checkpoint::ShapeString;

namespace {

using checkpoint::Dtype;
using checkpoint::TensorView;
using nlohmann::json;

constexpr char kHfQuantConfigName[] = "hf_quant_config.json";
constexpr char kConfigName[] = "config.json";

std::string DtypeStr(Dtype d) { return std::string(checkpoint::DtypeName(d)); }

float ScalarValue(const TensorView& v) {
  float f;
  memcpy(&f, v.data, sizeof(f));
  return f;
}

uint32_t ScalarBits(const TensorView& v) {
  uint32_t u;
  memcpy(&u, v.data, sizeof(u));
  return u;
}

std::string ScalarStr(const TensorView& v) {
  return absl::StrFormat("%.9g (0x%08x)", ScalarValue(v), ScalarBits(v));
}

bool FinitePositive(float f) { return formats::IsFinite(f) && f > 0.0f; }

// A stored per-tensor scale is usable when it is finite and positive, and so is the value readers
// apply (compressed-tensors stores the reciprocal).
bool ScaleUsable(const TensorView& v, bool reciprocal) {
  const float f = ScalarValue(v);
  return FinitePositive(f) && (!reciprocal || FinitePositive(1.0f / f));
}

// Which of a module's tensors have the dtype and shape readers expect.
struct Layout {
  bool weight = false;
  bool weight_scale = false;
  bool global_scale = false;
  bool input_scale = false;  // also false when absent
  std::vector<std::string> problems;
};

Layout CheckLayout(const Nvfp4ModuleViews& m) {
  Layout l;
  const char* weight_leaf = m.compressed_tensors ? "weight_packed" : "weight";
  const char* global_leaf = m.compressed_tensors ? "weight_global_scale" : "weight_scale_2";
  const char* input_leaf = m.compressed_tensors ? "input_global_scale" : "input_scale";
  const std::vector<int64_t> scalar_shape =
      m.compressed_tensors ? std::vector<int64_t>{1} : std::vector<int64_t>{};
  const std::string scalar_desc = m.compressed_tensors ? "F32 [1]" : "F32 [] (0-dim)";

  if (m.weight == nullptr) {
    l.problems.push_back(absl::StrCat("has no ", weight_leaf));
  } else if (m.weight->dtype != Dtype::kU8 || m.weight->shape.size() != 2) {
    l.problems.push_back(absl::StrCat(weight_leaf, " is ", DtypeStr(m.weight->dtype), " ",
                                      ShapeString(m.weight->shape),
                                      ", expected U8 [out, in/2]"));
  } else if (m.weight->shape[1] % 8 != 0) {
    l.problems.push_back(absl::StrCat(weight_leaf, " ", ShapeString(m.weight->shape),
                                      ": input features ", m.weight->shape[1] * 2,
                                      " are not a multiple of 16"));
  } else {
    l.weight = true;
  }

  if (m.weight_scale == nullptr) {
    l.problems.push_back("has no weight_scale");
  } else if (m.weight_scale->dtype != Dtype::kF8E4M3) {
    l.problems.push_back(absl::StrCat("weight_scale is ", DtypeStr(m.weight_scale->dtype),
                                      ", expected F8_E4M3"));
  } else if (l.weight) {
    const std::vector<int64_t> expected = {m.weight->shape[0], m.weight->shape[1] / 8};
    if (m.weight_scale->shape != expected) {
      l.problems.push_back(absl::StrCat("weight_scale has shape ",
                                        ShapeString(m.weight_scale->shape), ", expected ",
                                        ShapeString(expected), " (linear layout, one per 16 inputs)"));
    } else {
      l.weight_scale = true;
    }
  }

  const auto scalar = [&](const TensorView* v, const char* leaf) {
    if (v->dtype == Dtype::kF32 && v->shape == scalar_shape) return true;
    l.problems.push_back(absl::StrCat(leaf, " is ", DtypeStr(v->dtype), " ", ShapeString(v->shape),
                                      ", expected ", scalar_desc));
    return false;
  };
  if (m.global_scale == nullptr) {
    l.problems.push_back(absl::StrCat("has no ", global_leaf));
  } else {
    l.global_scale = scalar(m.global_scale, global_leaf);
  }
  if (m.input_scale != nullptr) l.input_scale = scalar(m.input_scale, input_leaf);
  return l;
}

// Scans a weight_scale for NaN, zero and negative bytes.
void CheckScaleBytes(const Nvfp4ModuleViews& m, std::vector<Violation>* out) {
  const TensorView& s = *m.weight_scale;
  const int64_t cols = s.shape[1];
  int64_t nan = 0, zero = 0, negative = 0;
  int64_t first = -1;
  for (uint64_t i = 0; i < s.size; ++i) {
    const uint8_t b = s.data[i];
    const bool is_nan = formats::E4m3IsNan(b);
    const bool is_zero = (b & 0x7F) == 0;
    const bool is_negative = (b & 0x80) != 0 && !is_nan && !is_zero;
    nan += is_nan;
    zero += is_zero;
    negative += is_negative;
    if (first < 0 && (is_nan || is_zero || is_negative)) first = static_cast<int64_t>(i);
  }
  if (first < 0) return;
  out->push_back({kRuleWeightScaleBytes, m.name,
                  absl::StrFormat("weight_scale has %d NaN, %d zero and %d negative byte(s); "
                                  "the first is 0x%02x at [%d, %d]",
                                  nan, zero, negative, s.data[first], first / cols, first % cols)});
}

// Fused-partner groups among `modules`: (parent, set index) -> members in the set's order.
std::map<std::pair<std::string, size_t>, std::vector<const Nvfp4ModuleViews*>> FusedGroups(
    const std::vector<Nvfp4ModuleViews>& modules) {
  std::map<std::pair<std::string, size_t>, std::vector<const Nvfp4ModuleViews*>> groups;
  for (const Nvfp4ModuleViews& m : modules) {
    const std::string leaf = LeafName(m.name);
    for (size_t k = 0; k < FusedSets().size(); ++k) {
      const std::vector<std::string>& set = FusedSets()[k];
      if (std::find(set.begin(), set.end(), leaf) != set.end()) {
        groups[{ModuleOf(m.name), k}].push_back(&m);
      }
    }
  }
  for (auto& [key, members] : groups) {
    const std::vector<std::string>& order = FusedSets()[key.second];
    std::sort(members.begin(), members.end(), [&](const auto* a, const auto* b) {
      return std::find(order.begin(), order.end(), LeafName(a->name)) <
             std::find(order.begin(), order.end(), LeafName(b->name));
    });
  }
  return groups;
}

void CheckFusedScales(const std::vector<Nvfp4ModuleViews>& modules,
                      const std::map<std::string, Layout>& layouts,
                      std::vector<Violation>* out) {
  for (const auto& [key, members] : FusedGroups(modules)) {
    const Nvfp4ModuleViews& first = *members.front();
    const Layout& fl = layouts.at(first.name);
    for (size_t i = 1; i < members.size(); ++i) {
      const Nvfp4ModuleViews& m = *members[i];
      const Layout& ml = layouts.at(m.name);
      const char* global_leaf = m.compressed_tensors ? "weight_global_scale" : "weight_scale_2";
      const char* input_leaf = m.compressed_tensors ? "input_global_scale" : "input_scale";
      if (fl.global_scale && ml.global_scale &&
          ScalarBits(*first.global_scale) != ScalarBits(*m.global_scale)) {
        out->push_back({kRuleFusedPartners, m.name,
                        absl::StrCat(global_leaf, " ", ScalarStr(*m.global_scale),
                                     " differs from fused partner ", first.name, "'s ",
                                     ScalarStr(*first.global_scale))});
      }
      if (fl.input_scale && ml.input_scale &&
          ScalarBits(*first.input_scale) != ScalarBits(*m.input_scale)) {
        out->push_back({kRuleFusedPartners, m.name,
                        absl::StrCat(input_leaf, " ", ScalarStr(*m.input_scale),
                                     " differs from fused partner ", first.name, "'s ",
                                     ScalarStr(*first.input_scale))});
      }
    }
  }
}

// ---- VerifyCheckpoint helpers ---------------------------------------------------------------

bool IsDirectory(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool IsFile(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// *.safetensors file names directly in `dir`, sorted.
absl::StatusOr<std::vector<std::string>> ListShardFiles(const std::string& dir) {
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) {
    return absl::NotFoundError(absl::StrCat(dir, ": cannot list directory: ", strerror(errno)));
  }
  std::vector<std::string> names;
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (absl::EndsWith(name, ".safetensors") && IsFile(absl::StrCat(dir, "/", name))) {
      names.push_back(name);
    }
  }
  closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

// Parses a JSON file; a missing or malformed file is a violation of `rule` (returns nullopt).
std::optional<json> ReadJsonFile(const std::string& dir, const char* name, const char* rule,
                                 std::vector<Violation>* out) {
  const std::string path = absl::StrCat(dir, "/", name);
  if (!IsFile(path)) {
    out->push_back({rule, name, "file is missing"});
    return std::nullopt;
  }
  absl::StatusOr<std::string> text = checkpoint::ReadFile(path, checkpoint::kMaxIndexFileBytes);
  if (!text.ok()) {
    out->push_back({rule, name, std::string(text.status().message())});
    return std::nullopt;
  }
  json j = json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    out->push_back({rule, name, "not a JSON object"});
    return std::nullopt;
  }
  return j;
}

// obj[key] when it is a string, else "" (never throws on a wrong type).
std::string StringField(const json& obj, const char* key) {
  auto it = obj.find(key);
  return it != obj.end() && it->is_string() ? it->get<std::string>() : "";
}

// obj[key] == value for an integer field.
bool IntField(const json& obj, const char* key, int64_t value) {
  auto it = obj.find(key);
  return it != obj.end() && it->is_number_integer() && it->get<int64_t>() == value;
}

bool IsStringArray(const json& j) {
  if (!j.is_array()) return false;
  for (const json& v : j) {
    if (!v.is_string()) return false;
  }
  return true;
}

// An exclude list entry and how it matches module names.
struct ExcludeEntry {
  std::string text;
  std::unique_ptr<std::regex> regex;  // compressed-tensors "re:" entries
};

bool EntryMatches(const ExcludeEntry& e, bool compressed_tensors, const std::string& module) {
  if (!compressed_tensors) return ModelOptExcludeMatches(e.text, module);
  if (e.regex != nullptr) {
    return std::regex_search(module, *e.regex, std::regex_constants::match_continuous);
  }
  return e.text == module;
}

// What the configuration says about the checkpoint (filled by the config checks).
struct ConfigFacts {
  std::string quant_algo;             // "" when unknown
  bool mixed = false;                 // ModelOpt MIXED_PRECISION
  std::optional<bool> w4a4;           // from the config; nullopt when it does not say
  std::vector<std::string> excludes;  // exclude_modules / ignore
  json quantized_layers = json::object();
};

// A group_size field that must be 16.
bool GroupSize16(const json& obj) { return IntField(obj, "group_size", 16); }

void CheckModelOptConfig(const std::string& dir, ConfigFacts* facts, std::vector<Violation>* out) {
  std::optional<json> hf = ReadJsonFile(dir, kHfQuantConfigName, kRuleHfQuantConfig, out);
  const json* q = nullptr;
  if (hf) {
    auto it = hf->find("quantization");
    if (it == hf->end() || !it->is_object()) {
      out->push_back({kRuleHfQuantConfig, kHfQuantConfigName, "has no \"quantization\" object"});
    } else {
      q = &*it;
    }
  }
  if (q != nullptr) {
    auto algo = q->find("quant_algo");
    if (algo == q->end() || !algo->is_string()) {
      out->push_back({kRuleHfQuantConfig, kHfQuantConfigName,
                      "quantization.quant_algo is missing or not a string"});
    } else {
      facts->quant_algo = algo->get<std::string>();
      if (facts->quant_algo == "NVFP4" || facts->quant_algo == "W4A16_NVFP4") {
        facts->w4a4 = facts->quant_algo == "NVFP4";
      } else if (facts->quant_algo == "MIXED_PRECISION") {
        facts->mixed = true;
      } else {
        out->push_back(
            {kRuleHfQuantConfig, kHfQuantConfigName,
             absl::StrCat("quantization.quant_algo is ", base::Excerpt(facts->quant_algo),
                          ", expected NVFP4, W4A16_NVFP4 or MIXED_PRECISION")});
      }
    }
    if (!GroupSize16(*q)) {
      out->push_back({kRuleHfQuantConfig, kHfQuantConfigName,
                      "quantization.group_size is missing or not 16"});
    }
    auto kv = q->find("kv_cache_quant_algo");
    if (kv == q->end() || !(kv->is_null() || kv->is_string())) {
      out->push_back({kRuleHfQuantConfig, kHfQuantConfigName,
                      "quantization.kv_cache_quant_algo is missing (write null when the KV "
                      "cache is not quantized)"});
    }
    auto ex = q->find("exclude_modules");
    if (ex == q->end() || !IsStringArray(*ex)) {
      out->push_back({kRuleHfQuantConfig, kHfQuantConfigName,
                      "quantization.exclude_modules is missing or not a list of strings"});
    } else {
      facts->excludes = ex->get<std::vector<std::string>>();
    }
    if (facts->mixed) {
      auto layers = q->find("quantized_layers");
      if (layers == q->end() || !layers->is_object()) {
        out->push_back({kRuleHfQuantConfig, kHfQuantConfigName,
                        "MIXED_PRECISION without a quantized_layers object"});
      } else {
        facts->quantized_layers = *layers;
        bool all_w4a4 = true;
        for (auto it = layers->begin(); it != layers->end(); ++it) {
          const json& cfg = *it;
          const std::string algo = cfg.is_object() ? StringField(cfg, "quant_algo") : "";
          if ((algo != "NVFP4" && algo != "W4A16_NVFP4") || !cfg.is_object() ||
              !GroupSize16(cfg)) {
            out->push_back({kRuleHfQuantConfig, it.key(),
                            "quantized_layers entry is not {quant_algo: NVFP4 or W4A16_NVFP4, "
                            "group_size: 16}"});
          }
          all_w4a4 = all_w4a4 && algo == "NVFP4";
        }
        if (!layers->empty()) facts->w4a4 = all_w4a4;
      }
    }
  }

  std::optional<json> config = ReadJsonFile(dir, kConfigName, kRuleConfigQuantization, out);
  if (!config) return;
  auto qc = config->find("quantization_config");
  if (qc == config->end() || !qc->is_object()) {
    out->push_back({kRuleConfigQuantization, kConfigName, "has no quantization_config object"});
    return;
  }
  const std::string method = StringField(*qc, "quant_method");
  const bool modelopt = absl::StartsWith(method, "modelopt");
  // NVIDIA's DeepSeek-V4 layout: the FP8 base method with NVFP4 experts (moe_quant_algo).
  const bool fp8_base = method == "fp8" && qc->contains("moe_quant_algo");
  if (!modelopt && !fp8_base) {
    out->push_back({kRuleConfigQuantization, kConfigName,
                    absl::StrCat("quantization_config.quant_method is ", base::Excerpt(method),
                                 ", expected \"modelopt\" (or \"fp8\" with moe_quant_algo) for "
                                 "ModelOpt NVFP4 modules")});
  }
  auto algo = qc->find("quant_algo");
  if (!facts->quant_algo.empty() &&
      (algo == qc->end() || !algo->is_string() || *algo != facts->quant_algo)) {
    out->push_back({kRuleConfigQuantization, kConfigName,
                    absl::StrCat("quantization_config.quant_algo ",
                                 algo == qc->end()   ? "is missing"
                                 : algo->is_string() ? base::Excerpt(algo->get<std::string>())
                                                     : absl::StrCat("(a ", algo->type_name(), ")"),
                                 " does not match hf_quant_config.json's ",
                                 base::Excerpt(facts->quant_algo))});
  }
  if (auto ignore = qc->find("ignore"); q != nullptr && ignore != qc->end() &&
                                        q->contains("exclude_modules") &&
                                        *ignore != (*q)["exclude_modules"]) {
    out->push_back({kRuleConfigQuantization, kConfigName,
                    "quantization_config.ignore differs from hf_quant_config.json's "
                    "exclude_modules"});
  }
  if (q != nullptr && q->contains("kv_cache_quant_algo")) {
    const json& kv = (*q)["kv_cache_quant_algo"];
    auto scheme = qc->find("kv_cache_scheme");
    const bool has_scheme = scheme != qc->end() && !scheme->is_null();
    if (kv.is_string() && kv == "FP8" && !has_scheme) {
      out->push_back({kRuleConfigQuantization, kConfigName,
                      "hf_quant_config.json quantizes the KV cache (FP8) but "
                      "quantization_config has no kv_cache_scheme"});
    } else if (kv.is_null() && has_scheme) {
      out->push_back({kRuleConfigQuantization, kConfigName,
                      "quantization_config has a kv_cache_scheme but hf_quant_config.json's "
                      "kv_cache_quant_algo is null"});
    }
  }
  if (facts->mixed && qc->contains("quantized_layers") &&
      (*qc)["quantized_layers"] != facts->quantized_layers) {
    out->push_back({kRuleConfigQuantization, kConfigName,
                    "quantization_config.quantized_layers differs from hf_quant_config.json's"});
  }
}

// A compressed-tensors weights/input_activations entry for NVFP4.
bool IsNvfp4Args(const json& args) {
  return args.is_object() && IntField(args, "num_bits", 4) &&
         StringField(args, "type") == "float" && GroupSize16(args);
}

void CheckCompressedTensorsConfig(const std::string& dir, ConfigFacts* facts,
                                  std::vector<Violation>* out) {
  std::optional<json> config = ReadJsonFile(dir, kConfigName, kRuleConfigQuantization, out);
  if (!config) return;
  auto qc = config->find("quantization_config");
  if (qc == config->end() || !qc->is_object()) {
    out->push_back({kRuleConfigQuantization, kConfigName, "has no quantization_config object"});
    return;
  }
  if (StringField(*qc, "quant_method") != "compressed-tensors") {
    out->push_back({kRuleConfigQuantization, kConfigName,
                    "quantization_config.quant_method is not \"compressed-tensors\""});
  }
  const std::string top_format = StringField(*qc, "format");
  auto groups = qc->find("config_groups");
  bool found = false;
  if (groups != qc->end() && groups->is_object()) {
    for (auto it = groups->begin(); it != groups->end(); ++it) {
      const json& g = *it;
      if (!g.is_object()) continue;
      const std::string format = g.contains("format") ? StringField(g, "format") : top_format;
      if (format != "nvfp4-pack-quantized" || !g.contains("weights") || !IsNvfp4Args(g["weights"])) {
        continue;
      }
      found = true;
      auto in = g.find("input_activations");
      const bool has_input = in != g.end() && !in->is_null();
      if (has_input && !IsNvfp4Args(*in)) {
        out->push_back({kRuleConfigQuantization, it.key(),
                        "input_activations is not {num_bits: 4, type: float, group_size: 16}"});
      }
      facts->w4a4 = facts->w4a4.value_or(false) || has_input;
    }
  }
  if (!found) {
    out->push_back({kRuleConfigQuantization, kConfigName,
                    "quantization_config has no config_groups entry with format "
                    "nvfp4-pack-quantized and NVFP4 weights (num_bits 4, float, group_size 16)"});
  }
  facts->quant_algo = facts->w4a4.value_or(true) ? "NVFP4" : "W4A16_NVFP4";
  auto ignore = qc->find("ignore");
  if (ignore != qc->end() && !IsStringArray(*ignore)) {
    out->push_back({kRuleConfigQuantization, kConfigName,
                    "quantization_config.ignore is not a list of strings"});
  } else if (ignore != qc->end()) {
    facts->excludes = ignore->get<std::vector<std::string>>();
  }
}

// The shards of a checkpoint, open, and their tensors (each name once).
struct OpenShards {
  std::vector<std::unique_ptr<checkpoint::SafetensorsFile>> files;
  std::map<std::string, std::string> where;  // tensor -> shard holding it (the first one)
  std::vector<const TensorView*> tensors;    // in shard order, then file order
};

// Opens the shards the index names (every *.safetensors file when there is no usable index)
// and checks the index against them.
absl::StatusOr<OpenShards> OpenAndCheckIndex(const std::string& dir, std::vector<Violation>* out) {
  absl::StatusOr<std::vector<std::string>> files = ListShardFiles(dir);
  if (!files.ok()) return files.status();
  const std::string index_path = absl::StrCat(dir, "/", checkpoint::kIndexFileName);
  std::optional<checkpoint::ShardIndex> index;
  if (IsFile(index_path)) {
    absl::StatusOr<checkpoint::ShardIndex> parsed = checkpoint::ParseShardIndex(index_path);
    if (parsed.ok()) {
      index = std::move(*parsed);
    } else {
      out->push_back(
          {kRuleIndex, checkpoint::kIndexFileName, std::string(parsed.status().message())});
    }
  } else if (files->size() > 1) {
    out->push_back({kRuleIndex, checkpoint::kIndexFileName,
                    absl::StrCat("is missing, but the directory holds ", files->size(),
                                 " .safetensors files")});
  }
  if (files->empty() && !index) {
    return absl::NotFoundError(absl::StrCat(dir, ": no .safetensors file and no index"));
  }
  std::vector<std::string> shard_names = *files;
  if (index) {
    std::set<std::string> referenced;
    for (const auto& [tensor, shard] : index->weight_map) referenced.insert(shard);
    for (const std::string& f : *files) {
      if (referenced.count(f) == 0) {
        out->push_back({kRuleIndex, f,
                        "shard is not referenced by the index, so readers ignore its tensors"});
      }
    }
    shard_names.clear();
    for (const std::string& s : referenced) {
      if (IsFile(absl::StrCat(dir, "/", s))) {
        shard_names.push_back(s);
      } else {
        out->push_back({kRuleIndex, s, "shard named by the index is missing"});
      }
    }
  }

  OpenShards shards;
  uint64_t tensor_bytes = 0;
  for (const std::string& name : shard_names) {
    absl::StatusOr<std::unique_ptr<checkpoint::SafetensorsFile>> f =
        checkpoint::SafetensorsFile::Open(absl::StrCat(dir, "/", name));
    if (!f.ok()) return f.status();
    for (const TensorView& v : (*f)->tensors()) {
      tensor_bytes += v.size;
      auto [it, inserted] = shards.where.emplace(v.name, name);
      if (!inserted) {
        out->push_back({kRuleIndex, v.name,
                        absl::StrCat("tensor is stored in both ", it->second, " and ", name)});
        continue;
      }
      shards.tensors.push_back(&v);
      if (!index) continue;
      auto listed = index->weight_map.find(v.name);
      if (listed == index->weight_map.end()) {
        out->push_back({kRuleIndex, v.name,
                        absl::StrCat("tensor in ", name, " is not listed in the index")});
      } else if (listed->second != name) {
        out->push_back({kRuleIndex, v.name,
                        absl::StrCat("tensor is in ", name, " but the index maps it to ",
                                     listed->second)});
      }
    }
    shards.files.push_back(std::move(*f));
  }
  if (index) {
    for (const auto& [tensor, shard] : index->weight_map) {
      if (shards.where.count(tensor) == 0 && IsFile(absl::StrCat(dir, "/", shard))) {
        out->push_back({kRuleIndex, tensor,
                        absl::StrCat("listed in ", shard, " by the index but absent from it")});
      }
    }
    if (index->total_size != tensor_bytes) {
      out->push_back({kRuleIndex, checkpoint::kIndexFileName,
                      absl::StrCat("metadata.total_size is ", index->total_size,
                                   " but the shards hold ", tensor_bytes, " tensor bytes")});
    }
  }
  return shards;
}

// Fused sets quantized in part: readers refuse to load them or mix formats in one GEMM.
void CheckPartialFusion(const std::vector<Nvfp4ModuleViews>& modules,
                        const std::map<std::string, std::string>& where,
                        std::vector<Violation>* out) {
  std::set<std::string> nvfp4_names;
  for (const Nvfp4ModuleViews& m : modules) nvfp4_names.insert(m.name);
  for (const Nvfp4ModuleViews& m : modules) {
    const std::string parent = ModuleOf(m.name);
    for (const std::vector<std::string>& set : FusedSets()) {
      if (std::find(set.begin(), set.end(), LeafName(m.name)) == set.end()) continue;
      for (const std::string& sibling : set) {
        const std::string other = parent.empty() ? sibling : absl::StrCat(parent, ".", sibling);
        if (nvfp4_names.count(other) == 0 && where.count(other + ".weight") > 0) {
          out->push_back({kRuleFusedPartners, m.name,
                          absl::StrCat("is NVFP4 but its fused partner ", other,
                                       " is not; readers run them as one GEMM")});
        }
      }
    }
  }
}

// MIXED_PRECISION: every NVFP4 module is, or is under, a quantized_layers entry.
void CheckQuantizedLayers(const std::vector<Nvfp4ModuleViews>& modules, const json& layers,
                          std::vector<Violation>* out) {
  for (const Nvfp4ModuleViews& m : modules) {
    bool covered = false;
    for (auto it = layers.begin(); it != layers.end() && !covered; ++it) {
      covered = it.key() == m.name || absl::StartsWith(m.name, it.key() + ".");
    }
    if (!covered) {
      out->push_back({kRuleHfQuantConfig, m.name,
                      "NVFP4 module has no quantized_layers entry (MIXED_PRECISION)"});
    }
  }
}

// No exclude_modules / ignore entry matches a quantized module.
void CheckExcludes(const std::vector<Nvfp4ModuleViews>& modules,
                   const std::vector<std::string>& excludes, bool compressed_tensors,
                   std::vector<Violation>* out) {
  for (const std::string& text : excludes) {
    ExcludeEntry entry{text, nullptr};
    if (compressed_tensors && absl::StartsWith(text, "re:")) {
      try {
        entry.regex = std::make_unique<std::regex>(text.substr(3));
      } catch (const std::regex_error& e) {
        out->push_back({kRuleConfigQuantization, text,
                        absl::StrCat("ignore entry is not a valid regex: ", e.what())});
        continue;
      }
    }
    std::vector<std::string> hits;
    for (const Nvfp4ModuleViews& m : modules) {
      if (EntryMatches(entry, compressed_tensors, m.name)) hits.push_back(m.name);
    }
    if (!hits.empty()) {
      out->push_back({kRuleExcludeMatchesQuantized, text,
                      absl::StrCat("matches quantized module ", hits.front(),
                                   hits.size() > 1 ? absl::StrCat(" and ", hits.size() - 1, " more")
                                                   : "")});
    }
  }
}

}  // namespace

std::vector<Nvfp4ModuleViews> FindNvfp4Modules(const std::vector<const TensorView*>& tensors) {
  std::map<std::string, const TensorView*> by_name;
  for (const TensorView* t : tensors) by_name.emplace(t->name, t);
  const auto find = [&](const std::string& name) -> const TensorView* {
    auto it = by_name.find(name);
    return it == by_name.end() ? nullptr : it->second;
  };
  std::map<std::string, bool> modules;  // name -> compressed-tensors
  for (const auto& [name, view] : by_name) {
    const std::string leaf = LeafName(name);
    const std::string module = ModuleOf(name);
    if (leaf == "weight_packed" || leaf == "weight_global_scale") {
      modules[module] = true;
    } else if (leaf == "weight_scale_2") {
      modules.emplace(module, false);
    } else if (leaf == "weight_scale" && view->dtype == Dtype::kF8E4M3) {
      const TensorView* w = find(module + ".weight");
      if (w != nullptr && w->dtype == Dtype::kU8) modules.emplace(module, false);
    }
  }
  std::vector<Nvfp4ModuleViews> out;
  for (const auto& [name, ct] : modules) {
    Nvfp4ModuleViews m;
    m.name = name;
    m.compressed_tensors = ct;
    m.weight = find(name + (ct ? ".weight_packed" : ".weight"));
    m.weight_scale = find(name + ".weight_scale");
    m.global_scale = find(name + (ct ? ".weight_global_scale" : ".weight_scale_2"));
    m.input_scale = find(name + (ct ? ".input_global_scale" : ".input_scale"));
    out.push_back(std::move(m));
  }
  std::sort(out.begin(), out.end(), [](const Nvfp4ModuleViews& a, const Nvfp4ModuleViews& b) {
    return NaturalLess(a.name, b.name);
  });
  return out;
}

void CheckNvfp4Modules(const std::vector<Nvfp4ModuleViews>& modules, bool require_input_scales,
                       std::vector<Violation>* violations) {
  std::map<std::string, Layout> layouts;
  for (const Nvfp4ModuleViews& m : modules) {
    Layout l = CheckLayout(m);
    for (const std::string& p : l.problems) {
      violations->push_back({kRuleTensorLayout, m.name, p});
    }
    if (l.weight_scale) CheckScaleBytes(m, violations);
    const char* global_leaf = m.compressed_tensors ? "weight_global_scale" : "weight_scale_2";
    const char* input_leaf = m.compressed_tensors ? "input_global_scale" : "input_scale";
    if (l.global_scale && !ScaleUsable(*m.global_scale, m.compressed_tensors)) {
      violations->push_back({kRuleWeightScale2, m.name,
                             absl::StrCat(global_leaf, " is ", ScalarStr(*m.global_scale),
                                          ", expected finite and positive")});
    }
    if (m.input_scale == nullptr && require_input_scales) {
      violations->push_back({kRuleInputScale, m.name,
                             absl::StrCat("has no ", input_leaf,
                                          " in a W4A4 checkpoint (readers load it as 0)")});
    } else if (l.input_scale && !ScaleUsable(*m.input_scale, m.compressed_tensors)) {
      violations->push_back({kRuleInputScale, m.name,
                             absl::StrCat(input_leaf, " is ", ScalarStr(*m.input_scale),
                                          ", expected finite and positive")});
    }
    layouts.emplace(m.name, std::move(l));
  }
  CheckFusedScales(modules, layouts, violations);
}

float Nvfp4WeightScale2(const Nvfp4ModuleViews& m) {
  const float v = ScalarValue(*m.global_scale);
  return m.compressed_tensors ? 1.0f / v : v;
}

bool ModelOptExcludeMatches(absl::string_view entry, absl::string_view module) {
  return GlobMatch(entry, module) || absl::StrContains(module, entry);
}

namespace {

float RefValue(float v) { return v; }
float RefValue(uint16_t bf16) { return formats::Bf16ToFloat(bf16); }

// Sums in kLanes independent partial sums, so that they are kept in vector registers and are not
// bound by the latency of one chain of additions. Each element's terms are computed exactly as
// ErrorStats documents; only the order of the (non-negative) sums differs, which changes them in
// the last bits. The maximum does not depend on the order.
template <typename Ref>
void AddErrors(const Ref* ref, const float* got, int64_t n, double* ref_sq_total,
               double* err_sq_total, double* max_abs_total) {
  constexpr int kLanes = 8;
  double ref_sq[kLanes] = {}, err_sq[kLanes] = {}, max_abs[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const double r = RefValue(ref[i + l]);
      const double e = static_cast<double>(got[i + l]) - r;
      ref_sq[l] += r * r;
      err_sq[l] += e * e;
      max_abs[l] = std::max(max_abs[l], std::fabs(e));
    }
  }
  for (int l = 0; i < n; ++i, ++l) {
    const double r = RefValue(ref[i]);
    const double e = static_cast<double>(got[i]) - r;
    ref_sq[l] += r * r;
    err_sq[l] += e * e;
    max_abs[l] = std::max(max_abs[l], std::fabs(e));
  }
  for (int l = 0; l < kLanes; ++l) {
    *ref_sq_total += ref_sq[l];
    *err_sq_total += err_sq[l];
    *max_abs_total = std::max(*max_abs_total, max_abs[l]);
  }
}

}  // namespace

void ErrorStats::Add(const float* ref, const float* got, int64_t n) {
  AddErrors(ref, got, n, &ref_sq_, &err_sq_, &max_abs_);
}

void ErrorStats::AddBf16(const uint16_t* ref, const float* got, int64_t n) {
  AddErrors(ref, got, n, &ref_sq_, &err_sq_, &max_abs_);
}

store::TensorStatsRow ErrorStats::Row(const std::string& tensor) const {
  store::TensorStatsRow row;
  row.tensor = tensor;
  const double inf = std::numeric_limits<double>::infinity();
  if (err_sq_ == 0) {
    row.rel_rmse = 0;
    row.sqnr_db = inf;
  } else if (ref_sq_ == 0) {
    row.rel_rmse = inf;
    row.sqnr_db = -inf;
  } else {
    row.rel_rmse = std::sqrt(err_sq_ / ref_sq_);
    row.sqnr_db = 10.0 * std::log10(ref_sq_ / err_sq_);
  }
  row.max_abs_err = max_abs_;
  return row;
}

// Outside the mixed layout the config describes only the NVFP4 modules, and readers build every
// other linear as an unquantized BF16 one: an FP8-block or MXFP4 weight left with its scales
// would be loaded as garbage or refused.
void CheckUndescribedBlockFormats(const std::vector<const TensorView*>& tensors,
                                  std::vector<Violation>* out) {
  std::set<std::string> names;
  for (const TensorView* t : tensors) names.insert(t->name);
  for (const TensorView* t : tensors) {
    if (!absl::EndsWith(t->name, ".weight")) continue;
    if (t->dtype != Dtype::kF8E4M3 && t->dtype != Dtype::kI8) continue;
    const std::string module = t->name.substr(0, t->name.size() - strlen(".weight"));
    for (const char* scale : {".scale", ".weight_scale_inv"}) {
      if (names.count(module + scale) == 0) continue;
      out->push_back({kRuleUndescribedFormat, module,
                      absl::StrCat("is stored ",
                                   t->dtype == Dtype::kI8 ? "as MXFP4" : "as FP8 blocks",
                                   " with its ", scale + 1,
                                   ", but the config describes only NVFP4 modules: readers load "
                                   "it as an unquantized BF16 linear")});
      break;
    }
  }
}

// The manifest rule: quantd_manifest.json, when `dir` has one, against the files it lists.
void CheckManifest(const std::string& dir, bool deep, VerifyReport* report) {
  const std::string path = absl::StrCat(dir, "/", kManifestName);
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) return;
  report->deep = deep;
  std::vector<Violation>& out = report->violations;
  absl::StatusOr<std::string> text = checkpoint::ReadFile(path, kMaxManifestBytes);
  if (!text.ok()) {
    out.push_back({kRuleManifest, kManifestName, std::string(text.status().message())});
    return;
  }
  absl::StatusOr<std::vector<ManifestEntry>> files = ParseManifest(*text, kManifestName);
  if (!files.ok()) {
    out.push_back({kRuleManifest, kManifestName, std::string(files.status().message())});
    return;
  }
  report->manifest_files = static_cast<int64_t>(files->size());
  absl::StatusOr<std::vector<ManifestMismatch>> mismatches = CheckManifestFiles(dir, *files, deep);
  if (!mismatches.ok()) {
    out.push_back({kRuleManifest, kManifestName, std::string(mismatches.status().message())});
    return;
  }
  for (const ManifestMismatch& m : *mismatches) out.push_back({kRuleManifest, m.path, m.message});
}

absl::StatusOr<VerifyReport> VerifyCheckpoint(const std::string& dir, bool deep) {
  if (!IsDirectory(dir)) return absl::NotFoundError(absl::StrCat(dir, ": not a directory"));
  VerifyReport report;
  report.dir = dir;
  std::vector<Violation>& out = report.violations;
  absl::StatusOr<OpenShards> shards = OpenAndCheckIndex(dir, &out);
  if (!shards.ok()) return shards.status();
  report.shards = static_cast<int64_t>(shards->files.size());
  report.tensors = static_cast<int64_t>(shards->tensors.size());

  const std::vector<Nvfp4ModuleViews> modules = FindNvfp4Modules(shards->tensors);
  report.nvfp4_modules = static_cast<int64_t>(modules.size());
  bool compressed_tensors = false;
  for (const Nvfp4ModuleViews& m : modules) {
    compressed_tensors = compressed_tensors || m.compressed_tensors;
    report.input_scales += m.input_scale != nullptr;
  }
  if (modules.empty()) out.push_back({kRuleTensorLayout, dir, "holds no NVFP4 module"});

  ConfigFacts facts;
  if (compressed_tensors) {
    CheckCompressedTensorsConfig(dir, &facts, &out);
  } else {
    CheckModelOptConfig(dir, &facts, &out);
  }
  report.layout = compressed_tensors ? "compressed-tensors"
                  : facts.mixed      ? "modelopt-mixed"
                                     : "modelopt";
  report.quant_algo = facts.quant_algo;
  // Without a usable config, a checkpoint is W4A4 when any module has an input scale.
  CheckNvfp4Modules(modules, facts.w4a4.value_or(report.input_scales > 0), &out);
  CheckPartialFusion(modules, shards->where, &out);
  if (facts.mixed) {
    CheckQuantizedLayers(modules, facts.quantized_layers, &out);
  } else {
    CheckUndescribedBlockFormats(shards->tensors, &out);
  }
  CheckExcludes(modules, facts.excludes, compressed_tensors, &out);
  CheckManifest(dir, deep, &report);
  return report;
}

std::string FormatViolations(const std::vector<Violation>& violations) {
  std::string text;
  for (const Violation& v : violations) {
    absl::StrAppend(&text, "[", v.rule, "] ", v.subject, ": ", v.message, "\n");
  }
  return text;
}

std::string FormatVerifyReport(const VerifyReport& r) {
  std::string text = absl::StrCat(
      r.dir, ": ", r.layout, r.quant_algo.empty() ? "" : absl::StrCat(" ", r.quant_algo),
      " checkpoint, ", r.shards, " shard(s), ", r.tensors, " tensors, ", r.nvfp4_modules,
      " NVFP4 modules (", r.input_scales, " with an input scale)\n");
  if (r.manifest_files >= 0) {
    absl::StrAppend(&text, "manifest: ", r.manifest_files, " files, ",
                    r.deep ? "sizes and SHA-256 checked" : "sizes checked (--deep re-hashes)",
                    "\n");
  }
  if (r.ok()) {
    absl::StrAppend(&text, "OK: every export rule holds\n");
    return text;
  }
  std::map<std::string, int64_t> by_rule;
  for (const Violation& v : r.violations) ++by_rule[v.rule];
  absl::StrAppend(&text, "FAILED: ", r.violations.size(), " violation(s):");
  for (const auto& [rule, n] : by_rule) absl::StrAppend(&text, " ", rule, " ", n, ";");
  text.back() = '\n';
  absl::StrAppend(&text, FormatViolations(r.violations));
  return text;
}

json VerifyReportToJson(const VerifyReport& r) {
  json violations = json::array();
  for (const Violation& v : r.violations) {
    violations.push_back({{"rule", v.rule}, {"subject", v.subject}, {"message", v.message}});
  }
  return {{"dir", r.dir},
          {"layout", r.layout},
          {"quant_algo", r.quant_algo},
          {"shards", r.shards},
          {"tensors", r.tensors},
          {"nvfp4_modules", r.nvfp4_modules},
          {"input_scales", r.input_scales},
          {"manifest_files", r.manifest_files},
          {"deep", r.deep},
          {"ok", r.ok()},
          {"violations", violations}};
}

}  // namespace quantd::pipeline
