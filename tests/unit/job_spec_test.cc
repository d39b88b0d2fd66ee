// Job spec parsing: a spec file read with protobuf's JSON mapping into quantd.proto's JobSpec and
// validated (defaults, every enum, a named error for each kind of bad input), and the stored form
// of this release and of every earlier one.
#include "server/job/job_spec.h"

#include <gtest/gtest.h>
#include <stdint.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "server/base/excerpt.h"
#include "server/compute/device_name.h"
#include "server/job/job_paths.h"

namespace quantd::job {
namespace {

std::string ErrorOf(const std::string& json) {
  absl::StatusOr<JobSpec> spec = ParseJobSpec(json, "spec.json");
  EXPECT_FALSE(spec.ok()) << json;
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(spec.status().message());
}

TEST(JobSpecTest, MinimalSpecGetsDefaults) {
  auto spec = ParseJobSpec(R"({"source": "/in", "output": "/out"})", "spec.json");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->recipe, RecipeKind::kExperts);
  EXPECT_EQ(spec->weight_format, WeightFormat::kNvfp4);
  EXPECT_EQ(spec->expert_cast, ExpertCast::kLossless);
  EXPECT_EQ(spec->export_format, ExportFormat::kModelOpt);
  EXPECT_EQ(spec->kv_cache, KvCache::kNone);
  EXPECT_TRUE(spec->devices.empty());
  EXPECT_EQ(spec->host_memory_bytes, 0);
}

TEST(JobSpecTest, EveryFieldParsesAndRoundTrips) {
  const std::string text = R"({"source": "/in", "output": "/out", "recipe": "full",
    "exclude": ["*.wo_b"], "weight_format": "w4a16_nvfp4", "expert_cast": "requantize",
    "export_format": "compressed-tensors", "kv_cache": "fp8_cast", "materialize_bf16": "/bf16",
    "calibration": {"amax_file": "a.json", "num_samples": 1024, "seq_len": 2048,
                    "calibrate_all_experts": true, "dataset": "d.jsonl"},
    "devices": ["cuda:0", "cuda:1"], "host_memory_bytes": 1073741824})";
  auto spec = ParseJobSpec(text, "spec.json");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->recipe, RecipeKind::kFull);
  EXPECT_EQ(spec->exclude, std::vector<std::string>{"*.wo_b"});
  EXPECT_EQ(spec->weight_format, WeightFormat::kW4A16Nvfp4);
  EXPECT_EQ(spec->expert_cast, ExpertCast::kRequantize);
  EXPECT_EQ(spec->export_format, ExportFormat::kCompressedTensors);
  EXPECT_EQ(spec->kv_cache, KvCache::kFp8Cast);
  EXPECT_EQ(spec->materialize_bf16, "/bf16");
  EXPECT_EQ(spec->calibration.num_samples, 1024);
  EXPECT_TRUE(spec->calibration.calibrate_all_experts);
  EXPECT_EQ(spec->devices, (std::vector<std::string>{"cuda:0", "cuda:1"}));
  EXPECT_EQ(spec->host_memory_bytes, 1073741824);

  auto again = ParseStoredJobSpec(JobSpecToJson(*spec), "canonical");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(JobSpecToJson(*again), JobSpecToJson(*spec));
}

// source_roots (the submitter's allowed roots, set by the API): absent means any path and stays
// absent in the canonical spec; an empty list means no root at all and round-trips as such.
TEST(JobSpecTest, SourceRootsAbsentEmptyOrListed) {
  auto spec = ParseJobSpec(R"({"source": "/in", "output": "/out"})", "spec.json");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_FALSE(spec->source_roots.has_value());
  EXPECT_EQ(JobSpecToJson(*spec).find("source_roots"), std::string::npos);
  for (const std::vector<std::string>& roots :
       {std::vector<std::string>{}, std::vector<std::string>{"/models/alice", "/hf"}}) {
    spec->source_roots = roots;
    auto again = ParseStoredJobSpec(JobSpecToJson(*spec), "canonical");
    ASSERT_TRUE(again.ok()) << again.status();
    ASSERT_TRUE(again->source_roots.has_value());
    EXPECT_EQ(*again->source_roots, roots);
  }
  auto bad = ParseStoredJobSpec(R"({"source": "/in", "output": "/out", "source_roots": "/"})", "s");
  EXPECT_EQ(bad.status().message(), "s: field 'source_roots' must be an array of strings");
  bad = ParseStoredJobSpec(R"({"source": "/in", "output": "/out", "source_roots": [""]})", "s");
  EXPECT_EQ(bad.status().message(),
            "s: field 'source_roots' must be an array of non-empty strings");
  // The name in a value is not the key; the key spelled with escapes is not read as it.
  auto named = ParseStoredJobSpec(R"({"source": "/source_roots", "output": "/out"})", "s");
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_FALSE(named->source_roots.has_value());
  bad = ParseStoredJobSpec(R"({"source": "/in", "output": "/out", "source\u005froots": []})", "s");
  EXPECT_EQ(bad.status().message(), "s: field 'source_roots' is not a known field");
  // A caller never sets it: a spec file (or a request: the message has no such field) that
  // names it is refused.
  EXPECT_EQ(ErrorOf(R"({"source": "/in", "output": "/out", "source_roots": ["/"]})"),
            "spec.json: field 'source_roots' is not a known field");
}

