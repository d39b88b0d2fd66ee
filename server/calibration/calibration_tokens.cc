#include "server/calibration/calibration_tokens.h"

#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/base/status_macros.h"
#include "server/calibration/calibration_data.h"
#include "server/checkpoint/atomic_file.h"
#include "server/checkpoint/sha256.h"

namespace quantd::calibration {
namespace {

constexpr char kMagic[8] = {'Q', 'D', 'T', 'O', 'K', 'E', 'N', '2'};
constexpr size_t kHeaderBytes = 24;  // the magic and the two counts
// Largest tokens file read: kMaxJobTokens ids, and the header and lengths of as many samples.
constexpr uint64_t kMaxTokensFileBytes = 24 + 12 * static_cast<uint64_t>(kMaxJobTokens);

void PutU64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint64_t GetU64(const std::string& in, size_t at) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(in[at + i]);
  return v;
}

}  // namespace

absl::StatusOr<SampleIds> TokenizeCalibration(const job::JobSpec& spec,
                                              const std::string& tokenizer_dir, int64_t vocab,
                                              bool fold_ids) {
  CalibrationTokenizer tokenizer(tokenizer_dir, spec.source_roots);
  // input_ids are the model's ids: checked against its vocabulary (folded ones fold below).
  ASSIGN_OR_RETURN(CalibrationSet set,
                   LoadCalibrationSet(spec.calibration, spec.source_roots, tokenizer,
                                      fold_ids ? INT32_MAX : vocab));
  SampleIds ids;
  for (CalibrationSample& s : set.samples) {
    for (int32_t& id : s.ids) {
      if (id < vocab) continue;
      if (!fold_ids) {
        return absl::InvalidArgumentError(absl::StrCat(
            s.source, ":", s.line, ": token id ", id, " is outside the model's vocabulary of ",
            vocab, " (the tokenizer in ", tokenizer_dir, " does not match the model)"));
      }
      id = static_cast<int32_t>(id % vocab);
    }
    ids.push_back(std::move(s.ids));
  }
  return ids;
}

int64_t TokenCount(const SampleIds& ids) {
  int64_t tokens = 0;
  for (const std::vector<int32_t>& s : ids) tokens += static_cast<int64_t>(s.size());
  return tokens;
}

TokenBound BoundOf(int64_t samples, int64_t seq_len) {
  TokenBound bound;
  bound.samples = std::clamp<int64_t>(samples, 0, kMaxJobTokens);
  // Both factors at most 2^26: the product cannot overflow.
  bound.tokens = std::min(bound.samples * std::clamp<int64_t>(seq_len, 0, kMaxJobTokens),
                          kMaxJobTokens);
  return bound;
}

absl::StatusOr<TokenBound> CalibrationTokenBound(const job::CalibrationSpec& spec) {
  ASSIGN_OR_RETURN(const std::vector<job::CalibrationDataset> datasets,
                   ResolveCalibrationDatasets(spec));
  int64_t samples = 0;
  for (const job::CalibrationDataset& d : datasets) {
    samples += std::clamp<int64_t>(d.samples, 0, kMaxJobTokens);  // at most 2^26 per file
  }
  return BoundOf(samples, spec.seq_len);
}

absl::Status WriteTokensFile(const std::string& path, const JobTokens& tokens) {
  if (TokenCount(tokens.calibration) + TokenCount(tokens.held_out) > kMaxJobTokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the calibration and held-out samples take more than ", kMaxJobTokens,
        " tokens: lower calibration.num_samples, calibration.seq_len or evaluate.num_samples"));
  }
  std::string out(kMagic, sizeof(kMagic));
  PutU64(out, tokens.calibration.size());
  PutU64(out, tokens.held_out.size());
  for (const SampleIds* set : {&tokens.calibration, &tokens.held_out}) {
    for (const std::vector<int32_t>& s : *set) PutU64(out, s.size());
  }
  for (const SampleIds* set : {&tokens.calibration, &tokens.held_out}) {
    for (const std::vector<int32_t>& s : *set) {
      for (int32_t id : s) {
        const uint32_t u = static_cast<uint32_t>(id);
        for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((u >> (8 * i)) & 0xff));
      }
    }
  }
  return checkpoint::WriteFileAtomically(path, out);
}

absl::StatusOr<JobTokens> ReadTokensFile(const std::string& path, const std::string& sha256,
                                         int64_t vocab) {
  ASSIGN_OR_RETURN(const std::string in, checkpoint::ReadFile(path, kMaxTokensFileBytes));
  checkpoint::Sha256 hash;
  hash.Update(in.data(), in.size());
  if (hash.HexDigest() != sha256) {
    return absl::DataLossError(absl::StrCat("calibration tokens ", path,
                                            " no longer have the recorded SHA-256"));
  }
  const auto malformed = [&path](const char* what) {
    return absl::DataLossError(absl::StrCat("calibration tokens ", path, ": ", what));
  };
  if (in.size() < kHeaderBytes || memcmp(in.data(), kMagic, sizeof(kMagic)) != 0) {
    return malformed("not a quantd tokens file");
  }
  const uint64_t calibration = GetU64(in, 8);
  const uint64_t held_out = GetU64(in, 16);
  const uint64_t room = (in.size() - kHeaderBytes) / 8;
  if (calibration > room || held_out > room - calibration) {
    return malformed("sample count past the end");
  }
  const uint64_t samples = calibration + held_out;
  size_t at = kHeaderBytes + 8 * samples;
  uint64_t total = 0;
  std::vector<uint64_t> lengths;
  for (uint64_t k = 0; k < samples; ++k) {
    lengths.push_back(GetU64(in, kHeaderBytes + 8 * k));
    if (lengths.back() > in.size()) return malformed("sample length past the end");
    total += lengths.back();
  }
  if (in.size() - at != 4 * total) return malformed("size disagrees with the sample lengths");
  JobTokens tokens;
  tokens.calibration.resize(calibration);
  tokens.held_out.resize(held_out);
  for (uint64_t k = 0; k < samples; ++k) {
    std::vector<int32_t>& ids =
        k < calibration ? tokens.calibration[k] : tokens.held_out[k - calibration];
    ids.resize(lengths[k]);
    for (uint64_t i = 0; i < lengths[k]; ++i, at += 4) {
      const uint32_t u = static_cast<uint8_t>(in[at]) | static_cast<uint8_t>(in[at + 1]) << 8 |
                         static_cast<uint8_t>(in[at + 2]) << 16 |
                         static_cast<uint32_t>(static_cast<uint8_t>(in[at + 3])) << 24;
      const int32_t id = static_cast<int32_t>(u);
      if (id < 0 || id >= vocab) return malformed("a token id is outside the vocabulary");
      ids[i] = id;
    }
  }
  return tokens;
}

}  // namespace quantd::calibration
