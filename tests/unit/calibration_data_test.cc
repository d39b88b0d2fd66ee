// Calibration data sets: selection (deterministic by seed, min/max length, per-file counts),
// BOS and chat rendering, the written token file, and a named error for each kind of bad input.
#include "server/calibration/calibration_data.h"

#include <gtest/gtest.h>

#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"
#include "server/checkpoint/atomic_file.h"
#include "server/checkpoint/sha256.h"
#include "server/tokenizer/chat_encoding.h"
#include "tests/unit/test_dirs.h"

namespace quantd::calibration {

using job::CalibrationDataset;
using job::CalibrationSpec;

namespace {

using Ids = std::vector<int32_t>;

class CalibrationDataTest : public testing_util::TempDirTest {
 protected:
  static void SetUpTestSuite() {
    auto loaded = tokenizer::Tokenizer::LoadDir(std::string(QUANTD_SOURCE_DIR) +
                                                "/tests/data/deepseek_v3_tokenizer");
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    tokenizer_ = loaded->release();
  }
  static void TearDownTestSuite() { delete tokenizer_; }

  std::string Write(const std::string& name, const std::string& contents) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path) << contents;
    return path;
  }

  // `n` text lines "sample K: ..." long enough for min_seq_len 16.
  std::string TextFile(const std::string& name, int n) {
    std::string contents;
    for (int i = 0; i < n; ++i) {
      contents += "{\"text\": \"sample " + std::to_string(i) +
                  ": the quick brown fox jumps over the lazy dog and runs far away\"}\n";
    }
    return Write(name, contents);
  }

  CalibrationSpec Spec(std::vector<CalibrationDataset> datasets) {
    CalibrationSpec spec;
    spec.datasets = std::move(datasets);
    return spec;
  }

  std::string ErrorOf(const CalibrationSpec& spec) {
    absl::StatusOr<CalibrationSet> set = LoadCalibrationSet(spec, *tokenizer_);
    EXPECT_FALSE(set.ok());
    EXPECT_EQ(set.status().code(), absl::StatusCode::kInvalidArgument);
    return std::string(set.status().message());
  }

  static const tokenizer::Tokenizer* tokenizer_;
};
const tokenizer::Tokenizer* CalibrationDataTest::tokenizer_ = nullptr;

TEST_F(CalibrationDataTest, TextGetsBosAndIsTruncatedNeverPadded) {
  const std::string path = Write("a.jsonl", R"({"text": "Hello world"})" "\n");
  CalibrationSpec spec = Spec({{path, 1}});
  spec.min_seq_len = 1;
  absl::StatusOr<CalibrationSet> set = LoadCalibrationSet(spec, *tokenizer_);
  ASSERT_TRUE(set.ok()) << set.status();
  ASSERT_EQ(set->samples.size(), 1u);
  EXPECT_EQ(set->samples[0].ids, (Ids{0, 19923, 2058}));
  EXPECT_EQ(set->samples[0].line, 1);
  EXPECT_FALSE(set->samples[0].truncated);

  spec.seq_len = 2;
  set = LoadCalibrationSet(spec, *tokenizer_);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->samples[0].ids, (Ids{0, 19923}));
  EXPECT_TRUE(set->samples[0].truncated);

  spec.add_bos = false;
  spec.seq_len = 512;
  set = LoadCalibrationSet(spec, *tokenizer_);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->samples[0].ids, (Ids{19923, 2058}));
}

TEST_F(CalibrationDataTest, MessagesAreRenderedAndIdsTakenAsIs) {
  const std::string path = Write("chat.jsonl",
                                 R"({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "hello"}, {"role": "assistant", "content": "Hi"}]})"
                                 "\n\n"
                                 R"({"input_ids": [5, 6, 7], "source": "ignored"})" "\n");
  CalibrationSpec spec = Spec({{path, 2}});
  spec.min_seq_len = 3;
  absl::StatusOr<CalibrationSet> set = LoadCalibrationSet(spec, *tokenizer_);
  ASSERT_TRUE(set.ok()) << set.status();
  ASSERT_EQ(set->samples.size(), 2u);
  for (const CalibrationSample& s : set->samples) {
    if (s.line == 1) {
      EXPECT_EQ(s.ids, (Ids{0, 53, 128803, 33310, 128804, 1718, 37947, 32, 23166, 1}));
    } else {
      EXPECT_EQ(s.line, 3);  // the blank line 2 is skipped but counted
      EXPECT_EQ(s.ids, (Ids{5, 6, 7}));
    }
  }
  EXPECT_EQ(set->files[0].lines, 2);
}