TEST(JobSpecTest, IncludeMeansCustomRecipe) {
  auto spec = ParseJobSpec(R"({"source": "a", "output": "b", "include": ["layers.*.ffn.experts.*"]})",
                           "spec.json");
  ASSERT_TRUE(spec.ok());
  EXPECT_EQ(spec->recipe, RecipeKind::kCustom);
  auto again = ParseStoredJobSpec(JobSpecToJson(*spec), "canonical");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->include, spec->include);
}

TEST(JobSpecTest, BadInputNamesTheField) {
  EXPECT_EQ(ErrorOf("[1]"), "spec.json: a job spec must be a JSON object");
  EXPECT_EQ(ErrorOf("{"), "spec.json: not valid JSON");
  EXPECT_EQ(ErrorOf(R"({"output": "b"})"), "spec.json: field 'source' is required");
  EXPECT_EQ(ErrorOf(R"({"source": 3, "output": "b"})"), "spec.json: field 'source' must be a string");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "recipe": "most"})"),
            "spec.json: field 'recipe' must be one of \"experts\", \"full\"");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "recipe": "custom"})"),
            "spec.json: field 'recipe' must be one of \"experts\", \"full\"");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "kv_cache": "fp4"})"),
            "spec.json: field 'kv_cache' must be one of \"none\", \"fp8_cast\", \"fp8\"");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "export_format": "gguf"})"),
            "spec.json: field 'export_format' must be one of \"modelopt\", \"compressed-tensors\"");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "weight_format": 4})"),
            "spec.json: field 'weight_format' must be a string");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "expert_cast": "exact"})"),
            "spec.json: field 'expert_cast' must be one of \"lossless\", \"requantize\"");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "colour": "red"})"),
            "spec.json: field 'colour' is not a known field");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "calibration": {"samples": 3}})"),
            "spec.json: field 'calibration.samples' is not a known field");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "calibration": {"num_samples": -3}})"),
            "spec.json: field 'calibration.num_samples' must be a non-negative integer");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "include": ["x"], "recipe": "full"})"),
            "spec.json: field 'include' cannot be combined with 'recipe'");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "exclude": 5})"),
            "spec.json: field 'exclude' must be an array of strings");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "exclude": ["x", ""]})"),
            "spec.json: field 'exclude' must be an array of non-empty strings");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "devices": ["gpu0"]})"),
            "spec.json: field 'devices' has \"gpu0\"; expected \"cpu\" or \"cuda:N\"");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "devices": ["cuda:100"]})"),
            "spec.json: field 'devices' has \"cuda:100\"; expected \"cpu\" or \"cuda:N\"");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "devices": ["cpu", "cpu"]})"),
            "spec.json: field 'devices' lists \"cpu\" twice");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "host_memory_bytes": 1.5})"),
            "spec.json: field 'host_memory_bytes' must be a non-negative integer");
  // Overlapping directories are refused on their resolved paths (job_paths_test), so that every
  // spelling is caught, not only the identical one.
}

TEST(JobSpecTest, LimitsNameTheFieldAndQuoteNothing) {
  const std::string long_path(kMaxPathBytes + 1, 'p');
  EXPECT_EQ(ErrorOf(R"({"source": ")" + long_path + R"(", "output": "b"})"),
            "spec.json: field 'source': 4096 bytes, longer than the limit of 4095 (PATH_MAX)");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "calibration": {"amax_file": ")" +
                    long_path + R"("}})"),
            "spec.json: field 'calibration.amax_file': 4096 bytes, longer than the limit of "
            "4095 (PATH_MAX)");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "calibration": {"datasets": [{"path": "d"},
                {"path": ")" + long_path + R"("}]}})"),
            "spec.json: field 'calibration.datasets[1].path': 4096 bytes, longer than the limit "
            "of 4095 (PATH_MAX)");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "calibration": {"amax_out": ")" +
                    long_path + R"("}})"),
            "spec.json: field 'calibration.amax_out': 4096 bytes, longer than the limit of "
            "4095 (PATH_MAX)");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "exclude": ["x", ")" +
                    std::string(kMaxGlobBytes + 1, 'g') + R"("]})"),
            "spec.json: field 'exclude' glob 1 is 1025 bytes, more than 1024");
  EXPECT_EQ(ErrorOf(std::string(kMaxJobSpecBytes + 1, ' ')),
            "spec.json: 262145 bytes, more than the limit of 262144 for a job spec");
  auto spec = ParseJobSpec(R"({"source": "a", "output": "b", "overwrite": true})", "spec.json");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_TRUE(spec->overwrite);
  EXPECT_TRUE(ParseStoredJobSpec(JobSpecToJson(*spec), "again")->overwrite);
}

TEST(JobSpecTest, VerifyDeepIsStoredOnlyWhenSet) {
  auto spec = ParseJobSpec(R"({"source": "a", "output": "b", "verify": {"deep": true}})", "s");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_TRUE(spec->verify.deep);
  EXPECT_NE(JobSpecToJson(*spec).find(R"("verify":{"deep":true})"), std::string::npos);
  EXPECT_TRUE(ParseStoredJobSpec(JobSpecToJson(*spec), "again")->verify.deep);
  EXPECT_TRUE(JobSpecToProto(*spec).verify().deep());
  spec = ParseJobSpec(R"({"source": "a", "output": "b"})", "s");
  ASSERT_TRUE(spec.ok());
  EXPECT_FALSE(spec->verify.deep);
  EXPECT_EQ(JobSpecToJson(*spec).find("verify"), std::string::npos);
  EXPECT_EQ(ParseJobSpec(R"({"source": "a", "output": "b", "verify": {"deep": 1}})", "s")
                .status()
                .message(),
            "s: field 'verify.deep' must be true or false");
}

