// JobSpec: what a conversion job does. quantd.proto's JobSpec is its schema: a spec file
// (`quantd run SPEC.json`, `quantctl submit --spec`) is that message in protobuf's JSON mapping
// (ParseJobSpecJson), a request carries it as is, and ValidateJobSpec turns either into this
// validated struct, naming the field in every error (bad enum values, negative counts, limits).
// The keys, as the proto's field names spell them:
//
//   {"source": DIR, "output": DIR,                       required
//    "recipe": "experts"|"full",                          default "experts" unless include is set
//    "include": [GLOB...], "exclude": [GLOB...],          explicit selection / extra exclusions
//    "weight_format": "nvfp4"|"w4a16_nvfp4",              default "nvfp4"
//    "expert_cast": "lossless"|"requantize",              default "lossless"
//    "export_format": "modelopt"|"compressed-tensors",    default "modelopt"
//    "kv_cache": "none"|"fp8_cast"|"fp8",                 default "none"
//    "materialize_bf16": DIR,                              optional BF16 copy of the source
//    "calibration": {"amax_file": PATH,
//                    "datasets": [{"path": JSONL, "samples": N}...],  calibration text (see
//                    "dataset": JSONL, "num_samples": N,            calibration/calibration_data.h)
//                    "seq_len": N, "min_seq_len": N, "seed": N,        default 512, 16, 0
//                    "add_bos": BOOL, "calibrate_all_experts": BOOL,   default true, false
//                    "mode": "data"|"constant",                        default "data"
//                    "w2_input": "unweighted"|"weighted"|"max",        default "max"
//                    "expert_amax": "per_expert"|"layer_max",          default "per_expert"
//                    "uncalibrated": "layer_max"|"model_max",          default "layer_max"
//                    "numerics": "official"|"math",                    default "official"
//                    "amax_out": PATH,                                  optional
//                    "checkpoint_seconds": N},                          default 300; 0: each layer
//                                  (of the calibrate and the evaluate stage: layer checkpoints)
//      (calibration options: see CalibrationSpec)
//    "evaluate": {"enabled": BOOL,                        default true for a job that calibrates
//                                                           on data, which it then evaluates
//                 "num_samples": N,                       held-out samples, default 32 or fewer
//                 "gate": {"max_mean_kl": X,              each optional: the job fails when
//                          "min_top1_agreement": X,       the quantized model is outside it
//                          "max_ppl_ratio": X}},          (see EvaluateSpec)
//    "verify": {"deep": BOOL},                            default false: re-hash only shards
//                                                           an earlier process wrote
//    "devices": "auto" | ["cpu", "cuda:0", ...],          default "auto"
//    "host_memory_bytes": N,                              default: no budget beyond the plan's
//    "overwrite": BOOL}                                   default false: pipeline/output_marker.h
//
// An empty string, 0 or an unset optional field means the default; "devices": "auto" (or the
// list ["auto"]) means every device. Limits: the JSON text at most kMaxJobSpecBytes; every path
// at most kMaxPathBytes of valid UTF-8 (job_paths.h); at most kMaxGlobs include / exclude globs
// of at most kMaxGlobBytes each.
//
// A job stores its spec as JobSpecToJson writes it (the stored form: every field, defaults
// spelled out, plus the internal source_roots) and reads it back with ParseStoredJobSpec, which
// also reads the forms earlier releases stored.
#ifndef QUANTD_SERVER_JOB_JOB_SPEC_H_
#define QUANTD_SERVER_JOB_JOB_SPEC_H_

#include <stdint.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "quantd/v1/quantd.pb.h"