TEST_F(CalibrationDataTest, SelectionIsDeterministicBySeedAndSplitsNumSamples) {
  const std::string a = TextFile("a.jsonl", 40);
  const std::string b = TextFile("b.jsonl", 40);
  CalibrationSpec spec = Spec({{a, 0}, {b, 0}});
  spec.num_samples = 5;  // 3 from a, 2 from b
  auto lines = [&](const CalibrationSpec& s) {
    absl::StatusOr<CalibrationSet> set = LoadCalibrationSet(s, *tokenizer_);
    EXPECT_TRUE(set.ok()) << set.status();
    std::vector<std::string> out;
    for (const CalibrationSample& sample : set->samples) {
      out.push_back(sample.source.substr(sample.source.size() - 7) + ":" + std::to_string(sample.line));
    }
    return out;
  };
  const std::vector<std::string> first = lines(spec);
  ASSERT_EQ(first.size(), 5u);
  EXPECT_EQ(std::count_if(first.begin(), first.end(), [](const std::string& s) { return s[0] == 'a'; }), 3);
  EXPECT_EQ(lines(spec), first);
  spec.seed = 1;
  EXPECT_NE(lines(spec), first);
  // The generator is fixed (SplitMix64 driving a Fisher-Yates shuffle), so the selection is the
  // same on every platform; these lines come from an independent Python implementation of both.
  EXPECT_EQ(lines(spec), (std::vector<std::string>{"a.jsonl:31", "a.jsonl:36", "a.jsonl:33", "b.jsonl:28", "b.jsonl:39"}));
  EXPECT_EQ(first, (std::vector<std::string>{"a.jsonl:2", "a.jsonl:17", "a.jsonl:38", "b.jsonl:21", "b.jsonl:31"}));
}

TEST_F(CalibrationDataTest, ShortSamplesAreSkipped) {
  const std::string path = Write("mixed.jsonl", "{\"text\": \"tiny\"}\n{\"text\": \"also tiny\"}\n" +
                                                    std::string("{\"text\": \"one two three four five six seven "
                                                                "eight nine ten eleven twelve thirteen fourteen "
                                                                "fifteen sixteen\"}\n"));
  CalibrationSpec spec = Spec({{path, 1}});
  absl::StatusOr<CalibrationSet> set = LoadCalibrationSet(spec, *tokenizer_);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->samples[0].line, 3);
  spec.datasets[0].samples = 2;
  EXPECT_EQ(ErrorOf(spec), path + ": 1 usable samples (at least min_seq_len = 16 tokens) among its 3 lines; 2 asked");
}