TEST(DeviceNameTest, CpuOrCudaWithOneOrTwoDigits) {
  int index = 7;
  EXPECT_TRUE(compute::ParseDeviceName("cpu", &index));
  EXPECT_EQ(index, -1);
  EXPECT_TRUE(compute::ParseDeviceName("cuda:0", &index));
  EXPECT_EQ(index, 0);
  EXPECT_TRUE(compute::ParseDeviceName("cuda:17", &index));
  EXPECT_EQ(index, 17);
  for (const char* bad : {"", "gpu", "CPU", "cuda", "cuda:", "cuda:100", "cuda:-1", "cuda:+1",
                          "cuda:1a", "cuda: 1", " cpu", "cuda:0 "}) {
    index = 7;
    EXPECT_FALSE(compute::ParseDeviceName(bad, &index)) << bad;
    EXPECT_EQ(index, 7) << bad;
  }
}

TEST(JobSpecCalibrationTest, ExportOptionsDefaultParseAndRoundTrip) {
  auto spec = ParseJobSpec(R"({"source": "/in", "output": "/out"})", "spec.json");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->calibration.mode, CalibrationMode::kData);
  EXPECT_EQ(spec->calibration.w2_input, W2Input::kMax);
  EXPECT_EQ(spec->calibration.expert_amax, ExpertAmax::kPerExpert);
  EXPECT_EQ(spec->calibration.uncalibrated, UncalibratedFill::kLayerMax);
  EXPECT_EQ(spec->calibration.numerics, CalibrationNumerics::kOfficial);
  EXPECT_EQ(spec->calibration.amax_out, "");

  spec = ParseJobSpec(R"({"source": "/in", "output": "/out", "calibration": {
      "mode": "constant", "w2_input": "weighted", "expert_amax": "layer_max",
      "uncalibrated": "model_max", "numerics": "math", "amax_out": "t.json"}})", "spec.json");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->calibration.mode, CalibrationMode::kConstant);
  EXPECT_EQ(spec->calibration.w2_input, W2Input::kWeighted);
  EXPECT_EQ(spec->calibration.expert_amax, ExpertAmax::kLayerMax);
  EXPECT_EQ(spec->calibration.uncalibrated, UncalibratedFill::kModelMax);
  EXPECT_EQ(spec->calibration.numerics, CalibrationNumerics::kMath);
  EXPECT_EQ(spec->calibration.amax_out, "t.json");
  auto again = ParseStoredJobSpec(JobSpecToJson(*spec), "canonical");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(JobSpecToJson(*again), JobSpecToJson(*spec));
  EXPECT_EQ(again->calibration.w2_input, W2Input::kWeighted);

  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "calibration": {"w2_input": "both"}})"),
            "spec.json: field 'calibration.w2_input' must be one of \"unweighted\", \"weighted\", "
            "\"max\"");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "calibration": {"mode": "none"}})"),
            "spec.json: field 'calibration.mode' must be one of \"data\", \"constant\"");
}

TEST(JobSpecCalibrationTest, CheckpointSecondsDefaultValidationAndCanonicalJson) {
  auto spec = ParseJobSpec(R"({"source": "/in", "output": "/out"})", "spec.json");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->calibration.checkpoint_seconds, 300);
  // The default is not written, so the canonical spec of earlier jobs is unchanged.
  EXPECT_EQ(JobSpecToJson(*spec).find("checkpoint_seconds"), std::string::npos);

  spec = ParseJobSpec(R"({"source": "/in", "output": "/out", "calibration": {
      "checkpoint_seconds": 0}})", "spec.json");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->calibration.checkpoint_seconds, 0);
  auto again = ParseStoredJobSpec(JobSpecToJson(*spec), "canonical");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->calibration.checkpoint_seconds, 0);
  EXPECT_EQ(JobSpecToJson(*again), JobSpecToJson(*spec));

  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "calibration": {"checkpoint_seconds": -1}})"),
            "spec.json: field 'calibration.checkpoint_seconds' must be a non-negative integer");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "calibration": {"checkpoint_seconds": 1.5}})"),
            "spec.json: field 'calibration.checkpoint_seconds' must be a non-negative integer");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "calibration": {)"
                    R"("checkpoint_seconds": 31536001}})"),
            "spec.json: field 'calibration.checkpoint_seconds' must be at most 31536000 (a year)");
}

}  // namespace
}  // namespace quantd::job

namespace quantd::job {
namespace {

TEST(JobSpecCalibrationTest, DefaultsAndDatasets) {
  auto spec = ParseJobSpec(R"({"source": "/in", "output": "/out"})", "spec.json");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->calibration.seq_len, 512);
  EXPECT_EQ(spec->calibration.min_seq_len, 16);
  EXPECT_EQ(spec->calibration.seed, 0);
  EXPECT_TRUE(spec->calibration.add_bos);
  EXPECT_TRUE(spec->calibration.datasets.empty());

