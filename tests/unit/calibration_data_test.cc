// Calibration data sets: selection (deterministic by seed, min/max length, per-file counts),
// BOS and chat rendering, the written token file, and a named error for each kind of bad input.
#include "server/calibration/calibration_data.h"

#include <gtest/gtest.h>

#include <atomic>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <unistd.h>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"
#include "server/base/thread_budget.h"
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

  // DeepSeek-V3's model vocabulary (config.json vocab_size): its tokenizer has ids to 128814.
  static constexpr int64_t kVocab = 129280;

  absl::StatusOr<CalibrationSet> Load(const CalibrationSpec& spec) {
    CalibrationTokenizer tokenizer(*tokenizer_);
    return LoadCalibrationSet(spec, std::nullopt, tokenizer, kVocab);
  }

  std::string ErrorOf(const CalibrationSpec& spec) {
    absl::StatusOr<CalibrationSet> set = Load(spec);
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
  absl::StatusOr<CalibrationSet> set = Load(spec);
  ASSERT_TRUE(set.ok()) << set.status();
  ASSERT_EQ(set->samples.size(), 1u);
  EXPECT_EQ(set->samples[0].ids, (Ids{0, 19923, 2058}));
  EXPECT_EQ(set->samples[0].line, 1);
  EXPECT_FALSE(set->samples[0].truncated);

  spec.seq_len = 2;
  set = Load(spec);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->samples[0].ids, (Ids{0, 19923}));
  EXPECT_TRUE(set->samples[0].truncated);

  spec.add_bos = false;
  spec.seq_len = 512;
  set = Load(spec);
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
  absl::StatusOr<CalibrationSet> set = Load(spec);
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
    absl::StatusOr<CalibrationSet> set = Load(s);
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

// A cancelled (or late) planning stops between samples: the thread's budget is polled before
// each one is tokenized (base/thread_budget.h).
TEST_F(CalibrationDataTest, ACancelledBudgetStopsTokenization) {
  const std::string path = TextFile("text.jsonl", 4);
  const std::atomic<bool> cancelled{true};
  absl::StatusOr<CalibrationSet> set;
  {
    base::ScopedThreadBudget budget(base::ThreadBudgetLimits{.cancelled = &cancelled});
    set = Load(Spec({{path, 2}}));
  }
  EXPECT_EQ(set.status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(set.status().message(), path + ": tokenization stopped");
}

TEST_F(CalibrationDataTest, ShortSamplesAreSkipped) {
  const std::string path = Write("mixed.jsonl", "{\"text\": \"tiny\"}\n{\"text\": \"also tiny\"}\n" +
                                                    std::string("{\"text\": \"one two three four five six seven "
                                                                "eight nine ten eleven twelve thirteen fourteen "
                                                                "fifteen sixteen\"}\n"));
  CalibrationSpec spec = Spec({{path, 1}});
  absl::StatusOr<CalibrationSet> set = Load(spec);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->samples[0].line, 3);
  spec.datasets[0].samples = 2;
  EXPECT_EQ(ErrorOf(spec), path + ": 1 usable samples (at least min_seq_len = 16 tokens) among its 3 lines; 2 asked");
}

