// Job spec parsing: defaults, every enum, and a named error for each kind of bad input.
#include "server/job/job_spec.h"

#include <gtest/gtest.h>

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

  auto again = ParseJobSpec(JobSpecToJson(*spec), "canonical");
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
    auto again = ParseJobSpec(JobSpecToJson(*spec), "canonical");
    ASSERT_TRUE(again.ok()) << again.status();
    ASSERT_TRUE(again->source_roots.has_value());
    EXPECT_EQ(*again->source_roots, roots);
  }
  auto bad = ParseJobSpec(R"({"source": "/in", "output": "/out", "source_roots": "/"})", "s");
  EXPECT_EQ(bad.status().message(), "s: field 'source_roots' must be an array of strings");
}

TEST(JobSpecTest, IncludeMeansCustomRecipe) {
  auto spec = ParseJobSpec(R"({"source": "a", "output": "b", "include": ["layers.*.ffn.experts.*"]})",
                           "spec.json");
  ASSERT_TRUE(spec.ok());
  EXPECT_EQ(spec->recipe, RecipeKind::kCustom);
  auto again = ParseJobSpec(JobSpecToJson(*spec), "canonical");
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
            "spec.json: field 'weight_format' must be one of \"nvfp4\", \"w4a16_nvfp4\"");
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
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "exclude": "x"})"),
            "spec.json: field 'exclude' must be an array of strings");
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
  EXPECT_TRUE(ParseJobSpec(JobSpecToJson(*spec), "again")->overwrite);
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
  auto again = ParseJobSpec(JobSpecToJson(*spec), "canonical");
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
  auto again = ParseJobSpec(JobSpecToJson(*spec), "canonical");
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
  auto again = ParseJobSpec(JobSpecToJson(*spec), "canonical");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(JobSpecToJson(*again), JobSpecToJson(*spec));
  EXPECT_EQ(again->calibration.datasets[1].path, "chat.jsonl");
}

TEST(JobSpecCalibrationTest, BadCalibrationNamesTheField) {
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "calibration": {"dataset": "x.jsonl",
                        "datasets": [{"path": "y.jsonl"}]}})"),
            "spec.json: field 'calibration.dataset' cannot be combined with 'calibration.datasets'");
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "calibration": {"datasets": []}})"),
            "spec.json: field 'calibration.datasets' must be a non-empty array of {\"path\": ..., \"samples\": N}");
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
  auto again = ParseJobSpec(JobSpecToJson(*off), "canonical");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->evaluate.enabled, false);
  EXPECT_EQ(JobSpecToJson(*again), JobSpecToJson(*off));
  auto on = ParseJobSpec(
      R"({"source": "/in", "output": "/out", "evaluate": {"enabled": true, "num_samples": 4}})",
      "spec.json");
  ASSERT_TRUE(on.ok()) << on.status();
  EXPECT_EQ(on->evaluate.enabled, true);
  EXPECT_EQ(ParseJobSpec(JobSpecToJson(*on), "canonical")->evaluate.enabled, true);
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "evaluate": {"enabled": "no"}})"),
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
  auto again = ParseJobSpec(JobSpecToJson(*spec), "canonical");
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
  EXPECT_EQ(ErrorOf(R"({"source": "a", "output": "b", "evaluate": {"gate": {"max_ppl_ratio": "1"}}})"),
            "spec.json: field 'evaluate.gate.max_ppl_ratio' must be a number > 0");
}

}  // namespace
}  // namespace quantd::job