  spec = ParseJobSpec(R"({"source": "/in", "output": "/out", "calibration": {
      "datasets": [{"path": "news.jsonl", "samples": 512}, {"path": "chat.jsonl"}],
      "num_samples": 64, "seq_len": 1024, "min_seq_len": 32, "seed": 7, "add_bos": false}})",
                      "spec.json");
  ASSERT_TRUE(spec.ok()) << spec.status();
  ASSERT_EQ(spec->calibration.datasets.size(), 2u);
  EXPECT_EQ(spec->calibration.datasets[0].path, "news.jsonl");
  EXPECT_EQ(spec->calibration.datasets[0].samples, 512);
  EXPECT_EQ(spec->calibration.datasets[1].samples, 0);
  EXPECT_EQ(spec->calibration.seq_len, 1024);
  EXPECT_EQ(spec->calibration.min_seq_len, 32);
  EXPECT_EQ(spec->calibration.seed, 7);
  EXPECT_FALSE(spec->calibration.add_bos);
  auto again = ParseStoredJobSpec(JobSpecToJson(*spec), "canonical");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(JobSpecToJson(*again), JobSpecToJson(*spec));
  EXPECT_EQ(again->calibration.datasets[1].path, "chat.jsonl");
}

TEST(JobSpecCalibrationTest, BadCalibrationNamesTheField) {
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "calibration": {"dataset": "x.jsonl",
                        "datasets": [{"path": "y.jsonl"}]}})"),
            "spec.json: field 'calibration.dataset' cannot be combined with 'calibration.datasets'");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "calibration": {"datasets": 5}})"),
            "spec.json: field 'calibration.datasets' must be an array of objects");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "calibration": {"datasets": ["x"]}})"),
            "spec.json: field 'calibration.datasets[0]' must be an object");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "calibration": {"datasets": [{"samples": 3}]}})"),
            "spec.json: field 'calibration.datasets[0].path' is required");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "calibration": {"datasets": [{"path": "x", "n": 3}]}})"),
            "spec.json: field 'calibration.datasets[0].n' is not a known field");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "calibration": {"datasets": [{"path": "x", "samples": -1}]}})"),
            "spec.json: field 'calibration.datasets[0].samples' must be a non-negative integer");
  // 0 is the default (as release 0.1.0 wrote it), not an error.
  absl::StatusOr<JobSpec> zero = ParseJobSpec(
      R"({"source": "a", "output": "b", "calibration": {"seq_len": 0}})", "spec.json");
  ASSERT_TRUE(zero.ok()) << zero.status();
  EXPECT_EQ(zero->calibration.seq_len, 512);
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "calibration": {"seq_len": 8}})"),
            "spec.json: field 'calibration.min_seq_len' must not exceed 'calibration.seq_len'");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "calibration": {"add_bos": 1}})"),
            "spec.json: field 'calibration.add_bos' must be true or false");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "calibration": {"seed": "x"}})"),
            "spec.json: field 'calibration.seed' must be a non-negative integer");
}

TEST(JobSpecEvaluateTest, DefaultsAreUnsetAndLeaveTheCanonicalSpecAlone) {
  auto spec = ParseJobSpec(R"({"source": "/in", "output": "/out"})", "spec.json");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->evaluate.num_samples, 0);
  EXPECT_FALSE(spec->evaluate.gate.max_mean_kl.has_value());
  EXPECT_FALSE(spec->evaluate.gate.min_top1_agreement.has_value());
  EXPECT_FALSE(spec->evaluate.gate.max_ppl_ratio.has_value());
  EXPECT_FALSE(spec->evaluate.enabled.has_value());
  EXPECT_TRUE(spec->evaluate.on());  // a job that calibrates on data evaluates by default
  EXPECT_EQ(JobSpecToJson(*spec).find("evaluate"), std::string::npos);
}

TEST(JobSpecEvaluateTest, EnabledParsesRoundTripsAndRefusesUnusedSettings) {
  auto off = ParseJobSpec(R"({"source": "/in", "output": "/out", "evaluate": {"enabled": false}})",
                          "spec.json");
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_EQ(off->evaluate.enabled, false);
  EXPECT_FALSE(off->evaluate.on());
  auto again = ParseStoredJobSpec(JobSpecToJson(*off), "canonical");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->evaluate.enabled, false);
  EXPECT_EQ(JobSpecToJson(*again), JobSpecToJson(*off));
  auto on = ParseJobSpec(
      R"({"source": "/in", "output": "/out", "evaluate": {"enabled": true, "num_samples": 4}})",
      "spec.json");
  ASSERT_TRUE(on.ok()) << on.status();
  EXPECT_EQ(on->evaluate.enabled, true);
  EXPECT_EQ(ParseStoredJobSpec(JobSpecToJson(*on), "canonical")->evaluate.enabled, true);
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "evaluate": {"enabled": 1}})"),
            "spec.json: field 'evaluate.enabled' must be true or false");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "evaluate": {"enabled": false,
      "num_samples": 4}})"),
            "spec.json: field 'evaluate.enabled' is false: 'evaluate.num_samples' and "
            "'evaluate.gate' would not be used");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "evaluate": {"enabled": false,
      "gate": {"max_mean_kl": 1}}})"),
            "spec.json: field 'evaluate.enabled' is false: 'evaluate.num_samples' and "
            "'evaluate.gate' would not be used");
  // An empty gate sets no bound.
  EXPECT_TRUE(ParseJobSpec(R"({"source": "a", "output": "b", "evaluate": {"enabled": false,
      "gate": {}}})", "spec.json").ok());
}