TEST_F(CalibrationDataTest, BadInputNamesFileAndLine) {
  const std::string good = "{\"text\": \"fine\"}\n";
  absl::StatusOr<CalibrationSet> missing = LoadCalibrationSet(Spec({{dir_ + "/missing.jsonl", 1}}), *tokenizer_);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(missing.status().message(), dir_ + "/missing.jsonl: cannot open: No such file or directory");
  std::string path = Write("notjson.jsonl", good + "{\"text\": \n");
  EXPECT_EQ(ErrorOf(Spec({{path, 1}})), path + ":2: not valid JSON");
  path = Write("array.jsonl", good + "[1, 2]\n");
  EXPECT_EQ(ErrorOf(Spec({{path, 1}})), path + ":2: not a JSON object");
  path = Write("none.jsonl", good + good + "{\"prompt\": \"x\"}\n");
  EXPECT_EQ(ErrorOf(Spec({{path, 1}})), path + ":3: a sample needs one of 'text', 'messages', 'input_ids'");
  path = Write("two.jsonl", "{\"text\": \"x\", \"input_ids\": [1]}\n");
  EXPECT_EQ(ErrorOf(Spec({{path, 1}})), path + ":1: a sample has only one of 'text', 'messages', 'input_ids'");
  path = Write("vocab.jsonl", good + "{\"input_ids\": [1, 2, 128815]}\n");
  EXPECT_EQ(ErrorOf(Spec({{path, 1}})),
            path + ":2: input_ids[2] is not a token id of the tokenizer (0 to 128814)");
  path = Write("negative.jsonl", "{\"input_ids\": [-1]}\n");
  EXPECT_EQ(ErrorOf(Spec({{path, 1}})),
            path + ":1: input_ids[0] is not a token id of the tokenizer (0 to 128814)");
  path = Write("texttype.jsonl", "{\"text\": 5}\n");
  EXPECT_EQ(ErrorOf(Spec({{path, 1}})), path + ":1: 'text' must be a string");
  path = Write("chat.jsonl", "{\"messages\": [{\"role\": \"bot\", \"content\": \"x\"}]}\n");
  EXPECT_EQ(ErrorOf(Spec({{path, 1}})),
            path + ":1: messages[0].role must be \"system\", \"user\" or \"assistant\"");
  // Errors in any file come before any sample is taken, even from a file listed later.
  const std::string ok = TextFile("ok.jsonl", 3);
  path = Write("late.jsonl", good + "oops\n");
  EXPECT_EQ(ErrorOf(Spec({{ok, 1}, {path, 1}})), path + ":2: not valid JSON");
  EXPECT_EQ(ErrorOf(CalibrationSpec{}), "calibration needs 'calibration.datasets' or 'calibration.dataset'");
}

TEST_F(CalibrationDataTest, ShorthandDatasetTakesNumSamples) {
  CalibrationSpec spec;
  spec.dataset = TextFile("one.jsonl", 10);
  spec.num_samples = 7;
  absl::StatusOr<std::vector<CalibrationDataset>> datasets = ResolveCalibrationDatasets(spec);
  ASSERT_TRUE(datasets.ok());
  ASSERT_EQ(datasets->size(), 1u);
  EXPECT_EQ((*datasets)[0].samples, 7);
  spec.num_samples = 0;
  EXPECT_EQ((*ResolveCalibrationDatasets(spec))[0].samples, kDefaultCalibrationSamples);
}

TEST_F(CalibrationDataTest, WrittenTokensAreADataSetWithTheirChecksum) {
  CalibrationSpec spec = Spec({{TextFile("a.jsonl", 6), 4}});
  absl::StatusOr<CalibrationSet> set = LoadCalibrationSet(spec, *tokenizer_);
  ASSERT_TRUE(set.ok()) << set.status();
  const std::string path = dir_ + "/calibration_tokens.jsonl";
  absl::StatusOr<std::string> sha = WriteCalibrationTokens(*set, path);
  ASSERT_TRUE(sha.ok()) << sha.status();
  EXPECT_EQ(*sha, *checkpoint::Sha256File(path));
  absl::StatusOr<std::string> text = checkpoint::ReadFile(path, 1 << 20);
  ASSERT_TRUE(text.ok()) << text.status();
  const std::vector<std::string> lines = absl::StrSplit(*text, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 4u);
  for (size_t i = 0; i < lines.size(); ++i) {
    const nlohmann::json sample = nlohmann::json::parse(lines[i]);
    EXPECT_EQ(sample.at("source").get<std::string>(), set->samples[i].source);
    EXPECT_EQ(sample.at("line").get<int64_t>(), set->samples[i].line);
    EXPECT_EQ(sample.at("input_ids").get<std::vector<int32_t>>(), set->samples[i].ids);
  }
  // The stored file is itself a data set of input_ids samples.
  CalibrationSpec again = Spec({{path, 4}});
  again.seq_len = 4096;
  EXPECT_TRUE(LoadCalibrationSet(again, *tokenizer_).ok());
}

TEST_F(CalibrationDataTest, BuiltInExampleDataIsUsable) {
  CalibrationSpec spec = Spec({{std::string(QUANTD_SOURCE_DIR) + "/tests/data/calibration_sample.jsonl", 44}});
  absl::StatusOr<CalibrationSet> set = LoadCalibrationSet(spec, *tokenizer_);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->samples.size(), 44u);
  std::set<int64_t> lines;
  for (const CalibrationSample& s : set->samples) lines.insert(s.line);
  EXPECT_EQ(lines.size(), 44u);
}

}  // namespace
}  // namespace quantd::calibration
