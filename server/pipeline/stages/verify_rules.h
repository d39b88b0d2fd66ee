// The export rules of DESIGN.md ("Export rules") as checks over any NVFP4 checkpoint, ours or not,
// in the ModelOpt layout (weight, weight_scale, weight_scale_2, input_scale) or the
// compressed-tensors layout (weight_packed, weight_scale, weight_global_scale,
// input_global_scale). Every broken rule is reported as a Violation with one of these ids:
//
//   tensor-layout       dtypes and shapes as vLLM expects: weight U8 [o, i/2], weight_scale
//                       F8_E4M3 [o, i/16], i % 16 == 0, scalar scales F32 of shape [] (ModelOpt)
//                       or [1] (compressed-tensors)
//   weight-scale-bytes  no NaN (0x7F/0xFF), zero (0x00/0x80) or negative byte in a weight_scale
//   weight-scale-2      weight_scale_2 (weight_global_scale) finite and positive
//   input-scale         input scale finite and positive; in a W4A4 checkpoint every NVFP4 module
//                       has one (a missing one loads as 0: vllm#45212)
//   fused-partners      fused siblings ({w1, w3}, {gate_proj, up_proj}, {wq_a, wkv},
//                       {q_a_proj, kv_a_proj_with_mqa}, {q_proj, k_proj, v_proj} under one parent)
//                       are quantized together and store bit-identical weight_scale_2 and
//                       input_scale (vLLM reads the first one for all: vllm#54150)
//   hf-quant-config     ModelOpt: hf_quant_config.json has quantization.{quant_algo, group_size
//                       (16), kv_cache_quant_algo (null allowed), exclude_modules}; a
//                       MIXED_PRECISION config names a quantized_layers entry for every module
//   config-quantization config.json has a quantization_config that matches the checkpoint
//   exclude-matches-quantized  no exclude_modules / ignore entry matches a quantized module
//                       (ModelOpt entries as vLLM reads them: fnmatch, or substring for an entry
//                       without wildcards; compressed-tensors entries: exact name or "re:" regex)
//   undescribed-format  outside the MIXED_PRECISION layout, no linear is left block-quantized
//                       (an F8_E4M3 or I8 weight with a `.scale` / `.weight_scale_inv` sibling):
//                       readers take every module outside the NVFP4 config as BF16
//   index               model.safetensors.index.json agrees with the shards (every tensor listed
//                       once, in the shard that holds it; metadata.total_size = tensor bytes)
//   shard-contents      (verify stage only) the output shard holds exactly the planned tensors
//   manifest            (when the directory has a quantd_manifest.json, output_manifest.h) every
//                       file it lists is present with its size, and with `deep` its SHA-256
//
// The module rules run on one shard (the verify stage) or on every shard at once (VerifyCheckpoint,
// which then also sees fused partners stored in different shards), through the same functions.
#ifndef QUANTD_SERVER_PIPELINE_STAGES_VERIFY_RULES_H_
#define QUANTD_SERVER_PIPELINE_STAGES_VERIFY_RULES_H_

#include <stdint.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"
#include "server/checkpoint/safetensors_reader.h"
#include "server/store/job_store.h"