TEST(JobSpecEvaluateTest, GateParsesAndRoundTrips) {
  auto spec = ParseJobSpec(R"({"source": "/in", "output": "/out", "evaluate": {"num_samples": 8,
      "gate": {"max_mean_kl": 0.05, "min_top1_agreement": 0.9, "max_ppl_ratio": 1.1}}})",
                           "spec.json");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->evaluate.num_samples, 8);
  EXPECT_EQ(spec->evaluate.gate.max_mean_kl, 0.05);
  EXPECT_EQ(spec->evaluate.gate.min_top1_agreement, 0.9);
  EXPECT_EQ(spec->evaluate.gate.max_ppl_ratio, 1.1);
  auto again = ParseStoredJobSpec(JobSpecToJson(*spec), "canonical");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(JobSpecToJson(*again), JobSpecToJson(*spec));
  EXPECT_EQ(again->evaluate.gate.max_ppl_ratio, 1.1);
  // One bound alone.
  auto one = ParseJobSpec(R"({"source": "a", "output": "b", "evaluate": {"gate": {"max_ppl_ratio": 2}}})",
                          "spec.json");
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_FALSE(one->evaluate.gate.max_mean_kl.has_value());
  EXPECT_EQ(one->evaluate.gate.max_ppl_ratio, 2.0);
}

TEST(JobSpecEvaluateTest, BadEvaluateNamesTheField) {
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "evaluate": 3})"),
            "spec.json: field 'evaluate' must be an object");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "evaluate": {"num_samples": -1}})"),
            "spec.json: field 'evaluate.num_samples' must be a non-negative integer");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "evaluate": {"samples": 4}})"),
            "spec.json: field 'evaluate.samples' is not a known field");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "evaluate": {"gate": {"max_kl": 1}}})"),
            "spec.json: field 'evaluate.gate.max_kl' is not a known field");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "evaluate": {"gate": {"max_mean_kl": -1}}})"),
            "spec.json: field 'evaluate.gate.max_mean_kl' must be a number >= 0");
  EXPECT_EQ(
      ErrorOf(R"({"source": "a", "output": "b", "evaluate": {"gate": {"min_top1_agreement": 1.5}}})"),
      "spec.json: field 'evaluate.gate.min_top1_agreement' must be a number >= 0 and <= 1");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "evaluate": {"gate": {"max_ppl_ratio": 0}}})"),
            "spec.json: field 'evaluate.gate.max_ppl_ratio' must be a number > 0");
  const std::string gate = R"({"source": "a", "output": "b", "evaluate": {"gate": )";
  EXPECT_EQ(ErrorOf(gate + R"({"max_ppl_ratio": "x"}}})"),
            "spec.json: field 'evaluate.gate.max_ppl_ratio' must be a number");
  EXPECT_EQ(ErrorOf(gate + R"({"max_ppl_ratio": "NaN"}}})"),
            "spec.json: field 'evaluate.gate.max_ppl_ratio' must be a number > 0");
  EXPECT_EQ(ErrorOf(gate + R"({"max_mean_kl": "Infinity"}}})"),
            "spec.json: field 'evaluate.gate.max_mean_kl' must be a number >= 0");
}

}  // namespace
}  // namespace quantd::job

namespace quantd::job {
namespace {

// The spellings of protobuf's JSON mapping: the proto's names and their lowerCamelCase, every enum
// value, "devices" as "auto" or a list, null as unset.
TEST(JobSpecJsonTest, EverySpellingOfTheMapping) {
  struct Case {
    std::string json;  // the keys after "source" and "output"
    std::function<bool(const JobSpec&)> holds;
  };
  const std::vector<Case> cases = {
      {R"("recipe": "experts")", [](const JobSpec& s) { return s.recipe == RecipeKind::kExperts; }},
      {R"("recipe": "full")", [](const JobSpec& s) { return s.recipe == RecipeKind::kFull; }},
      {R"("recipe": "")", [](const JobSpec& s) { return s.recipe == RecipeKind::kExperts; }},
      {R"("weight_format": "w4a16_nvfp4")",
       [](const JobSpec& s) { return s.weight_format == WeightFormat::kW4A16Nvfp4; }},
      {R"("weightFormat": "w4a16_nvfp4")",
       [](const JobSpec& s) { return s.weight_format == WeightFormat::kW4A16Nvfp4; }},
      {R"("expert_cast": "requantize")",
       [](const JobSpec& s) { return s.expert_cast == ExpertCast::kRequantize; }},
      {R"("export_format": "compressed-tensors")",
       [](const JobSpec& s) { return s.export_format == ExportFormat::kCompressedTensors; }},
      {R"("kv_cache": "fp8")", [](const JobSpec& s) { return s.kv_cache == KvCache::kFp8; }},
      {R"("kv_cache": "fp8_cast")",
       [](const JobSpec& s) { return s.kv_cache == KvCache::kFp8Cast; }},
      {R"("kv_cache": "none")", [](const JobSpec& s) { return s.kv_cache == KvCache::kNone; }},
      {R"("calibration": {"mode": "data", "w2_input": "unweighted", "expert_amax": "per_expert",
          "uncalibrated": "layer_max", "numerics": "official"})",
       [](const JobSpec& s) {
         return s.calibration.mode == CalibrationMode::kData &&
                s.calibration.w2_input == W2Input::kUnweighted &&
                s.calibration.expert_amax == ExpertAmax::kPerExpert &&
                s.calibration.uncalibrated == UncalibratedFill::kLayerMax &&
                s.calibration.numerics == CalibrationNumerics::kOfficial;
       }},
      {R"("calibration": {"w2_input": "max", "numSamples": 7, "minSeqLen": 0, "addBos": false})",
       [](const JobSpec& s) {
         return s.calibration.w2_input == W2Input::kMax && s.calibration.num_samples == 7 &&
                s.calibration.min_seq_len == 0 && !s.calibration.add_bos;
       }},
      {R"("devices": "auto")", [](const JobSpec& s) { return s.devices.empty(); }},
      {R"("devices": ["auto"])", [](const JobSpec& s) { return s.devices.empty(); }},
      {R"("devices": ["cpu", "cuda:3"])",
       [](const JobSpec& s) { return s.devices == std::vector<std::string>{"cpu", "cuda:3"}; }},
      {R"("calibration": null, "evaluate": {"enabled": null}, "devices": null)",
       [](const JobSpec& s) {
         return !s.evaluate.enabled.has_value() && s.devices.empty() &&
                s.calibration.seq_len == 512;
       }},
      {R"("host_memory_bytes": 9223372036854775807)",
       [](const JobSpec& s) { return s.host_memory_bytes == INT64_MAX; }},
  };
  for (const Case& c : cases) {
    const std::string json = R"({"source": "/in", "output": "/out", )" + c.json + "}";
    absl::StatusOr<JobSpec> spec = ParseJobSpec(json, "spec.json");
    ASSERT_TRUE(spec.ok()) << json << ": " << spec.status();
    EXPECT_TRUE(c.holds(*spec)) << json;
  }
}