namespace quantd::job {

enum class RecipeKind { kExperts, kFull, kCustom };
enum class WeightFormat { kNvfp4, kW4A16Nvfp4 };
enum class ExpertCast { kLossless, kRequantize };
enum class ExportFormat { kModelOpt, kCompressedTensors };
enum class KvCache { kNone, kFp8Cast, kFp8 };

// calibration.mode: "data" measures amax on the calibration samples; "constant" writes
// input_scale = 1.0 (amax 2688) for every module with no forward pass (ModelOpt's constant_amax).
enum class CalibrationMode { kData, kConstant };
// calibration.w2_input: which input of a routed expert's w2 its amax comes from: "unweighted"
// (what vLLM / SGLang / TensorRT-LLM quantize: they apply the routing weight after w2),
// "weighted" (the official code and NVIDIA's V4 recipe) or "max" of the two (safe either way).
enum class W2Input { kUnweighted, kWeighted, kMax };
// calibration.expert_amax: "per_expert" keeps each routed expert's own amax; "layer_max" writes
// each layer's max (per projection) into every expert (what FlashInfer / TensorRT-LLM use anyway).
enum class ExpertAmax { kPerExpert, kLayerMax };
// calibration.uncalibrated: an expert no calibration token reached takes the max of the same
// projection over its layer's experts ("layer_max") or over every layer's ("model_max", NVIDIA).
enum class UncalibratedFill { kLayerMax, kModelMax };
// calibration.numerics: the forward's rounding (model/v4_numerics.h): "official" (DeepSeek's
// inference code) or "math" (fp32 throughout, as transformers in fp32).
enum class CalibrationNumerics { kOfficial, kMath };

// One JSONL file of calibration samples.
struct CalibrationDataset {
  std::string path;
  int64_t samples = 0;  // samples taken from it; 0 = its even share of num_samples
};

inline constexpr int64_t kDefaultCheckpointSeconds = 300;
inline constexpr int64_t kMaxCheckpointSeconds = 365 * 24 * 3600;

struct CalibrationSpec {
  std::string amax_file;           // JSON {module: input_amax} from an earlier calibration
  std::string dataset;             // shorthand for datasets = [{dataset, num_samples}]
  std::vector<CalibrationDataset> datasets;
  int64_t num_samples = 0;         // total for the datasets without `samples`; 0 = 512
  int64_t seq_len = 512;           // tokens per sample at most (longer ones are truncated)
  int64_t min_seq_len = 16;        // shorter samples are skipped
  int64_t seed = 0;                // picks the samples of each file
  bool add_bos = true;             // BOS before every text / chat sample
  // Every routed expert's amax also covers the tokens not routed to it (w1/w3 input and the
  // unweighted w2 input; the routed output is unchanged). Off by default: it inflates amax and
  // multiplies the MoE work (calibration_runtime.md §3, §7.5).
  bool calibrate_all_experts = false;
  CalibrationMode mode = CalibrationMode::kData;
  W2Input w2_input = W2Input::kMax;
  ExpertAmax expert_amax = ExpertAmax::kPerExpert;
  UncalibratedFill uncalibrated = UncalibratedFill::kLayerMax;
  CalibrationNumerics numerics = CalibrationNumerics::kOfficial;
  // Where to write the measured table in the amax_file format (module -> amax for every linear
  // observed, plus "<module>.unweighted" / "<module>.weighted" for routed w2); "" = nowhere.
  std::string amax_out;
  // A calibrating job keeps a layer's output activations on disk (calibration/layer_checkpoint.h)
  // when this many seconds passed since the last such layer (0: every layer), so that a restart
  // resumes after it instead of from layer 0; a layer spilled whole is kept whatever the clock.
  // The evaluate stage keeps its layers' outputs (both models') on the same clock.
  int64_t checkpoint_seconds = kDefaultCheckpointSeconds;
};

// evaluate.gate: bounds on the quality figures of server/evaluation (quantized model against its
// source on held-out samples); an absent bound is not checked.
struct QualityGate {
  std::optional<double> max_mean_kl;         // mean next-token KL(source || quantized), nats, >= 0
  std::optional<double> min_top1_agreement;  // fraction of tokens with the same argmax, in [0, 1]
  std::optional<double> max_ppl_ratio;       // perplexity quantized / source, > 0
};

struct EvaluateSpec {
  std::optional<bool> enabled;  // unset: on for a job that calibrates on data
  // Held-out samples: from the calibration data sets, the ones after the calibration samples in
  // each file's seeded order (evaluation/held_out_samples.h); 0 = kDefaultEvaluateSamples, or all
  // the data holds when fewer.
  int64_t num_samples = 0;
  QualityGate gate;

