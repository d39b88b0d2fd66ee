#include "server/calibration/calibration_data.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/base/status_macros.h"
#include "server/checkpoint/atomic_file.h"
#include "server/checkpoint/sha256.h"
#include "server/tokenizer/chat_encoding.h"

namespace quantd::calibration {

using job::CalibrationDataset;
using job::CalibrationSpec;

namespace {

using nlohmann::json;

// SplitMix64 (Steele, Lea, Flood 2014): a fixed, portable generator, so that a seed selects the
// same samples with every compiler and standard library.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n) (n > 0), by rejection.
  uint64_t Below(uint64_t n) {
    const uint64_t limit = UINT64_MAX - UINT64_MAX % n;
    uint64_t x;
    do {
      x = Next();
    } while (x >= limit);
    return x % n;
  }

 private:
  uint64_t state_;  // advanced by every draw
};

// One checked line of a data set.
struct Sample {
  int64_t line = 0;
  enum class Kind { kText, kMessages, kIds } kind = Kind::kText;
  std::string text;                          // kText
  std::vector<tokenizer::ChatMessage> messages;  // kMessages
  std::vector<int32_t> ids;                  // kIds
};

absl::Status LineError(const std::string& path, int64_t line, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ":", line, ": ", what));
}

absl::StatusOr<Sample> ParseSample(const std::string& path, int64_t line_number,
                                   const std::string& line, const tokenizer::Tokenizer& tokenizer) {
  const json value = json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (value.is_discarded()) return LineError(path, line_number, "not valid JSON");
  if (!value.is_object()) return LineError(path, line_number, "not a JSON object");
  Sample sample;
  sample.line = line_number;
  const int fields = value.contains("text") + value.contains("messages") + value.contains("input_ids");
  if (fields == 0) {
    return LineError(path, line_number, "a sample needs one of 'text', 'messages', 'input_ids'");
  }
  if (fields > 1) {
    return LineError(path, line_number, "a sample has only one of 'text', 'messages', 'input_ids'");
  }
  if (auto it = value.find("text"); it != value.end()) {
    if (!it->is_string()) return LineError(path, line_number, "'text' must be a string");
    sample.kind = Sample::Kind::kText;
    sample.text = it->get<std::string>();
  } else if (auto it = value.find("messages"); it != value.end()) {
    absl::StatusOr<std::vector<tokenizer::ChatMessage>> messages =
        tokenizer::ParseChatMessages(*it);
    if (!messages.ok()) return LineError(path, line_number, std::string(messages.status().message()));
    sample.kind = Sample::Kind::kMessages;
    sample.messages = *std::move(messages);
  } else {
    const json& ids = value["input_ids"];
    if (!ids.is_array()) return LineError(path, line_number, "'input_ids' must be an array of token ids");
    sample.kind = Sample::Kind::kIds;
    for (size_t i = 0; i < ids.size(); ++i) {
      const bool integer = ids[i].is_number_integer();
      if (!integer || ids[i].get<int64_t>() < 0 || ids[i].get<int64_t>() > INT32_MAX ||
          !tokenizer.HasToken(static_cast<int32_t>(ids[i].get<int64_t>()))) {
        return LineError(path, line_number,
                         absl::StrCat("input_ids[", i, "] is not a token id of the tokenizer (0 to ",
                                      tokenizer.vocab_size() - 1, ")"));
      }
      sample.ids.push_back(static_cast<int32_t>(ids[i].get<int64_t>()));
    }
  }
  return sample;
}

// The largest dataset JSONL or stored token file read (read whole, so capped).
constexpr uint64_t kMaxCalibrationFileBytes = 1ull << 30;

absl::StatusOr<std::vector<Sample>> ReadDataset(const std::string& path,
                                                const tokenizer::Tokenizer& tokenizer) {
  ASSIGN_OR_RETURN(std::string contents, checkpoint::ReadFile(path, kMaxCalibrationFileBytes));
  std::vector<Sample> samples;
  size_t begin = 0;
  for (int64_t line_number = 1; begin < contents.size(); ++line_number) {
    size_t end = contents.find('\n', begin);
    if (end == std::string::npos) end = contents.size();
    const std::string line = contents.substr(begin, end - begin);
    begin = end + 1;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    ASSIGN_OR_RETURN(Sample sample, ParseSample(path, line_number, line, tokenizer));
    samples.push_back(std::move(sample));
  }
  return samples;
}

