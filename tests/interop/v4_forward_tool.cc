// quantd_v4_forward_tool: runs quantd's DeepSeek-V4 forward layer by layer on a checkpoint, the
// way calibration does (LoadLayer / RunLayer / release), for the oracle test
// tests/interop/test_v4_forward.py.
//
//   quantd_v4_forward_tool --checkpoint DIR --ids IDS --out OUT [--numerics math|official]
//                          [--spill DIR] [--threads N]
//
// IDS: safetensors with "input_ids" I32/I64 [sequences, seq_len]. OUT: safetensors with
// "layers.N" F32 [sequences, seq_len, hc, hidden] (every layer's output streams), "hidden" F32
// [sequences, seq_len, hidden] (norm(hc_head(.))) and "logits" F32 [sequences, seq_len, vocab];
// OUT.amax.json: max |x| of every linear's input ({"module": amax}, experts as
// "layers.N.ffn.experts.E.wK") and of every KV cache the observer sees. With --spill, the
// activations between layers go through a file in DIR (SpillActivations / ReadActivations).
#include <stdio.h>
#include <string.h>

#include <cmath>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "server/base/status_macros.h"
#include "server/checkpoint/safetensors_reader.h"
#include "server/checkpoint/safetensors_writer.h"
#include "server/compute/device.h"
#include "server/model/v4_layer.h"

namespace quantd {
namespace {

using model::V4Activations;

// max |x| per module name.
class AmaxObserver final : public model::Observer {
 public:
  void OnLinearInput(const model::LinearInput& in) override {
    float& m = amax_[*in.module];
    for (int64_t r = 0; r < in.rows; ++r) {
      for (int64_t c = 0; c < in.cols; ++c) m = std::max(m, std::fabs(in.x[r * in.ld + c]));
    }
  }
  void OnKvCache(const model::KvCacheInput& in) override {
    float& m = amax_[*in.module];
    for (int64_t i = 0; i < in.rows * in.cols; ++i) m = std::max(m, std::fabs(in.kv[i]));
  }
  const std::map<std::string, float>& amax() const { return amax_; }

 private:
  std::map<std::string, float> amax_;  // module -> max |input| so far
};

absl::StatusOr<std::vector<int32_t>> ReadIds(const std::string& path, int64_t* sequences,
                                             int64_t* seq_len) {
  ASSIGN_OR_RETURN(auto file, checkpoint::SafetensorsFile::Open(path));
  const checkpoint::TensorView* t = file->Find("input_ids");
  if (t == nullptr || t->shape.size() != 2 ||
      (t->dtype != checkpoint::Dtype::kI64 && t->dtype != checkpoint::Dtype::kI32)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": tensor input_ids must be I32/I64 [sequences, seq_len]"));
  }
  *sequences = t->shape[0];
  *seq_len = t->shape[1];
  std::vector<int32_t> ids(static_cast<size_t>(t->numel()));
  for (size_t i = 0; i < ids.size(); ++i) {
    if (t->dtype == checkpoint::Dtype::kI64) {
      int64_t v;
      memcpy(&v, t->data + 8 * i, 8);
      ids[i] = static_cast<int32_t>(v);
    } else {
      memcpy(&ids[i], t->data + 4 * i, 4);
    }
  }
  return ids;
}

absl::Status Run(const std::string& checkpoint_dir, const std::string& ids_path,
                 const std::string& out_path, const std::string& numerics,
                 const std::string& spill_dir, int threads) {
  ASSIGN_OR_RETURN(auto ckpt, model::OpenV4Checkpoint(checkpoint_dir));
  const model::V4Config& config = ckpt->config;
  ASSIGN_OR_RETURN(auto device, compute::OpenDevice("cpu", {.cpu_threads = threads}));
  AmaxObserver observer;
  ASSIGN_OR_RETURN(
      model::ForwardContext ctx,
      model::MakeForwardContext(
          *device, numerics == "math" ? model::Numerics::kMath : model::Numerics::kOfficial,
          &observer));
  int64_t sequences = 0, seq_len = 0;
  ASSIGN_OR_RETURN(std::vector<int32_t> ids, ReadIds(ids_path, &sequences, &seq_len));
  ASSIGN_OR_RETURN(V4Activations acts, model::Embed(*ckpt, std::move(ids), sequences, seq_len));

  const int64_t layers = config.num_hidden_layers;
  std::vector<checkpoint::TensorSpec> specs;
  for (int64_t l = 0; l < layers; ++l) {
    specs.push_back({absl::StrCat("layers.", l),
                     checkpoint::Dtype::kF32,
                     {sequences, seq_len, config.hc_mult, config.hidden_size}});
  }
  specs.push_back({"hidden", checkpoint::Dtype::kF32, {sequences, seq_len, config.hidden_size}});
  specs.push_back({"logits", checkpoint::Dtype::kF32, {sequences, seq_len, config.vocab_size}});
  ASSIGN_OR_RETURN(auto writer, checkpoint::SafetensorsWriter::Create(out_path, specs));

  for (int64_t l = 0; l < layers; ++l) {
    ASSIGN_OR_RETURN(model::V4LayerWeights weights, model::LoadLayer(*ckpt, l, *device));
    ASSIGN_OR_RETURN(acts, model::RunLayer(ctx, config, weights, acts));
    RETURN_IF_ERROR(writer->WriteTensor(absl::StrCat("layers.", l), acts.streams.data(),
                                        acts.streams.size() * 4));
    if (!spill_dir.empty()) {
      const std::string path = absl::StrCat(spill_dir, "/activations.", l, ".safetensors");
      RETURN_IF_ERROR(model::SpillActivations(acts, path));
      ASSIGN_OR_RETURN(acts, model::ReadActivations(path));
    }
  }
  ASSIGN_OR_RETURN(model::V4HeadWeights head, model::LoadHead(*ckpt, *device));
  std::vector<float> hidden, logits;
  RETURN_IF_ERROR(model::HeadForward(ctx, config, head, acts, &hidden, &logits));
  RETURN_IF_ERROR(writer->WriteTensor("hidden", hidden.data(), hidden.size() * 4));
  RETURN_IF_ERROR(writer->WriteTensor("logits", logits.data(), logits.size() * 4));
  RETURN_IF_ERROR(writer->Finish());

  nlohmann::json amax = nlohmann::json::object();
  for (const auto& [module, value] : observer.amax()) amax[module] = value;
  std::ofstream f(out_path + ".amax.json");
  f << amax.dump(1);
  if (!f.good())
    return absl::UnavailableError(absl::StrCat("cannot write ", out_path, ".amax.json"));
  return absl::OkStatus();
}

}  // namespace
}  // namespace quantd

int main(int argc, char** argv) {
  CLI::App app{"quantd's DeepSeek-V4 forward, layer by layer, for the interop oracle"};
  std::string checkpoint_dir, ids, out, numerics = "official", spill;
  int threads = 0;
  app.add_option("--checkpoint", checkpoint_dir, "DeepSeek-V4 checkpoint directory")->required();
  app.add_option("--ids", ids, "safetensors with input_ids [sequences, seq_len]")->required();
  app.add_option("--out", out, "output safetensors")->required();
  app.add_option("--numerics", numerics, "official or math")
      ->check(CLI::IsMember({"official", "math"}));
  app.add_option("--spill", spill, "spill activations between layers into this directory");
  app.add_option("--threads", threads, "CPU threads (0: all)");
  CLI11_PARSE(app, argc, argv);
  const absl::Status s = quantd::Run(checkpoint_dir, ids, out, numerics, spill, threads);
  if (!s.ok()) {
    fprintf(stderr, "quantd_v4_forward_tool: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