TEST_F(CalibrationDataTest, BadInputNamesFileAndLine) {
  const std::string good = "{\"text\": \"fine\"}\n";
  absl::StatusOr<CalibrationSet> missing = Load(Spec({{dir_ + "/missing.jsonl", 1}}));
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
  path = Write("vocab.jsonl", good + "{\"input_ids\": [1, 2, 129280]}\n");
  EXPECT_EQ(ErrorOf(Spec({{path, 1}})),
            path + ":2: input_ids[2] is not a token id of the model (0 to 129279)");
  path = Write("negative.jsonl", "{\"input_ids\": [-1]}\n");
  EXPECT_EQ(ErrorOf(Spec({{path, 1}})),
            path + ":1: input_ids[0] is not a token id of the model (0 to 129279)");
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

// Issue 19 item 3: input_ids are the model's ids and need no tokenizer.json.
TEST_F(CalibrationDataTest, InputIdsNeedNoTokenizerAndTakeTheModelsIds) {
  // 128815..129279 have no token in the tokenizer but rows in the model's embedding.
  const std::string path = Write("ids.jsonl", "{\"input_ids\": [0, 128815, 129279]}\n{\"input_ids\": [7, 8, 9]}\n");
  CalibrationSpec spec = Spec({{path, 2}});
  spec.min_seq_len = 3;
  CalibrationTokenizer absent(dir_ + "/no-model");
  absl::StatusOr<CalibrationSet> set = LoadCalibrationSet(spec, std::nullopt, absent, kVocab);
  ASSERT_TRUE(set.ok()) << set.status();
  ASSERT_EQ(set->samples.size(), 2u);
  EXPECT_EQ(set->samples[0].ids.size() + set->samples[1].ids.size(), 6u);
  // add_bos applies to text only: ids-only data needs no bos_token either.
  EXPECT_TRUE(spec.add_bos);
  // A selected text sample does need the tokenizer: its error names the missing file.
  const std::string mixed = Write("mixed.jsonl", "{\"input_ids\": [7, 8, 9]}\n{\"text\": \"one two three\"}\n");
  spec = Spec({{mixed, 2}});
  spec.min_seq_len = 1;
  absl::StatusOr<CalibrationSet> text = LoadCalibrationSet(spec, std::nullopt, absent, kVocab);
  EXPECT_EQ(text.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(text.status().message(), dir_ + "/no-model/tokenizer.json: cannot open: No such file or directory");
}

// Issue 19 item 1: a data set is judged by where the file it opened lies, inside the submitter's
// roots; a link to a file outside them is refused, naming the field, never the target.
TEST_F(CalibrationDataTest, ADataSetOutsideTheRootsIsRefused) {
  std::filesystem::create_directories(dir_ + "/mine");
  const std::string theirs = TextFile("theirs.jsonl", 3);
  const std::string link = dir_ + "/mine/data.jsonl";
  std::filesystem::create_symlink(theirs, link);
  const std::string mine = TextFile("mine/own.jsonl", 3);
  CalibrationTokenizer tokenizer(*tokenizer_);
  const checkpoint::SourceRoots roots =
      std::vector<std::string>{std::filesystem::canonical(dir_ + "/mine").string()};
  absl::StatusOr<CalibrationSet> set =
      LoadCalibrationSet(Spec({{mine, 1}, {link, 1}}), roots, tokenizer, kVocab);
  EXPECT_EQ(set.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(set.status().message(),
            "calibration.datasets[1].path: " + link +
                " leads outside the allowed roots of the caller that submitted the job (a "
                "symbolic link is followed only within them)");
  set = LoadCalibrationSet(Spec({{mine, 1}}), roots, tokenizer, kVocab);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->samples.size(), 1u);
}

TEST_F(CalibrationDataTest, AFileListedTwiceIsRefused) {
  const std::string a = TextFile("a.jsonl", 4);
  EXPECT_EQ(ErrorOf(Spec({{a, 1}, {TextFile("b.jsonl", 4), 1}, {a, 1}})),
            "calibration.datasets[2].path names the file of calibration.datasets[0].path again: "
            "list a data set once, with the samples it gives");
  CalibrationSpec shorthand = Spec({{dir_ + "/./a.jsonl", 1}});
  shorthand.dataset = a;
  EXPECT_EQ(ErrorOf(shorthand),
            "calibration.dataset names the file of calibration.datasets[0].path again: list a data "
            "set once, with the samples it gives");
  // The same file by another name (a hard link) is the same data.
  const std::string link = dir_ + "/link.jsonl";
  ASSERT_EQ(::link(a.c_str(), link.c_str()), 0);
  EXPECT_EQ(ErrorOf(Spec({{a, 1}, {link, 1}})),
            "calibration.datasets[1].path is the file of calibration.datasets[0].path by another "
            "path: list a data set once, with the samples it gives");
}

TEST_F(CalibrationDataTest, ALineOverTheCapIsRefusedWithoutItsContent) {
  const std::string secret = "hunter2-correct-horse";
  std::string line = "{\"text\": \"" + secret + std::string(kMaxCalibrationLineBytes, 'x') + "\"}\n";
  const std::string path = Write("long.jsonl", "{\"text\": \"fine\"}\n" + line);
  const std::string error = ErrorOf(Spec({{path, 1}}));
  EXPECT_EQ(error, path + ":2: longer than 4194304 bytes");
  // A bad conversation key is quoted as a short escaped excerpt, never whole.
  const std::string key = secret + std::string(1000, 'k');
  const std::string chat = Write("chat.jsonl", "{\"messages\": [{\"role\": \"user\", \"" + key + "\": \"x\"}]}\n");
  EXPECT_EQ(ErrorOf(Spec({{chat, 1}})),
            chat + ":1: messages[0] key \"" + key.substr(0, 64) +
                "...\" is not a rendered field (role and content)");
}

TEST_F(CalibrationDataTest, TheTokenizersTimeBudgetFailsTheSampleNamingFileAndLine) {
  // The DeepSeek tokenizer with a first pre-tokenizer step costing 2^18 steps a character.
  absl::StatusOr<std::string> text = checkpoint::ReadFile(
      std::string(QUANTD_SOURCE_DIR) + "/tests/data/deepseek_v3_tokenizer/tokenizer.json", 64 << 20);
  ASSERT_TRUE(text.ok()) << text.status();
  nlohmann::json file = nlohmann::json::parse(*text);
  auto& steps = file["pre_tokenizer"]["pretokenizers"];
  steps.insert(steps.begin(), nlohmann::json{{"type", "Split"},
                                             {"pattern", {{"Regex", "(?:.|.){18}\\d\\d\\d\\d\\d\\d"}}},
                                             {"behavior", "Isolated"}});
  auto wedge = tokenizer::Tokenizer::FromJson(file.dump(), "w/tokenizer.json");
  ASSERT_TRUE(wedge.ok()) << wedge.status();
  const std::string path = Write("prose.jsonl", "{\"text\": \"" + std::string(4000, 'x') + "\"}\n");
  CalibrationTokenizer tokenizer(**wedge);
  CalibrationSpec spec = Spec({{path, 1}});
  spec.add_bos = false;
  absl::StatusOr<CalibrationSet> set = LoadCalibrationSet(spec, std::nullopt, tokenizer, kVocab);
  EXPECT_EQ(set.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StartsWith(set.status().message(),
                               path + ":1: w/tokenizer.json: field 'pre_tokenizer.pretokenizers[0]."
                                      "pattern.Regex' spent the text's budget of 104ms CPU time"))
      << set.status();
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
  absl::StatusOr<CalibrationSet> set = Load(spec);
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
  EXPECT_TRUE(Load(again).ok());
}

TEST_F(CalibrationDataTest, BuiltInExampleDataIsUsable) {
  CalibrationSpec spec = Spec({{std::string(QUANTD_SOURCE_DIR) + "/tests/data/calibration_sample.jsonl", 44}});
  absl::StatusOr<CalibrationSet> set = Load(spec);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->samples.size(), 44u);
  std::set<int64_t> lines;
  for (const CalibrationSample& s : set->samples) lines.insert(s.line);
  EXPECT_EQ(lines.size(), 44u);
}

}  // namespace
}  // namespace quantd::calibration