namespace quantd::pipeline {

inline constexpr char kRuleTensorLayout[] = "tensor-layout";
inline constexpr char kRuleWeightScaleBytes[] = "weight-scale-bytes";
inline constexpr char kRuleWeightScale2[] = "weight-scale-2";
inline constexpr char kRuleInputScale[] = "input-scale";
inline constexpr char kRuleFusedPartners[] = "fused-partners";
inline constexpr char kRuleHfQuantConfig[] = "hf-quant-config";
inline constexpr char kRuleConfigQuantization[] = "config-quantization";
inline constexpr char kRuleExcludeMatchesQuantized[] = "exclude-matches-quantized";
inline constexpr char kRuleUndescribedFormat[] = "undescribed-format";
inline constexpr char kRuleIndex[] = "index";
inline constexpr char kRuleShardContents[] = "shard-contents";
inline constexpr char kRuleManifest[] = "manifest";

struct Violation {
  std::string rule;     // one of the kRule* ids
  std::string subject;  // the module, tensor or file concerned
  std::string message;
};

// One NVFP4 module as stored: views into an open shard (nullptr for a missing tensor).
struct Nvfp4ModuleViews {
  std::string name;
  bool compressed_tensors = false;                       // weight_packed naming
  const checkpoint::TensorView* weight = nullptr;        // .weight / .weight_packed
  const checkpoint::TensorView* weight_scale = nullptr;  // .weight_scale
  const checkpoint::TensorView* global_scale = nullptr;  // .weight_scale_2 / .weight_global_scale
  const checkpoint::TensorView* input_scale = nullptr;   // .input_scale / .input_global_scale
};

// The NVFP4 modules among `tensors`, in natural order of names: a ModelOpt module has a
// weight_scale_2, or a U8 weight with an F8_E4M3 weight_scale; a compressed-tensors module has a
// weight_packed or a weight_global_scale.
std::vector<Nvfp4ModuleViews> FindNvfp4Modules(
    const std::vector<const checkpoint::TensorView*>& tensors);

// The module rules (tensor-layout, weight-scale-bytes, weight-scale-2, input-scale, and the
// shared scales of fused-partners among `modules`). `require_input_scales`: the checkpoint is
// W4A4, so every module must have an input scale.
void CheckNvfp4Modules(const std::vector<Nvfp4ModuleViews>& modules, bool require_input_scales,
                       std::vector<Violation>* violations);

// weight_scale_2 as readers apply it: the ModelOpt value, or 1 / weight_global_scale. The module
// must have passed tensor-layout.
float Nvfp4WeightScale2(const Nvfp4ModuleViews& m);

// Does an exclude_modules entry of a ModelOpt config exclude `module`, as vLLM reads it
// (ModelOptQuantConfigBase.is_layer_excluded: fnmatch, or the entry as a substring)?
bool ModelOptExcludeMatches(absl::string_view entry, absl::string_view module);

// Accumulates the error of decoded values against reference values, element by element, in
// double precision: rel_rmse = sqrt(sum (got-ref)^2 / sum ref^2), sqnr_db = 10 log10(sum ref^2 /
// sum (got-ref)^2) (+inf when the error is zero), max_abs_err = max |got-ref|.
class ErrorStats {
 public:
  void Add(const float* ref, const float* got, int64_t n);
  // The same with BF16 reference values (widened to float32 exactly).
  void AddBf16(const uint16_t* ref, const float* got, int64_t n);
  store::TensorStatsRow Row(const std::string& tensor) const;

 private:
  double ref_sq_ = 0;   // sum of ref^2
  double err_sq_ = 0;   // sum of (got - ref)^2
  double max_abs_ = 0;  // max |got - ref|
};

struct VerifyReport {
  std::string dir;
  std::string layout;                 // "modelopt", "modelopt-mixed" or "compressed-tensors"
  std::string quant_algo;             // as configured ("" when no config says)
  int64_t shards = 0;
  int64_t tensors = 0;
  int64_t nvfp4_modules = 0;
  int64_t input_scales = 0;           // NVFP4 modules with an input scale
  int64_t manifest_files = -1;        // files quantd_manifest.json lists; -1: no manifest
  bool deep = false;                  // their bytes were re-hashed
  std::vector<Violation> violations;  // in rule-check order

  bool ok() const { return violations.empty(); }
};

// Checks every rule on the checkpoint in `dir`; `deep` re-hashes every file its manifest lists.
// Fails (rather than reporting) only when the directory holds no checkpoint or a shard cannot be
// read; a broken index or manifest is a violation.
absl::StatusOr<VerifyReport> VerifyCheckpoint(const std::string& dir, bool deep = false);

// "[rule] subject: message" lines.
std::string FormatViolations(const std::vector<Violation>& violations);
// A summary line, per-rule counts and every violation, for `quantd verify DIR`.
std::string FormatVerifyReport(const VerifyReport& report);
// {dir, layout, quant_algo, shards, tensors, nvfp4_modules, input_scales, manifest_files, deep,
//  ok, violations: [{rule, subject, message}]} for `quantd verify DIR --json`.
nlohmann::json VerifyReportToJson(const VerifyReport& report);

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_STAGES_VERIFY_RULES_H_