TEST(JobSpecJsonTest, WrongTypesNameTheField) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"("output": ["b"])", "field 'output' must be a string"},
      {R"("output": {"b": 1})", "field 'output' must be a string"},
      {R"("include": [1])", "field 'include' must be an array of strings"},
      {R"("include": [{}])", "field 'include' must be an array of strings"},
      {R"("devices": {})", "field 'devices' must be an array of strings"},
      {R"("calibration": [])", "field 'calibration' must be an object"},
      {R"("calibration": "x")", "field 'calibration' must be an object"},
      {R"("calibration": {"seq_len": [1]})",
       "field 'calibration.seq_len' must be a non-negative integer"},
      {R"("calibration": {"seq_len": {}})",
       "field 'calibration.seq_len' must be a non-negative integer"},
      {R"("calibration": {"seq_len": 1e30})",
       "field 'calibration.seq_len' must be a non-negative integer"},
      {R"("calibration": {"datasets": [{"path": "/a"}, 7]})",
       "field 'calibration.datasets[1]' must be an object"},
      {R"("calibration": {"datasets": [{"path": "/a"}, {"path": "/b", "samples": "x"}]})",
       "field 'calibration.datasets[1].samples' must be a non-negative integer"},
      {R"("calibration": {"datasets": [{"path": {}}]})",
       "field 'calibration.datasets[0].path' must be a string"},
      {R"("evaluate": {"gate": []})", "field 'evaluate.gate' must be an object"},
      {R"("evaluate": {"gate": {"max_mean_kl": true}})",
       "field 'evaluate.gate.max_mean_kl' must be a number"},
      {R"("overwrite": 1)", "field 'overwrite' must be true or false"},
      {R"("host_memory_bytes": 9223372036854775808)",
       "field 'host_memory_bytes' must be a non-negative integer"},
      {R"("host_memory_bytes": -1)", "field 'host_memory_bytes' must be a non-negative integer"},
  };
  for (const auto& [keys, error] : cases) {
    EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", )" + keys + "}"), "spec.json: " + error)
        << keys;
  }
}

// Errors never quote the spec beyond an excerpt: not a value, not the text around a syntax error,
// and an unknown key only escaped and cut.
TEST(JobSpecJsonTest, ErrorsQuoteNoContent) {
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "calibration": {"seq_len": "secret"}})"),
            "spec.json: field 'calibration.seq_len' must be a non-negative integer");
  EXPECT_EQ(ErrorOf(R"({"source": "secret" "output": "b"})"), "spec.json: not valid JSON");
  EXPECT_EQ(ErrorOf(R"({"source": "a"} {"secret": 1})"), "spec.json: not valid JSON");
  EXPECT_EQ(ErrorOf("{\"source\": \"\xff\xfe\"}"), "spec.json: not valid JSON");
  EXPECT_EQ(ErrorOf(""), "spec.json: not valid JSON");
  EXPECT_EQ(ErrorOf("null"), "spec.json: a job spec must be a JSON object");
  EXPECT_EQ(ErrorOf(R"("secret")"), "spec.json: a job spec must be a JSON object");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "devices": ["gpu0\n"]})"),
            "spec.json: field 'devices' has \"gpu0\\n\"; expected \"cpu\" or \"cuda:N\"");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "calibration": {"x: y'z": 1}})"),
            "spec.json: field 'calibration.x: y\\'z' is not a known field");
  const std::string long_key(1000, 'k');
  EXPECT_EQ(ErrorOf(R"({"source": "a", ")" + long_key + R"(": 1})"),
            "spec.json: field '" + std::string(base::kMaxExcerptBytes, 'k') +
                "...' is not a known field");
  // Deep nesting is refused, not recursed into.
  const size_t depth = 100000;
  EXPECT_EQ(ErrorOf(R"({"source": )" + std::string(depth, '[') + std::string(depth, ']') + "}"),
            "spec.json: field 'source' must be a string");
  EXPECT_EQ(
      ErrorOf(R"({"source": "a", "output": "b", "calibration": {"x": )" + std::string(depth, '[') +
              std::string(depth, ']') + "}}"),
      "spec.json: field 'calibration.x' is not a known field");
}

