// The job spec of `quantctl submit`: an optional --spec file (the JSON of `quantd run`, read into
// quantd.proto's JobSpec by job::ParseJobSpecJson) with the spec flags set over it in the same
// message. Only keys and JSON types are checked here; the daemon validates the values (and names
// the field when one is wrong).
#ifndef QUANTD_CLIENT_SPEC_FLAGS_H_
#define QUANTD_CLIENT_SPEC_FLAGS_H_

#include <stdint.h>

#include <optional>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/statusor.h"
#include "quantd/v1/quantd.pb.h"

namespace quantd::client {

// The submit flags; a flag that was not given leaves the spec file's value.
struct SpecFlags {
  std::string spec_file;                            // --spec; "" = none
  std::optional<std::string> source;                // --source
  std::optional<std::string> output;                // --output
  std::optional<std::string> recipe;                // --recipe
  std::optional<std::vector<std::string>> include;  // --include, repeatable
  std::optional<std::vector<std::string>> exclude;  // --exclude, repeatable
  std::optional<std::string> weight_format;         // --weight-format
  std::optional<std::string> expert_cast;           // --expert-cast
  std::optional<std::string> export_format;         // --export-format
  std::optional<std::string> kv_cache;              // --kv-cache
  std::optional<std::string> materialize_bf16;      // --materialize-bf16
  std::optional<std::string> amax_file;             // --amax-file
  std::optional<std::string> dataset;               // --dataset
  std::optional<int64_t> num_samples;               // --num-samples
  std::optional<int64_t> seq_len;                   // --seq-len
  bool calibrate_all_experts = false;               // --calibrate-all-experts (sets true)
  // --calibration-dataset PATH[:SAMPLES], repeatable: replaces calibration.datasets.
  std::optional<std::vector<std::string>> calibration_datasets;
  std::optional<int64_t> min_seq_len;               // --min-seq-len
  std::optional<int64_t> seed;                      // --seed
  bool no_bos = false;                              // --no-bos (sets add_bos false)
  std::optional<std::string> calibration_mode;      // --calibration-mode
  std::optional<std::string> w2_input;              // --w2-input
  std::optional<std::string> expert_amax;           // --expert-amax
  std::optional<std::string> uncalibrated;          // --uncalibrated
  std::optional<std::string> numerics;              // --numerics
  std::optional<std::string> amax_out;              // --amax-out
  std::optional<std::vector<std::string>> devices;  // --device, repeatable
  std::optional<int64_t> host_memory_bytes;         // --host-memory-bytes
  bool overwrite = false;                           // --overwrite (sets true)
  std::optional<int64_t> eval_samples;              // --eval-samples, >= 0
  bool no_evaluate = false;                         // --no-evaluate (sets evaluate.enabled false)
  std::optional<double> gate_max_kl;                // --gate-max-kl, >= 0
  std::optional<double> gate_min_top1;              // --gate-min-top1, in [0, 1]
  std::optional<double> gate_max_ppl_ratio;         // --gate-max-ppl-ratio, > 0
};

// Registers the flags above on `cmd`; `flags` must outlive the parse.
void AddSpecFlags(CLI::App* cmd, SpecFlags* flags);

// One --calibration-dataset value: PATH, or PATH:SAMPLES when the text after the last ':' is a
// decimal number (a path that itself ends so goes in a --spec file). InvalidArgument for a count
// beyond int64.
absl::StatusOr<v1::CalibrationDataset> ParseDatasetFlag(const std::string& value);

// The --spec file (if any) with the given flags merged over it. Relative paths (source, output,
// materialize_bf16 and the calibration's amax_file, dataset, datasets[*].path, amax_out) become
// absolute against the current directory, since the daemon runs elsewhere. InvalidArgument when
// the file cannot be read or parsed, when source or output is missing, or when an evaluate flag
// is out of its range or contradicts --no-evaluate (the message names the flag).
absl::StatusOr<v1::JobSpec> BuildSpec(const SpecFlags& flags);

}  // namespace quantd::client

#endif  // QUANTD_CLIENT_SPEC_FLAGS_H_
