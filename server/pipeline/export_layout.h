// ExportLayout: which checkpoint layout a job writes, decided once from the spec, the source and
// the recipe's modules, and shared by the planner (which tensors the quantize stage writes) and
// the export stage (which configs describe them). Layouts and their sources: export_stage.cc.
#ifndef QUANTD_SERVER_PIPELINE_EXPORT_LAYOUT_H_
#define QUANTD_SERVER_PIPELINE_EXPORT_LAYOUT_H_

#include <set>
#include <string>

#include "nlohmann/json.hpp"
#include "server/checkpoint/tensor_inventory.h"
#include "server/job/job_spec.h"

namespace quantd::pipeline {

enum class ExportLayout { kModelOpt, kModelOptMixed, kCompressedTensors };

// modelopt-mixed when a DeepSeek-V4 source with an FP8 quantization_config gets only routed
// experts as NVFP4 and the spec asks for ModelOpt; compressed-tensors when the spec asks for it;
// plain modelopt otherwise.
ExportLayout ChooseExportLayout(const job::JobSpec& spec,
                                const checkpoint::TensorInventory& inventory,
                                const nlohmann::json& source_config,
                                const std::set<std::string>& quantized_modules);

// Whether linear modules the recipe leaves alone keep their FP8 / MXFP4 source format. Only the
// mixed layout describes them (its config keeps the source's FP8 quantization_config); in the
// other layouts readers take every module outside the NVFP4 config as unquantized, so the
// quantize stage writes those modules' weights decoded to BF16 and drops their scales, as
// NVIDIA's own DeepSeek-V3 NVFP4 checkpoints do.
bool KeepsSourceQuantization(ExportLayout layout);

// True for the source formats that KeepsSourceQuantization == false turns into BF16.
bool IsBlockQuantizedFormat(checkpoint::TensorFormat format);

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_EXPORT_LAYOUT_H_