  // Whether a job that calibrates on data evaluates its output (the evaluate stage): unless
  // `enabled` is false.
  bool on() const { return enabled.value_or(true); }
  // Whether the spec sets anything here (the canonical spec then carries the section).
  bool set() const {
    return enabled.has_value() || num_samples != 0 || gate.max_mean_kl ||
           gate.min_top1_agreement || gate.max_ppl_ratio;
  }
};
inline constexpr int64_t kDefaultEvaluateSamples = 32;

struct VerifySpec {
  // Re-read and re-hash every output shard, also those this process hashed as it wrote them
  // (pipeline/stages/verify_stage.h).
  bool deep = false;
};

// The revision of the built-in recipes (pipeline/recipe.h) a new job is planned with.
inline constexpr int kRecipeRevision = 2;

struct JobSpec {
  std::string source;
  std::string output;
  RecipeKind recipe = RecipeKind::kExperts;
  std::vector<std::string> include;  // only with RecipeKind::kCustom
  std::vector<std::string> exclude;  // applied after the recipe
  WeightFormat weight_format = WeightFormat::kNvfp4;
  ExpertCast expert_cast = ExpertCast::kLossless;
  ExportFormat export_format = ExportFormat::kModelOpt;
  KvCache kv_cache = KvCache::kNone;
  std::string materialize_bf16;      // "" = no BF16 copy
  CalibrationSpec calibration;
  EvaluateSpec evaluate;
  VerifySpec verify;
  std::vector<std::string> devices;  // empty = auto
  int64_t host_memory_bytes = 0;     // 0 = unset
  bool overwrite = false;            // a non-empty output directory may be used (output_marker.h)
  // Internal, never from a request or a spec file (quantd.proto's JobSpec has no such field): the
  // allowed roots of the caller that submitted the job, set by the API from its access-config
  // entry ("source_roots" in the stored spec). A symbolic link inside the source is followed only
  // to a file inside one of them (checkpoint/source_roots.h). nullopt (absent, as in specs stored
  // by earlier releases): a caller that may name any path, whose links are followed anywhere.
  std::optional<std::vector<std::string>> source_roots;
  // Internal, never from a request or the stored spec: the built-in recipes' revision
  // (pipeline/recipe.h); a job planned by an earlier release resumes with its own
  // (QuantizeStage::AdaptSpec).
  int recipe_revision = kRecipeRevision;
};

inline constexpr size_t kMaxJobSpecBytes = 256 << 10;
inline constexpr size_t kMaxGlobs = 4096;
inline constexpr size_t kMaxGlobBytes = 1024;

// The validated spec of a request or a spec file; `origin` (a file name,
// "SubmitJobRequest.spec") prefixes errors, which are InvalidArgument naming the field and
// quoting no value. Never sets source_roots.
absl::StatusOr<JobSpec> ValidateJobSpec(const v1::JobSpec& spec, const std::string& origin);
// Every field spelled out, defaults included; ValidateJobSpec(JobSpecToProto(s)) == s but for
// source_roots, which the message has not.
v1::JobSpec JobSpecToProto(const JobSpec& spec);

// A spec file: `json_text` read with protobuf's JSON mapping (the proto's field names or their
// lowerCamelCase, unknown keys refused), not yet validated. Errors name `origin` and the field:
// "spec.json: field 'calibration.seq_len' must be a non-negative integer".
absl::StatusOr<v1::JobSpec> ParseJobSpecJson(const std::string& json_text,
                                             const std::string& origin);
// ParseJobSpecJson then ValidateJobSpec: a spec file as `quantd run` reads it.
absl::StatusOr<JobSpec> ParseJobSpec(const std::string& json_text, const std::string& origin);

// The stored form (canonical JSON: all fields, defaults spelled out, source_roots when set);
// ParseStoredJobSpec(JobSpecToJson(s)) == s.
std::string JobSpecToJson(const JobSpec& spec);
// A stored spec, of this release or an earlier one: a spec file's JSON plus "source_roots".
absl::StatusOr<JobSpec> ParseStoredJobSpec(const std::string& json_text,
                                           const std::string& origin);

const char* RecipeKindName(RecipeKind k);
const char* WeightFormatName(WeightFormat f);
const char* ExpertCastName(ExpertCast c);
const char* ExportFormatName(ExportFormat f);
const char* KvCacheName(KvCache k);
const char* CalibrationModeName(CalibrationMode m);
const char* W2InputName(W2Input w);
const char* ExpertAmaxName(ExpertAmax e);
const char* UncalibratedFillName(UncalibratedFill u);
const char* CalibrationNumericsName(CalibrationNumerics n);

}  // namespace quantd::job

#endif  // QUANTD_SERVER_JOB_JOB_SPEC_H_