absl::StatusOr<std::vector<int32_t>> Tokenize(const Sample& sample, bool add_bos,
                                              const tokenizer::Tokenizer& tokenizer) {
  switch (sample.kind) {
    case Sample::Kind::kIds:
      return sample.ids;
    case Sample::Kind::kMessages:
      return tokenizer.Encode(tokenizer::RenderChat(sample.messages, add_bos));
    case Sample::Kind::kText: {
      ASSIGN_OR_RETURN(std::vector<int32_t> ids, tokenizer.Encode(sample.text));
      if (add_bos) ids.insert(ids.begin(), *tokenizer.bos_id());
      return ids;
    }
  }
  return absl::InternalError("unknown sample kind");
}

}  // namespace

absl::StatusOr<std::vector<CalibrationDataset>> ResolveCalibrationDatasets(const CalibrationSpec& spec) {
  std::vector<CalibrationDataset> datasets = spec.datasets;
  if (!spec.dataset.empty()) datasets.push_back({spec.dataset, 0});
  if (datasets.empty()) {
    return absl::InvalidArgumentError("calibration needs 'calibration.datasets' or 'calibration.dataset'");
  }
  const int64_t total = spec.num_samples > 0 ? spec.num_samples : kDefaultCalibrationSamples;
  const int64_t unset = std::count_if(datasets.begin(), datasets.end(),
                                      [](const CalibrationDataset& d) { return d.samples == 0; });
  int64_t index = 0;
  for (CalibrationDataset& d : datasets) {
    if (d.samples != 0) continue;
    d.samples = total / unset + (index++ < total % unset ? 1 : 0);
    if (d.samples == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "calibration.num_samples (", total, ") is smaller than the number of data sets"));
    }
  }
  return datasets;
}

absl::StatusOr<CalibrationSet> LoadCalibrationSet(const CalibrationSpec& spec,
                                                  const tokenizer::Tokenizer& tokenizer,
                                                  bool allow_fewer) {
  ASSIGN_OR_RETURN(std::vector<CalibrationDataset> datasets, ResolveCalibrationDatasets(spec));
  if (spec.add_bos && !tokenizer.bos_id().has_value()) {
    return absl::InvalidArgumentError(
        "calibration.add_bos needs the tokenizer's bos_token (tokenizer_config.json)");
  }
  // Read and check everything first.
  std::vector<std::vector<Sample>> files;
  for (const CalibrationDataset& d : datasets) {
    ASSIGN_OR_RETURN(std::vector<Sample> samples, ReadDataset(d.path, tokenizer));
    files.push_back(std::move(samples));
  }
  CalibrationSet set;
  for (size_t f = 0; f < datasets.size(); ++f) {
    const CalibrationDataset& d = datasets[f];
    const std::vector<Sample>& samples = files[f];
    CalibrationFileStats stats{d.path, static_cast<int64_t>(samples.size()), d.samples, 0, 0};
    std::vector<size_t> order(samples.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    SplitMix64 rng(static_cast<uint64_t>(spec.seed) ^ (0xD1B54A32D192ED03ull * (f + 1)));
    for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[rng.Below(i)]);
    int64_t taken = 0;
    for (size_t i = 0; i < order.size() && taken < d.samples; ++i) {
      const Sample& sample = samples[order[i]];
      absl::StatusOr<std::vector<int32_t>> ids = Tokenize(sample, spec.add_bos, tokenizer);
      if (!ids.ok()) return LineError(d.path, sample.line, std::string(ids.status().message()));
      if (static_cast<int64_t>(ids->size()) < spec.min_seq_len) {
        ++stats.skipped;
        continue;
      }
      CalibrationSample out{d.path, sample.line, *std::move(ids), false};
      if (static_cast<int64_t>(out.ids.size()) > spec.seq_len) {
        out.ids.resize(spec.seq_len);
        out.truncated = true;
      }
      set.samples.push_back(std::move(out));
      ++taken;
    }
    stats.taken = taken;
    if (taken < d.samples && !allow_fewer) {
      return absl::InvalidArgumentError(absl::StrCat(
          d.path, ": ", taken, " usable samples (at least min_seq_len = ", spec.min_seq_len,
          " tokens) among its ", samples.size(), " lines; ", d.samples, " asked"));
    }
    set.files.push_back(std::move(stats));
  }
  return set;
}

absl::StatusOr<std::string> WriteCalibrationTokens(const CalibrationSet& set, const std::string& path) {
  std::string contents;
  for (const CalibrationSample& s : set.samples) {
    absl::StrAppend(&contents, json({{"source", s.source}, {"line", s.line}, {"input_ids", s.ids}}).dump(),
                    "\n");
  }
  RETURN_IF_ERROR(checkpoint::WriteFileAtomically(path, contents));
  checkpoint::Sha256 sha;
  sha.Update(contents.data(), contents.size());
  return sha.HexDigest();
}

}  // namespace quantd::calibration
