// quantd.proto's JobSpec against the validated struct: every key survives JSON -> struct -> proto
// -> struct (the daemon's GetJob shows what `quantd run` would run), and a request's spec is
// validated by ValidateJobSpec with the messages a spec file gets.
#include <gtest/gtest.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "google/protobuf/util/message_differencer.h"
#include "server/job/job_spec.h"

namespace quantd::job {
namespace {

absl::StatusOr<JobSpec> FromProto(const v1::JobSpec& spec) {
  return ValidateJobSpec(spec, "SubmitJobRequest.spec");
}

// Every calibration key set to a value other than its default.
constexpr char kFullSpec[] = R"({
  "source": "/models/v4", "output": "/out/v4-nvfp4", "recipe": "full", "exclude": ["head"],
  "weight_format": "nvfp4", "expert_cast": "requantize", "export_format": "compressed-tensors",
  "kv_cache": "fp8_cast", "materialize_bf16": "/out/bf16",
  "calibration": {"amax_file": "/cal/in.json",
                  "datasets": [{"path": "/cal/news.jsonl", "samples": 300},
                               {"path": "/cal/chat.jsonl", "samples": 0}],
                  "num_samples": 600, "seq_len": 1024, "min_seq_len": 0, "seed": 7,
                  "add_bos": false, "calibrate_all_experts": true, "mode": "constant",
                  "w2_input": "weighted", "expert_amax": "layer_max", "uncalibrated": "model_max",
                  "numerics": "math", "amax_out": "/cal/out.json", "checkpoint_seconds": 0},
  "devices": ["cpu"], "host_memory_bytes": 4096, "overwrite": true})";

TEST(JobProtoTest, EveryKeySurvivesJsonToProtoToJson) {
  absl::StatusOr<JobSpec> parsed = ParseJobSpec(kFullSpec, "spec.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  const std::string canonical = JobSpecToJson(*parsed);

  const v1::JobSpec proto = JobSpecToProto(*parsed);
  const v1::CalibrationSpec& c = proto.calibration();
  EXPECT_EQ(c.amax_file(), "/cal/in.json");
  EXPECT_EQ(c.dataset(), "");
  ASSERT_EQ(c.datasets_size(), 2);
  EXPECT_EQ(c.datasets(0).path(), "/cal/news.jsonl");
  EXPECT_EQ(c.datasets(0).samples(), 300);
  EXPECT_EQ(c.datasets(1).path(), "/cal/chat.jsonl");
  EXPECT_EQ(c.datasets(1).samples(), 0);
  EXPECT_EQ(c.num_samples(), 600);
  EXPECT_EQ(c.seq_len(), 1024);
  ASSERT_TRUE(c.has_min_seq_len());
  EXPECT_EQ(c.min_seq_len(), 0);
  EXPECT_EQ(c.seed(), 7);
  ASSERT_TRUE(c.has_add_bos());
  EXPECT_FALSE(c.add_bos());
  EXPECT_TRUE(c.calibrate_all_experts());
  EXPECT_EQ(c.mode(), "constant");
  EXPECT_EQ(c.w2_input(), "weighted");
  EXPECT_EQ(c.expert_amax(), "layer_max");
  EXPECT_EQ(c.uncalibrated(), "model_max");
  EXPECT_EQ(c.numerics(), "math");
  EXPECT_EQ(c.amax_out(), "/cal/out.json");
  ASSERT_TRUE(c.has_checkpoint_seconds());
  EXPECT_EQ(c.checkpoint_seconds(), 0);

  absl::StatusOr<JobSpec> back = FromProto(proto);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(JobSpecToJson(*back), canonical);
}

TEST(JobProtoTest, DefaultsSurviveTheRoundTrip) {
  absl::StatusOr<JobSpec> parsed =
      ParseJobSpec(R"({"source": "/s", "output": "/o"})", "spec.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  const v1::JobSpec proto = JobSpecToProto(*parsed);
  // The defaults are spelled out, the optional ones with their has-bit set.
  EXPECT_EQ(proto.calibration().min_seq_len(), 16);
  EXPECT_TRUE(proto.calibration().add_bos());
  EXPECT_EQ(proto.calibration().seq_len(), 512);
  EXPECT_EQ(proto.calibration().mode(), "data");
  EXPECT_EQ(proto.calibration().w2_input(), "max");
  EXPECT_EQ(proto.calibration().expert_amax(), "per_expert");
  EXPECT_EQ(proto.calibration().uncalibrated(), "layer_max");
  EXPECT_EQ(proto.calibration().numerics(), "official");
  EXPECT_TRUE(proto.calibration().has_checkpoint_seconds());
  EXPECT_EQ(proto.calibration().checkpoint_seconds(), 300);
  absl::StatusOr<JobSpec> back = FromProto(proto);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(JobSpecToJson(*back), JobSpecToJson(*parsed));

  // A request that leaves every calibration field unset gets the JSON spec's defaults.
  v1::JobSpec request;
  request.set_source("/s");
  request.set_output("/o");
  request.mutable_calibration();
  back = FromProto(request);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(JobSpecToJson(*back), JobSpecToJson(*parsed));
}

// A spec file is the message in protobuf's JSON mapping: the request below, key for key.
TEST(JobProtoTest, SpecFileIsTheMessagesJsonMapping) {
  v1::JobSpec request;
  request.set_source("/s");
  request.set_output("/o");
  v1::CalibrationSpec* c = request.mutable_calibration();
  v1::CalibrationDataset* d = c->add_datasets();
  d->set_path("/cal/a.jsonl");
  d->set_samples(8);
  c->set_min_seq_len(4);
  c->set_seed(3);
  c->set_add_bos(true);
  c->set_w2_input("unweighted");
  c->set_amax_out("/cal/out.json");
  absl::StatusOr<v1::JobSpec> file = ParseJobSpecJson(R"({"source": "/s", "output": "/o",
      "calibration": {"datasets": [{"path": "/cal/a.jsonl", "samples": 8}], "min_seq_len": 4,
                      "seed": 3, "add_bos": true, "w2_input": "unweighted",
                      "amax_out": "/cal/out.json"}})",
                                                      "spec.json");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(*file, request))
      << file->ShortDebugString();
}

