// The inspect stage (`quantd inspect`): a summary of any Hugging Face safetensors checkpoint.
//
// JSON report (stable keys; byte counts are integers):
//   dir           string   the directory as given
//   model_type    string   config.json model_type ("" when absent)
//   arch          string   "deepseek_v4" | "deepseek_v3" | "unknown"
//   shards        array    {name, bytes (file size), tensors (count)}, in file-name order
//   tensors       int      number of tensors
//   tensor_bytes  int      bytes of tensor data (what the index's total_size counts)
//   file_bytes    int      bytes of all shard files, headers included
//   by_dtype      object   safetensors dtype ("BF16", "F8_E4M3", ...) -> {tensors, bytes}
//   by_format     object   detected format (checkpoint::FormatName) -> {tensors, bytes};
//                          scale tensors count under "scale"
//   linear_modules object  weight format -> number of linear modules (2-D weights) in it
//   recipes       object   "experts" and "full" -> {modules, bytes, fusion_groups,
//                          excluded: {reason -> modules}}, or {error: string} when the recipe
//                          does not apply to this checkpoint
#ifndef QUANTD_SERVER_PIPELINE_INSPECT_H_
#define QUANTD_SERVER_PIPELINE_INSPECT_H_

#include <string>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace quantd::pipeline {

// Fails with NotFound when `dir` is not a directory or holds neither config.json nor a
// .safetensors file, and with the reader's or the inventory's error for a broken checkpoint.
absl::StatusOr<nlohmann::json> InspectCheckpoint(const std::string& dir);

// The report as aligned text tables.
std::string FormatInspectReport(const nlohmann::json& report);

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_INSPECT_H_
