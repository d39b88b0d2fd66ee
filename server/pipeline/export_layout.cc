#include "server/pipeline/export_layout.h"

#include "absl/strings/match.h"

namespace quantd::pipeline {

using checkpoint::ModelArch;
using checkpoint::TensorFormat;
using checkpoint::TensorInventory;

using job::ExportFormat;
using job::JobSpec;

ExportLayout ChooseExportLayout(const JobSpec& spec, const TensorInventory& inventory,
                                const nlohmann::json& source_config,
                                const std::set<std::string>& quantized_modules) {
  if (spec.export_format == ExportFormat::kCompressedTensors) {
    return ExportLayout::kCompressedTensors;
  }
  bool experts_only = !quantized_modules.empty();
  for (const std::string& m : quantized_modules) {
    experts_only = experts_only && absl::StrContains(m, ".ffn.experts.");
  }
  const auto qc = source_config.find("quantization_config");
  const bool fp8_source = qc != source_config.end() && qc->is_object() &&
                          qc->contains("quant_method") && (*qc)["quant_method"] == "fp8";
  if (inventory.arch == ModelArch::kDeepseekV4 && experts_only && fp8_source) {
    return ExportLayout::kModelOptMixed;
  }
  return ExportLayout::kModelOpt;
}

bool KeepsSourceQuantization(ExportLayout layout) {
  return layout == ExportLayout::kModelOptMixed;
}

bool IsBlockQuantizedFormat(TensorFormat format) {
  return format == TensorFormat::kFp8BlockE8m0 || format == TensorFormat::kFp8BlockF32 ||
         format == TensorFormat::kMxfp4;
}

}  // namespace quantd::pipeline
