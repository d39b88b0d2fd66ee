#include "server/calibration/calibration_tokens.h"

#include <stdint.h>
#include <string.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "server/base/status_macros.h"
#include "server/calibration/calibration_data.h"
#include "server/checkpoint/atomic_file.h"
#include "server/checkpoint/sha256.h"

namespace quantd::calibration {
namespace {

constexpr char kMagic[8] = {'Q', 'D', 'T', 'O', 'K', 'E', 'N', '1'};
// Largest tokens file read: 2^26 ids (512 samples of 128k tokens).
constexpr uint64_t kMaxTokensFileBytes = uint64_t{1} << 28;

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

absl::Status WriteTokensFile(const std::string& path, const SampleIds& ids) {
  std::string out(kMagic, sizeof(kMagic));
  PutU64(out, ids.size());
  for (const std::vector<int32_t>& s : ids) PutU64(out, s.size());
  for (const std::vector<int32_t>& s : ids) {
    for (int32_t id : s) {
      const uint32_t u = static_cast<uint32_t>(id);
      for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((u >> (8 * i)) & 0xff));
    }
  }
  return checkpoint::WriteFileAtomically(path, out);
}

absl::StatusOr<SampleIds> ReadTokensFile(const std::string& path, const std::string& sha256,
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
  if (in.size() < 16 || memcmp(in.data(), kMagic, sizeof(kMagic)) != 0) {
    return malformed("not a quantd tokens file");
  }
  const uint64_t samples = GetU64(in, 8);
  if (samples > (in.size() - 16) / 8) return malformed("sample count past the end");
  size_t at = 16 + 8 * samples;
  uint64_t total = 0;
  std::vector<uint64_t> lengths;
  for (uint64_t k = 0; k < samples; ++k) {
    lengths.push_back(GetU64(in, 16 + 8 * k));
    if (lengths.back() > in.size()) return malformed("sample length past the end");
    total += lengths.back();
  }
  if (in.size() - at != 4 * total) return malformed("size disagrees with the sample lengths");
  SampleIds ids(samples);
  for (uint64_t k = 0; k < samples; ++k) {
    ids[k].resize(lengths[k]);
    for (uint64_t i = 0; i < lengths[k]; ++i, at += 4) {
      const uint32_t u = static_cast<uint8_t>(in[at]) | static_cast<uint8_t>(in[at + 1]) << 8 |
                         static_cast<uint8_t>(in[at + 2]) << 16 |
                         static_cast<uint32_t>(static_cast<uint8_t>(in[at + 3])) << 24;
      const int32_t id = static_cast<int32_t>(u);
      if (id < 0 || id >= vocab) return malformed("a token id is outside the vocabulary");
      ids[k][i] = id;
    }
  }
  return ids;
}

}  // namespace quantd::calibration