TEST(JobProtoTest, EvaluateGateKeepsSetAndUnsetBoundsApart) {
  // min_top1_agreement 0 is a bound that is set (and always holds); max_ppl_ratio is unset.
  absl::StatusOr<JobSpec> parsed = ParseJobSpec(
      R"({"source": "/s", "output": "/o", "evaluate": {"num_samples": 8,
          "gate": {"max_mean_kl": 0.05, "min_top1_agreement": 0}}})",
      "spec.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  const v1::JobSpec proto = JobSpecToProto(*parsed);
  const v1::EvaluateSpec& e = proto.evaluate();
  EXPECT_FALSE(e.has_enabled());
  EXPECT_EQ(e.num_samples(), 8);
  ASSERT_TRUE(e.gate().has_max_mean_kl());
  EXPECT_EQ(e.gate().max_mean_kl(), 0.05);
  ASSERT_TRUE(e.gate().has_min_top1_agreement());
  EXPECT_EQ(e.gate().min_top1_agreement(), 0.0);
  EXPECT_FALSE(e.gate().has_max_ppl_ratio());

  absl::StatusOr<JobSpec> back = FromProto(proto);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->evaluate.gate.max_mean_kl, 0.05);
  EXPECT_EQ(back->evaluate.gate.min_top1_agreement, 0.0);
  EXPECT_FALSE(back->evaluate.gate.max_ppl_ratio.has_value());
  EXPECT_EQ(JobSpecToJson(*back), JobSpecToJson(*parsed));

  // A spec without "evaluate" comes back with nothing set in it.
  parsed = ParseJobSpec(R"({"source": "/s", "output": "/o"})", "spec.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  back = FromProto(JobSpecToProto(*parsed));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_FALSE(back->evaluate.set());
}

TEST(JobProtoTest, EvaluateEnabledIsWrittenOnlyWhenSet) {
  JobSpec spec;
  spec.source = "/s";
  spec.output = "/o";
  EXPECT_FALSE(JobSpecToProto(spec).evaluate().has_enabled());
  spec.evaluate.enabled = false;
  const v1::JobSpec proto = JobSpecToProto(spec);
  ASSERT_TRUE(proto.evaluate().has_enabled());
  EXPECT_FALSE(proto.evaluate().enabled());
}

TEST(JobProtoTest, RequestErrorsNameTheCalibrationField) {
  struct Case {
    std::function<void(v1::CalibrationSpec*)> set;
    std::string error;  // after "SubmitJobRequest.spec: "
  };
  const std::vector<Case> cases = {
      {[](v1::CalibrationSpec* c) { c->set_mode("fast"); },
       R"(field 'calibration.mode' must be one of "data", "constant")"},
      {[](v1::CalibrationSpec* c) { c->set_w2_input("both"); },
       R"(field 'calibration.w2_input' must be one of "unweighted", "weighted", "max")"},
      {[](v1::CalibrationSpec* c) { c->set_expert_amax("max"); },
       R"(field 'calibration.expert_amax' must be one of "per_expert", "layer_max")"},
      {[](v1::CalibrationSpec* c) { c->set_uncalibrated("zero"); },
       R"(field 'calibration.uncalibrated' must be one of "layer_max", "model_max")"},
      {[](v1::CalibrationSpec* c) { c->set_numerics("fp64"); },
       R"(field 'calibration.numerics' must be one of "official", "math")"},
      {[](v1::CalibrationSpec* c) { c->set_seed(-1); },
       "field 'calibration.seed' must be a non-negative integer"},
      {[](v1::CalibrationSpec* c) { c->set_min_seq_len(-2); },
       "field 'calibration.min_seq_len' must be a non-negative integer"},
      {[](v1::CalibrationSpec* c) { c->set_min_seq_len(600); },
       "field 'calibration.min_seq_len' must not exceed 'calibration.seq_len'"},
      {[](v1::CalibrationSpec* c) { c->add_datasets()->set_samples(3); },
       "field 'calibration.datasets[0].path' is required"},
      {[](v1::CalibrationSpec* c) {
         c->add_datasets()->set_path("/a.jsonl");
         v1::CalibrationDataset* d = c->add_datasets();
         d->set_path("/b.jsonl");
         d->set_samples(-5);
       },
       "field 'calibration.datasets[1].samples' must be a non-negative integer"},
      {[](v1::CalibrationSpec* c) {
         c->set_dataset("/a.jsonl");
         c->add_datasets()->set_path("/b.jsonl");
       },
       "field 'calibration.dataset' cannot be combined with 'calibration.datasets'"},
  };
  for (const Case& c : cases) {
    v1::JobSpec request;
    request.set_source("/s");
    request.set_output("/o");
    c.set(request.mutable_calibration());
    absl::StatusOr<JobSpec> spec = FromProto(request);
    ASSERT_FALSE(spec.ok()) << c.error;
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(spec.status().message(), absl::StrCat("SubmitJobRequest.spec: ", c.error));
  }
}

}  // namespace
}  // namespace quantd::job
