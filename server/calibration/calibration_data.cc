#include "server/calibration/calibration_data.h"

#include <errno.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "server/base/status_macros.h"
#include "server/base/thread_budget.h"
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
  std::string text;                              // kText
  std::vector<tokenizer::ChatMessage> messages;  // kMessages
  std::vector<int32_t> ids;                      // kIds
};

absl::Status LineError(const std::string& path, int64_t line, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ":", line, ": ", what));
}

absl::StatusOr<Sample> ParseSample(const std::string& path, int64_t line_number,
                                   absl::string_view line, int64_t vocab) {
  const json value = json::parse(line.begin(), line.end(), nullptr, /*allow_exceptions=*/false);
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
      if (!ids[i].is_number_integer() || ids[i].get<int64_t>() < 0 || ids[i].get<int64_t>() >= vocab) {
        return LineError(path, line_number,
                         absl::StrCat("input_ids[", i, "] is not a token id of the model (0 to ",
                                      vocab - 1, ")"));
      }
      sample.ids.push_back(static_cast<int32_t>(ids[i].get<int64_t>()));
    }
  }
  return sample;
}

// Where a non-blank line of a data set is: the index pass keeps these, 16 bytes a line.
struct LineRef {
  uint64_t offset;
  uint32_t bytes;
  uint32_t line;  // 1-based
};

// A data set file, open for the whole load (so both passes read the same file), indexed.
struct DatasetFile {
  std::string path;
  int fd = -1;
  std::vector<LineRef> lines;

  DatasetFile() = default;
  DatasetFile(const DatasetFile&) = delete;
  DatasetFile& operator=(const DatasetFile&) = delete;
  DatasetFile(DatasetFile&& o) noexcept : path(std::move(o.path)), fd(o.fd), lines(std::move(o.lines)) {
    o.fd = -1;
  }
  ~DatasetFile() {
    if (fd >= 0) close(fd);
  }
};

// What the job has read so far, against its budgets.
struct Budget {
  uint64_t bytes = 0;
  int64_t lines = 0;
};

absl::Status ReadError(const std::string& path, int err) {
  return absl::Status(absl::ErrnoToStatusCode(err),
                      absl::StrCat(path, ": read failed: ", strerror(err)));
}

// Streams `file` in chunks, checking every non-blank line and indexing it.
absl::Status IndexDataset(DatasetFile& file, int64_t vocab, Budget& budget) {
  const std::string& path = file.path;
  const auto over_bytes = [&] {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": the job's calibration data sets exceed ", kMaxCalibrationBytes,
        " bytes together (calibration.datasets)"));
  };
  std::string pending;  // the current line's bytes so far
  uint64_t line_offset = 0, offset = 0;
  int64_t line_number = 1;
  std::vector<char> buffer(1 << 20);
  const auto finish_line = [&]() -> absl::Status {
    const int64_t number = line_number++;
    const uint64_t at = line_offset;
    line_offset = offset;
    if (pending.find_first_not_of(" \t\r") == std::string::npos) {
      pending.clear();
      return absl::OkStatus();
    }
    if (++budget.lines > kMaxCalibrationLines) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ":", number, ": the job's calibration data sets exceed ", kMaxCalibrationLines,
          " lines together (calibration.datasets)"));
    }
    RETURN_IF_ERROR(ParseSample(path, number, pending, vocab).status());
    file.lines.push_back({at, static_cast<uint32_t>(pending.size()), static_cast<uint32_t>(number)});
    pending.clear();
    return absl::OkStatus();
  };
  while (true) {
    const ssize_t n = read(file.fd, buffer.data(), buffer.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ReadError(path, errno);
    if (n == 0) break;
    budget.bytes += static_cast<uint64_t>(n);
    if (budget.bytes > kMaxCalibrationBytes) return over_bytes();
    for (const char* p = buffer.data(), *end = p + n; p < end;) {
      const char* newline = static_cast<const char*>(memchr(p, '\n', end - p));
      const char* stop = newline ? newline : end;
      if (pending.size() + (stop - p) > kMaxCalibrationLineBytes) {
        return LineError(path, line_number,
                         absl::StrCat("longer than ", kMaxCalibrationLineBytes, " bytes"));
      }
      pending.append(p, stop);
      offset += static_cast<uint64_t>(stop - p);
      p = stop;
      if (newline != nullptr) {
        ++offset;
        ++p;
        RETURN_IF_ERROR(finish_line());
      }
    }
  }
  if (!pending.empty()) RETURN_IF_ERROR(finish_line());
  return absl::OkStatus();
}