// A spec of kMaxJobSpecBytes is read; one byte more is refused before it is parsed.
TEST(JobSpecJsonTest, SizeLimit) {
  std::string json = R"({"source": "a", "output": "b"})";
  json.resize(kMaxJobSpecBytes, ' ');
  EXPECT_TRUE(ParseJobSpec(json, "spec.json").ok());
  EXPECT_TRUE(ParseStoredJobSpec(json, "stored").ok());
  json.push_back(' ');
  EXPECT_EQ(ErrorOf(json), "spec.json: 262145 bytes, more than the limit of 262144 for a job spec");
  EXPECT_EQ(ParseStoredJobSpec(json, "stored").status().message(),
            "stored: 262145 bytes, more than the limit of 262144 for a job spec");
}

// What each earlier release stored (its JobSpecToJson, tests/data/upgrade_v1 for the first) reads
// as the spec it meant: every one parses to the struct below.
TEST(StoredJobSpecTest, EveryReleasesStoredFormParsesToTheSameSpec) {
  struct Release {
    const char* what;
    std::string stored;
    std::function<void(JobSpec*)> expected;  // applied to a spec of defaults
  };
  const std::vector<Release> releases = {
      {"schema 1 (tests/data/upgrade_v1, before 4fa55b3): seq_len 0 is the default",
       R"({"calibration":{"amax_file":"","calibrate_all_experts":false,"dataset":"",)"
       R"("num_samples":0,"seq_len":0},"devices":"auto","exclude":[],"expert_cast":"lossless",)"
       R"("export_format":"modelopt","host_memory_bytes":0,"kv_cache":"none",)"
       R"("materialize_bf16":"bf16","output":"out","recipe":"full","source":"src",)"
       R"("weight_format":"w4a16_nvfp4"})",
       [](JobSpec* s) {
         s->source = "src";
         s->output = "out";
         s->materialize_bf16 = "bf16";
         s->recipe = RecipeKind::kFull;
         s->weight_format = WeightFormat::kW4A16Nvfp4;
       }},
      {"f8825a5: overwrite, a custom recipe",
       R"({"calibration":{"amax_file":"","calibrate_all_experts":true,"dataset":"/d.jsonl",)"
       R"("num_samples":64,"seq_len":512},"devices":["cpu"],"exclude":["*.wo_b"],)"
       R"("expert_cast":"requantize","export_format":"compressed-tensors",)"
       R"("host_memory_bytes":1073741824,"include":["layers.*"],"kv_cache":"fp8","output":"/o",)"
       R"("overwrite":true,"source":"/s","weight_format":"nvfp4"})",
       [](JobSpec* s) {
         s->source = "/s";
         s->output = "/o";
         s->recipe = RecipeKind::kCustom;
         s->include = {"layers.*"};
         s->exclude = {"*.wo_b"};
         s->expert_cast = ExpertCast::kRequantize;
         s->export_format = ExportFormat::kCompressedTensors;
         s->kv_cache = KvCache::kFp8;
         s->calibration.calibrate_all_experts = true;
         s->calibration.dataset = "/d.jsonl";
         s->calibration.num_samples = 64;
         s->devices = {"cpu"};
         s->host_memory_bytes = 1073741824;
         s->overwrite = true;
       }},
      {"4fa55b3: calibration datasets, min_seq_len, seed, add_bos",
       R"({"calibration":{"add_bos":false,"amax_file":"","calibrate_all_experts":false,)"
       R"("dataset":"","datasets":[{"path":"/d/a.jsonl","samples":100},{"path":"/d/b.jsonl",)"
       R"("samples":0}],"min_seq_len":8,"num_samples":200,"seed":3,"seq_len":256},)"
       R"("devices":"auto","exclude":[],"expert_cast":"lossless","export_format":"modelopt",)"
       R"("host_memory_bytes":0,"kv_cache":"none","output":"/o","recipe":"experts","source":"/s",)"
       R"("weight_format":"nvfp4"})",
       [](JobSpec* s) {
         s->source = "/s";
         s->output = "/o";
         s->calibration.add_bos = false;
         s->calibration.datasets = {{"/d/a.jsonl", 100}, {"/d/b.jsonl", 0}};
         s->calibration.min_seq_len = 8;
         s->calibration.num_samples = 200;
         s->calibration.seed = 3;
         s->calibration.seq_len = 256;
       }},
      {"0e27f3c: calibration mode, w2_input, expert_amax, uncalibrated, numerics, amax_out",
       R"({"calibration":{"add_bos":true,"amax_file":"/a.json","amax_out":"/t.json",)"
       R"("calibrate_all_experts":false,"dataset":"","expert_amax":"layer_max","min_seq_len":16,)"
       R"("mode":"constant","num_samples":0,"numerics":"math","seed":0,"seq_len":512,)"
       R"("uncalibrated":"model_max","w2_input":"weighted"},"devices":["cuda:0","cuda:1"],)"
       R"("exclude":[],"expert_cast":"lossless","export_format":"modelopt","host_memory_bytes":0,)"
       R"("kv_cache":"fp8_cast","output":"/o","recipe":"experts","source":"/s",)"
       R"("weight_format":"nvfp4"})",
       [](JobSpec* s) {
         s->source = "/s";
         s->output = "/o";
         s->kv_cache = KvCache::kFp8Cast;
         s->calibration.amax_file = "/a.json";
         s->calibration.amax_out = "/t.json";
         s->calibration.expert_amax = ExpertAmax::kLayerMax;
         s->calibration.mode = CalibrationMode::kConstant;
         s->calibration.numerics = CalibrationNumerics::kMath;
         s->calibration.uncalibrated = UncalibratedFill::kModelMax;
         s->calibration.w2_input = W2Input::kWeighted;
         s->devices = {"cuda:0", "cuda:1"};
       }},
      {"864f22a: evaluate num_samples and gate",
       R"({"calibration":{"add_bos":true,"amax_file":"","amax_out":"",)"
       R"("calibrate_all_experts":false,"dataset":"/d.jsonl","expert_amax":"per_expert",)"
       R"("min_seq_len":16,"mode":"data","num_samples":0,"numerics":"official","seed":0,)"
       R"("seq_len":512,"uncalibrated":"layer_max","w2_input":"max"},"devices":"auto",)"
       R"("evaluate":{"gate":{"max_mean_kl":0.05,"min_top1_agreement":0.9},"num_samples":8},)"
       R"("exclude":[],"expert_cast":"lossless","export_format":"modelopt","host_memory_bytes":0,)"
       R"("kv_cache":"none","output":"/o","recipe":"experts","source":"/s",)"
       R"("weight_format":"nvfp4"})",
       [](JobSpec* s) {
         s->source = "/s";
         s->output = "/o";
         s->calibration.dataset = "/d.jsonl";
         s->evaluate.num_samples = 8;
         s->evaluate.gate.max_mean_kl = 0.05;
         s->evaluate.gate.min_top1_agreement = 0.9;
       }},
      {"80acea8: checkpoint_seconds when not 300",
       R"({"calibration":{"add_bos":true,"amax_file":"","amax_out":"",)"
       R"("calibrate_all_experts":false,"checkpoint_seconds":0,"dataset":"/d.jsonl",)"
       R"("expert_amax":"per_expert","min_seq_len":16,"mode":"data","num_samples":0,)"
       R"("numerics":"official","seed":0,"seq_len":512,"uncalibrated":"layer_max",)"
       R"("w2_input":"max"},"devices":"auto","evaluate":{"gate":{"max_ppl_ratio":1.25},)"
       R"("num_samples":0},"exclude":[],"expert_cast":"lossless","export_format":"modelopt",)"
       R"("host_memory_bytes":0,"kv_cache":"none","output":"/o","recipe":"experts","source":"/s",)"
       R"("weight_format":"nvfp4"})",
       [](JobSpec* s) {
         s->source = "/s";
         s->output = "/o";
         s->calibration.dataset = "/d.jsonl";
         s->calibration.checkpoint_seconds = 0;
         s->evaluate.gate.max_ppl_ratio = 1.25;
       }},
      {"b9795f7: evaluate.enabled",
       R"({"calibration":{"add_bos":true,"amax_file":"","amax_out":"",)"
       R"("calibrate_all_experts":false,"dataset":"/d.jsonl","expert_amax":"per_expert",)"
       R"("min_seq_len":16,"mode":"data","num_samples":0,"numerics":"official","seed":0,)"
       R"("seq_len":512,"uncalibrated":"layer_max","w2_input":"max"},"devices":"auto",)"
       R"("evaluate":{"enabled":false,"gate":{},"num_samples":0},"exclude":[],)"
       R"("expert_cast":"lossless","export_format":"modelopt","host_memory_bytes":0,)"
       R"("kv_cache":"none","output":"/o","recipe":"experts","source":"/s",)"
       R"("weight_format":"nvfp4"})",
       [](JobSpec* s) {
         s->source = "/s";
         s->output = "/o";
         s->calibration.dataset = "/d.jsonl";
         s->evaluate.enabled = false;
       }},
      {"ea4d1b3: source_roots",
       R"({"calibration":{"add_bos":true,"amax_file":"","amax_out":"",)"
       R"("calibrate_all_experts":false,"dataset":"","expert_amax":"per_expert","min_seq_len":16,)"
       R"("mode":"data","num_samples":0,"numerics":"official","seed":0,"seq_len":512,)"
       R"("uncalibrated":"layer_max","w2_input":"max"},"devices":"auto","exclude":[],)"
       R"("expert_cast":"lossless","export_format":"modelopt","host_memory_bytes":0,)"
       R"("kv_cache":"none","output":"/o","recipe":"experts","source":"/s",)"
       R"("source_roots":["/models","/hf"],"weight_format":"nvfp4"})",
       [](JobSpec* s) {
         s->source = "/s";
         s->output = "/o";
         s->source_roots = std::vector<std::string>{"/models", "/hf"};
       }},
  };
  for (const Release& r : releases) {
    JobSpec expected;
    r.expected(&expected);
    absl::StatusOr<JobSpec> spec = ParseStoredJobSpec(r.stored, "stored spec");
    ASSERT_TRUE(spec.ok()) << r.what << ": " << spec.status();
    EXPECT_EQ(JobSpecToJson(*spec), JobSpecToJson(expected)) << r.what;
    EXPECT_EQ(spec->source_roots, expected.source_roots) << r.what;
    EXPECT_EQ(spec->evaluate.enabled, expected.evaluate.enabled) << r.what;
    EXPECT_EQ(spec->calibration.checkpoint_seconds, expected.calibration.checkpoint_seconds)
        << r.what;
  }
  // This release's stored form is a fixed point.
  for (const Release& r : releases) {
    absl::StatusOr<JobSpec> spec = ParseStoredJobSpec(r.stored, "stored spec");
    ASSERT_TRUE(spec.ok());
    const std::string canonical = JobSpecToJson(*spec);
    absl::StatusOr<JobSpec> again = ParseStoredJobSpec(canonical, "stored spec");
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(JobSpecToJson(*again), canonical) << r.what;
  }
}

}  // namespace
}  // namespace quantd::job