// Reads the indexed line again and parses it.
absl::StatusOr<Sample> ReadSample(const DatasetFile& file, const LineRef& ref, int64_t vocab) {
  std::string line(ref.bytes, '\0');
  size_t done = 0;
  while (done < line.size()) {
    const ssize_t n = pread(file.fd, line.data() + done, line.size() - done,
                            static_cast<off_t>(ref.offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ReadError(file.path, errno);
    if (n == 0) return LineError(file.path, ref.line, "the file changed while it was read");
    done += static_cast<size_t>(n);
  }
  absl::StatusOr<Sample> sample = ParseSample(file.path, ref.line, line, vocab);
  if (!sample.ok()) {
    return LineError(file.path, ref.line, "the file changed while it was read");
  }
  return sample;
}

// The ids of a text or conversation sample.
absl::StatusOr<std::vector<int32_t>> Tokenize(const Sample& sample, bool add_bos,
                                              const tokenizer::Tokenizer& tokenizer) {
  if (sample.kind == Sample::Kind::kMessages) {
    return tokenizer.Encode(tokenizer::RenderChat(sample.messages, add_bos));
  }
  ASSIGN_OR_RETURN(std::vector<int32_t> ids, tokenizer.Encode(sample.text));
  if (add_bos) ids.insert(ids.begin(), *tokenizer.bos_id());
  return ids;
}

// The spec's name of data set `index` of ResolveCalibrationDatasets, for errors.
std::string DatasetField(const CalibrationSpec& spec, size_t index) {
  return index < spec.datasets.size() ? absl::StrCat("calibration.datasets[", index, "].path")
                                      : std::string("calibration.dataset");
}

}  // namespace

absl::StatusOr<const tokenizer::Tokenizer*> CalibrationTokenizer::Get() {
  if (tokenizer_ != nullptr) return tokenizer_;
  if (!error_.ok()) return error_;
  absl::StatusOr<std::unique_ptr<tokenizer::Tokenizer>> loaded = tokenizer::Tokenizer::LoadDir(dir_, roots_);
  if (!loaded.ok()) {
    error_ = loaded.status();
    return error_;
  }
  owned_ = *std::move(loaded);
  tokenizer_ = owned_.get();
  return tokenizer_;
}

absl::StatusOr<std::vector<CalibrationDataset>> ResolveCalibrationDatasets(const CalibrationSpec& spec) {
  std::vector<CalibrationDataset> datasets = spec.datasets;
  if (!spec.dataset.empty()) datasets.push_back({spec.dataset, 0});
  if (datasets.empty()) {
    return absl::InvalidArgumentError("calibration needs 'calibration.datasets' or 'calibration.dataset'");
  }
  for (size_t i = 0; i < datasets.size(); ++i) {
    const std::filesystem::path normal = std::filesystem::path(datasets[i].path).lexically_normal();
    for (size_t j = 0; j < i; ++j) {
      if (std::filesystem::path(datasets[j].path).lexically_normal() == normal) {
        return absl::InvalidArgumentError(absl::StrCat(
            DatasetField(spec, i), " names the file of ", DatasetField(spec, j),
            " again: list a data set once, with the samples it gives"));
      }
    }
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
                                                  const checkpoint::SourceRoots& roots,
                                                  CalibrationTokenizer& tokenizer, int64_t vocab,
                                                  bool allow_fewer) {
  ASSIGN_OR_RETURN(std::vector<CalibrationDataset> datasets, ResolveCalibrationDatasets(spec));
  // Open, index and check every file first; the same file by another path is refused.
  std::vector<DatasetFile> files;
  std::vector<std::pair<dev_t, ino_t>> ids;
  Budget budget;
  for (size_t f = 0; f < datasets.size(); ++f) {
    DatasetFile file;
    file.path = datasets[f].path;
    struct stat st;
    ASSIGN_OR_RETURN(file.fd, checkpoint::OpenRegularFile(file.path, /*follow_symlink=*/true, &st,
                                                          roots, DatasetField(spec, f)));
    const auto same = std::find(ids.begin(), ids.end(), std::make_pair(st.st_dev, st.st_ino));
    if (same != ids.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          DatasetField(spec, f), " is the file of ", DatasetField(spec, same - ids.begin()),
          " by another path: list a data set once, with the samples it gives"));
    }
    ids.emplace_back(st.st_dev, st.st_ino);
    RETURN_IF_ERROR(IndexDataset(file, vocab, budget));
    files.push_back(std::move(file));
  }
  CalibrationSet set;
  for (size_t f = 0; f < datasets.size(); ++f) {
    const CalibrationDataset& d = datasets[f];
    const std::vector<LineRef>& lines = files[f].lines;
    CalibrationFileStats stats{d.path, static_cast<int64_t>(lines.size()), d.samples, 0, 0};
    std::vector<uint32_t> order(lines.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<uint32_t>(i);
    SplitMix64 rng(static_cast<uint64_t>(spec.seed) ^ (0xD1B54A32D192ED03ull * (f + 1)));
    for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[rng.Below(i)]);
    int64_t taken = 0;
    for (size_t i = 0; i < order.size() && taken < d.samples; ++i) {
      // A cancelled or late planning stops between samples (base/thread_budget.h; a Status
      // here, not an exception).
      if (base::ThreadBudgetPoll() != base::BudgetLimit::kNone) {
        return absl::CancelledError(absl::StrCat(d.path, ": tokenization stopped"));
      }
      ASSIGN_OR_RETURN(const Sample sample, ReadSample(files[f], lines[order[i]], vocab));
      absl::StatusOr<std::vector<int32_t>> ids = sample.ids;
      if (sample.kind != Sample::Kind::kIds) {
        ASSIGN_OR_RETURN(const tokenizer::Tokenizer* t, tokenizer.Get());
        if (spec.add_bos && !t->bos_id().has_value()) {
          return absl::InvalidArgumentError(
              "calibration.add_bos needs the tokenizer's bos_token (tokenizer_config.json)");
        }
        ids = Tokenize(sample, spec.add_bos, *t);
      }
      if (!ids.ok()) {
        return absl::Status(ids.status().code(),
                            absl::StrCat(d.path, ":", sample.line, ": ", ids.status().message()));
      }
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
          " tokens) among its ", lines.size(), " lines; ", d.samples, " asked"));
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
