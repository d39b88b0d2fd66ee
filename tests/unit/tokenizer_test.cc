// The tokenizer on the real DeepSeek-V3 tokenizer.json (ids below are what the `tokenizers`
// library gives; tests/interop/test_tokenizer_peer.py compares 5,000+ strings), on small
// synthetic files that pin BPE ranks, split behaviours and the post-processor, and a named error
// for each kind of bad file.
#include "server/tokenizer/tokenizer.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "server/base/utf8.h"
#include "server/tokenizer/tokenizer_byte_level.h"

namespace quantd::tokenizer {

using base::AppendUtf8;

namespace {

using nlohmann::json;
using Ids = std::vector<int32_t>;

const std::string kDeepSeekDir = std::string(QUANTD_SOURCE_DIR) + "/tests/data/deepseek_v3_tokenizer";

class DeepSeekTokenizerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto loaded = Tokenizer::LoadDir(kDeepSeekDir);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    tokenizer_ = loaded->release();
  }
  static void TearDownTestSuite() { delete tokenizer_; }

  static Ids Encode(const std::string& text) {
    auto ids = tokenizer_->Encode(text);
    EXPECT_TRUE(ids.ok()) << ids.status();
    return ids.ok() ? *ids : Ids{};
  }

  static const Tokenizer* tokenizer_;
};
const Tokenizer* DeepSeekTokenizerTest::tokenizer_ = nullptr;

TEST_F(DeepSeekTokenizerTest, EncodesAsTheTokenizersLibrary) {
  EXPECT_EQ(Encode("Hello world"), (Ids{19923, 2058}));
  // Digits split in threes, CJK runs isolated, punctuation merged with its space.
  EXPECT_EQ(Encode("The year 2025 has 365 days."), (Ids{671, 1141, 223, 939, 23, 769, 223, 15551, 3137, 16}));
  EXPECT_EQ(Encode("你好，世界！"), (Ids{30594, 303, 3427, 1175}));
  EXPECT_EQ(Encode("naïve café 😀"), (Ids{2720, 91223, 57664, 53769, 225}));
  // A 100-space run takes the heap path of BPE.
  EXPECT_EQ(Encode(std::string(100, ' ') + "x"), (Ids{16932, 15970, 1527}));
  EXPECT_EQ(Encode(""), Ids{});
}

TEST_F(DeepSeekTokenizerTest, SpecialTokensInTextAreSingleTokens) {
  EXPECT_EQ(Encode("<｜User｜>hi<｜Assistant｜>"), (Ids{128803, 6366, 128804}));
  EXPECT_EQ(Encode("<｜begin▁of▁sentence｜>S<｜User｜>hello<｜Assistant｜></think>Hi<｜end▁of▁sentence｜>"),
            (Ids{0, 53, 128803, 33310, 128804, 1718, 37947, 32, 23166, 1}));
}

TEST_F(DeepSeekTokenizerTest, VocabularyAndBos) {
  EXPECT_EQ(tokenizer_->vocab_size(), 128815);
  EXPECT_EQ(tokenizer_->bos_id(), 0);
  EXPECT_EQ(tokenizer_->TokenId("<｜end▁of▁sentence｜>"), 1);
  EXPECT_EQ(tokenizer_->TokenId("not a token"), std::nullopt);
  EXPECT_TRUE(tokenizer_->HasToken(128814));
  EXPECT_FALSE(tokenizer_->HasToken(128815));
  EXPECT_FALSE(tokenizer_->HasToken(-1));
  // The file's post-processor is ByteLevel: special tokens add nothing.
  EXPECT_EQ(*tokenizer_->EncodeWithSpecialTokens("Hello world"), (Ids{19923, 2058}));
}

TEST_F(DeepSeekTokenizerTest, DecodeRoundTripsAndReplacesSplitCharacters) {
  const std::string text = "<｜User｜>naïve 😀\n\tcode();  1234567";
  EXPECT_EQ(*tokenizer_->Decode(Encode(text)), text);
  const Ids emoji = Encode("😀");
  ASSERT_EQ(emoji.size(), 2u);
  EXPECT_EQ(*tokenizer_->Decode(Ids{emoji[0]}), "\xEF\xBF\xBD");
  absl::StatusOr<std::string> bad = tokenizer_->Decode(Ids{5, 200000});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "id 200000 (position 1) has no token in this tokenizer");
}

TEST_F(DeepSeekTokenizerTest, InvalidUtf8IsAnError) {
  for (const auto& [text, byte] : std::vector<std::pair<std::string, int>>{
           {"ab\xff", 2}, {"caf\xc3", 3}, {"\xc0\xaf", 0}, {"x\xed\xa0\x80", 1}, {"\xf4\x90\x80\x80", 0}}) {
    absl::StatusOr<Ids> ids = tokenizer_->Encode(text);
    ASSERT_FALSE(ids.ok());
    EXPECT_EQ(ids.status().message(), "text is not valid UTF-8 (byte " + std::to_string(byte) + ")");
  }
}

// A synthetic byte-level tokenizer: the 256 byte tokens (ids 0..255 in byte order) plus `extra`
// tokens (ids from 256) and `merges`, with `pre_tokenizer` before its ByteLevel step.
std::string Spelling(const std::string& bytes) {
  std::string s;
  for (char c : bytes) AppendUtf8(ByteLevelChar(static_cast<uint8_t>(c)), &s);
  return s;
}

json SyntheticTokenizer(const std::vector<std::string>& extra,
                        const std::vector<std::pair<std::string, std::string>>& merges,
                        json pre_tokenizers = json::array()) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[Spelling(std::string(1, static_cast<char>(b)))] = b;
  for (size_t i = 0; i < extra.size(); ++i) vocab[Spelling(extra[i])] = 256 + static_cast<int>(i);
  json merge_list = json::array();
  for (const auto& [l, r] : merges) merge_list.push_back(Spelling(l) + " " + Spelling(r));
  pre_tokenizers.push_back({{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}});
  return {{"added_tokens", json::array()},
          {"normalizer", nullptr},
          {"pre_tokenizer", {{"type", "Sequence"}, {"pretokenizers", pre_tokenizers}}},
          {"post_processor", nullptr},
          {"decoder", {{"type", "ByteLevel"}}},
          {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merge_list}}}};
}

Ids EncodeWith(const json& file, const std::string& text) {
  auto tokenizer = Tokenizer::FromJson(file.dump(), "t.json");
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status();
  if (!tokenizer.ok()) return {};
  auto ids = (*tokenizer)->Encode(text);
  EXPECT_TRUE(ids.ok()) << ids.status();
  return ids.ok() ? *ids : Ids{};
}

TEST(SyntheticTokenizerTest, LowestRankMergesFirstAndLeftmostAmongEqual) {
  // "ab" (256), "bc" (257), "abc" (258); ranks: bc before ab.
  const json file = SyntheticTokenizer({"ab", "bc", "abc"}, {{"b", "c"}, {"a", "b"}, {"a", "bc"}});
  EXPECT_EQ(EncodeWith(file, "abc"), (Ids{258}));  // b+c, then a+bc
  EXPECT_EQ(EncodeWith(file, "abab"), (Ids{256, 256}));
  EXPECT_EQ(EncodeWith(file, "ca"), (Ids{'c', 'a'}));
  // "aaa" with merge a+a: the leftmost pair merges first.
  const json aa = SyntheticTokenizer({"aa"}, {{"a", "a"}});
  EXPECT_EQ(EncodeWith(aa, "aaa"), (Ids{256, 'a'}));
  // The heap path (words over 64 bytes) agrees with the rescanning path.
  EXPECT_EQ(EncodeWith(aa, std::string(101, 'a')), [] {
    Ids ids(50, 256);
    ids.push_back('a');
    return ids;
  }());
}

TEST(SyntheticTokenizerTest, SplitBehaviours) {
  // Tokens "a " (256) and " b" (257) show where the split put the space.
  auto encode = [](const std::string& behavior, bool invert = false) {
    json split = {{"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", behavior}, {"invert", invert}};
    return EncodeWith(SyntheticTokenizer({"a ", " b"}, {{"a", " "}, {" ", "b"}}, json::array({split})), "a b");
  };
  EXPECT_EQ(encode("Isolated"), (Ids{'a', ' ', 'b'}));
  EXPECT_EQ(encode("Removed"), (Ids{'a', 'b'}));
  EXPECT_EQ(encode("MergedWithPrevious"), (Ids{256, 'b'}));
  EXPECT_EQ(encode("MergedWithNext"), (Ids{'a', 257}));
  EXPECT_EQ(encode("Removed", /*invert=*/true), (Ids{' '}));
  // Contiguous joins adjacent matches into one piece, so "ab" can merge (Isolated would not).
  json contiguous = {{"type", "Split"}, {"pattern", {{"Regex", "a|b"}}}, {"behavior", "Contiguous"}};
  const json ab = SyntheticTokenizer({"ab"}, {{"a", "b"}}, json::array({contiguous}));
  EXPECT_EQ(EncodeWith(ab, "abab"), (Ids{256, 256}));
}

TEST(SyntheticTokenizerTest, TemplatePostProcessorAndAddedTokens) {
  json file = SyntheticTokenizer({"<s>"}, {});
  file["added_tokens"] = json::array({{{"id", 256}, {"content", "<s>"}, {"special", true}, {"normalized", false}}});
  file["post_processor"] = {
      {"type", "TemplateProcessing"},
      {"single", json::array({{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                              {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
      {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {256}}, {"tokens", {"<s>"}}}}}}};
  auto tokenizer = Tokenizer::FromJson(file.dump(), "t.json", "<s>");
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  EXPECT_EQ(*(*tokenizer)->Encode("x<s>y"), (Ids{'x', 256, 'y'}));
  EXPECT_EQ(*(*tokenizer)->EncodeWithSpecialTokens("x"), (Ids{256, 'x'}));
  EXPECT_EQ((*tokenizer)->bos_id(), 256);
}

TEST(SyntheticTokenizerTest, NormalizerRunsBeforeNormalizedAddedTokens) {
  json file = SyntheticTokenizer({"<x>"}, {});
  file["normalizer"] = {{"type", "Sequence"},
                        {"normalizers", json::array({{{"type", "Replace"}, {"pattern", {{"String", "[x]"}}},
                                                      {"content", "<x>"}}})}};
  file["added_tokens"] = json::array({{{"id", 256}, {"content", "<x>"}, {"special", false}, {"normalized", true}}});
  EXPECT_EQ(EncodeWith(file, "a[x]"), (Ids{'a', 256}));
}

std::string LoadError(const json& file) {
  auto tokenizer = Tokenizer::FromJson(file.dump(), "t.json");
  EXPECT_FALSE(tokenizer.ok());
  EXPECT_EQ(tokenizer.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(tokenizer.status().message());
}

TEST(TokenizerLoadTest, BadFilesNameTheField) {
  const json good = SyntheticTokenizer({"ab"}, {{"a", "b"}});
  EXPECT_EQ(Tokenizer::FromJson("{", "t.json").status().message(), "t.json: not valid JSON");

  json f = good;
  f.erase("model");
  EXPECT_EQ(LoadError(f), "t.json: field 'model' is required");
  f = good;
  f["model"]["type"] = "WordPiece";
  EXPECT_EQ(LoadError(f), "t.json: field 'model.type' has unsupported type \"WordPiece\" (quantd reads BPE)");
  f = good;
  f["model"]["merges"] = json::array({Spelling("a") + " " + Spelling("zz")});
  EXPECT_EQ(LoadError(f), "t.json: field 'model.merges[0]' names a token that is not in model.vocab");
  f = good;
  f["model"]["merges"] = json::array({Spelling("b") + " " + Spelling("a")});
  EXPECT_EQ(LoadError(f), "t.json: field 'model.merges[0]' makes a token that is not in model.vocab");
  f = good;
  f["model"]["merges"] = json::array({7});
  EXPECT_EQ(LoadError(f), "t.json: field 'model.merges[0]' must be \"left right\" or [\"left\", \"right\"]");
  f = good;
  f["model"]["vocab"][Spelling("a")] = -4;
  EXPECT_EQ(LoadError(f), "t.json: field 'model.vocab' must be a token id from 0 to 1048575");
  f = good;
  f["model"]["vocab"].erase(Spelling("\n"));
  EXPECT_EQ(LoadError(f), "t.json: field 'model.vocab' lacks the token of byte 0x0A");
  f = good;
  const json bad_split = {{"type", "Split"}, {"pattern", {{"Regex", "(a"}}}, {"behavior", "Isolated"}};
  f["pre_tokenizer"]["pretokenizers"].insert(f["pre_tokenizer"]["pretokenizers"].begin(), bad_split);
  EXPECT_EQ(LoadError(f),
            "t.json: field 'pre_tokenizer.pretokenizers[0].pattern.Regex' is rejected by PCRE2 "
            "(missing closing parenthesis)");
  f = good;
  f["pre_tokenizer"]["pretokenizers"][0] = {{"type", "Whitespace"}};
  EXPECT_EQ(LoadError(f),
            "t.json: field 'pre_tokenizer.pretokenizers[0].type' has unsupported type \"Whitespace\" "
            "(quantd reads Sequence, Split and ByteLevel)");
  f = good;
  f["pre_tokenizer"]["pretokenizers"].push_back({{"type", "ByteLevel"}});
  EXPECT_EQ(LoadError(f),
            "t.json: field 'pre_tokenizer.pretokenizers[1]' follows the ByteLevel pre-tokenizer "
            "(quantd needs ByteLevel last)");
  f = good;
  f["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", "Isolated"}};
  EXPECT_EQ(LoadError(f), "t.json: field 'pre_tokenizer' must end with a ByteLevel pre-tokenizer (byte-level BPE)");
  f = good;
  f["added_tokens"] = json::array({{{"id", 3}, {"content", "<x>"}, {"lstrip", true}}});
  EXPECT_EQ(LoadError(f), "t.json: field 'added_tokens[0].lstrip' must be false (unsupported by quantd)");
  f = good;
  f["added_tokens"] = json::array({{{"id", 3}, {"content", ""}}});
  EXPECT_EQ(LoadError(f), "t.json: field 'added_tokens[0].content' must not be empty");
  f = good;
  f["post_processor"] = {{"type", "BertProcessing"}};
  EXPECT_EQ(LoadError(f),
            "t.json: field 'post_processor.type' has unsupported type \"BertProcessing\" "
            "(quantd reads TemplateProcessing, ByteLevel and Sequence)");
  f = good;
  f["normalizer"] = {{"type", "NFKC"}};
  EXPECT_EQ(LoadError(f),
            "t.json: field 'normalizer.type' has unsupported type \"NFKC\" "
            "(quantd reads Sequence, Prepend and Replace with a String pattern)");
}

// The issue 19 (item 3) attacks on the loader and the encoder: each is an error naming the file and
// the field, in bounded memory and time.
json WithNormalizers(json file, const json& step, int count) {
  file["normalizer"] = {{"type", "Sequence"}, {"normalizers", json::array()}};
  for (int i = 0; i < count; ++i) file["normalizer"]["normalizers"].push_back(step);
  return file;
}

TEST(TokenizerBudgetTest, NormalizerGrowthIsBoundedNotAllocated) {
  const json replace = {{"type", "Replace"}, {"pattern", {{"String", "a"}}}, {"content", "aa"}};
  // The bomb: 40 doublings of "a" (2^40 bytes) stop at 4 x 1000 + 1024 bytes.
  auto bomb = Tokenizer::FromJson(WithNormalizers(SyntheticTokenizer({}, {}), replace, 40).dump(), "t.json");
  ASSERT_TRUE(bomb.ok()) << bomb.status();
  auto ids = (*bomb)->Encode(std::string(1000, 'a'));
  EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ids.status().message(),
            "t.json: field 'normalizer.normalizers[2]' makes a text of 1000 bytes longer than 5024 "
            "bytes (the normalizer may grow a text 4 times)");
  // Two doublings (4 times) are within the bound.
  auto two = Tokenizer::FromJson(WithNormalizers(SyntheticTokenizer({}, {}), replace, 2).dump(), "t.json");
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ(*(*two)->Encode(std::string(1000, 'a')), Ids(4000, 'a'));
  // A long Prepend on a short piece fails before it is copied.
  json prepend = {{"type", "Prepend"}, {"prepend", std::string(2000, 'p')}};
  auto long_prefix = Tokenizer::FromJson(WithNormalizers(SyntheticTokenizer({}, {}), prepend, 1).dump(), "t.json");
  ASSERT_TRUE(long_prefix.ok()) << long_prefix.status();
  EXPECT_EQ((*long_prefix)->Encode("x").status().message(),
            "t.json: field 'normalizer.normalizers[0]' makes a text of 1 bytes longer than 1028 "
            "bytes (the normalizer may grow a text 4 times)");
}

// 2^18 steps at every start position (18 two-way choices before the six digits that never come),
// under PCRE2's match limit at each: only the deadline stops it.
const json kWedge = {{"type", "Split"},
                     {"pattern", {{"Regex", "(?:.|.){18}\\d\\d\\d\\d\\d\\d"}}},
                     {"behavior", "Isolated"}};

TEST(TokenizerBudgetTest, CatastrophicPatternStopsAtTheDeadline) {
  auto wedge = Tokenizer::FromJson(SyntheticTokenizer({}, {}, json::array({kWedge})).dump(), "t.json");
  ASSERT_TRUE(wedge.ok()) << wedge.status();
  const std::string text(100000, 'x');  // minutes of work without a budget
  const absl::Time start = absl::Now();
  auto ids = (*wedge)->Encode(text, absl::Milliseconds(200));
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(ids.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StartsWith(ids.status().message(),
                               "t.json: field 'pre_tokenizer.pretokenizers[0].pattern.Regex' spent "
                               "the text's budget of 200ms CPU time (at byte "))
      << ids.status();
  EXPECT_LT(took, absl::Seconds(3)) << took;
  // The default budget: 100 ms plus 1 s per MiB, which stops the 256-byte sample too.
  EXPECT_EQ(Tokenizer::EncodeBudget(0), absl::Milliseconds(100));
  EXPECT_EQ(Tokenizer::EncodeBudget(1 << 20), absl::Milliseconds(1100));
  EXPECT_EQ((*wedge)->Encode(std::string(256, 'x')).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  // Short texts still encode (the pattern never matches, the text passes on whole).
  EXPECT_EQ(*(*wedge)->Encode("xy"), (Ids{'x', 'y'}));
}

TEST(TokenizerBudgetTest, ExponentialBacktrackingHitsTheMatchLimit) {
  const json split = {{"type", "Split"}, {"pattern", {{"Regex", "(?:(?:.|.)+)+\\d{7}"}}},
                      {"behavior", "Isolated"}};
  auto t = Tokenizer::FromJson(SyntheticTokenizer({}, {}, json::array({split})).dump(), "t.json");
  ASSERT_TRUE(t.ok()) << t.status();
  auto ids = (*t)->Encode(std::string(64, 'x'));
  EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ids.status().message(),
            "t.json: field 'pre_tokenizer.pretokenizers[0].pattern.Regex' failed on the text (at "
            "byte 0): match limit exceeded");
}

TEST(TokenizerBudgetTest, FileCapsNameTheField) {
  const json good = SyntheticTokenizer({"ab"}, {{"a", "b"}});
  json f = good;
  f["model"]["vocab"][Spelling("ab")] = 1 << 20;
  EXPECT_EQ(LoadError(f), "t.json: field 'model.vocab' must be a token id from 0 to 1048575");
  f = good;
  for (int i = 0; i < 65537; ++i) {
    f["added_tokens"].push_back({{"id", 300}, {"content", "<" + std::to_string(i) + ">"}});
  }
  EXPECT_EQ(LoadError(f), "t.json: field 'added_tokens' has 65537 entries; quantd reads at most 65536");
  f = good;
  for (int i = 0; i < 300; ++i) {
    f["added_tokens"].push_back({{"id", 300 + i}, {"content", std::string(4000, 'a' + i % 26) + std::to_string(i)}});
  }
  EXPECT_EQ(LoadError(f), "t.json: field 'added_tokens' holds more than 1048576 bytes of content in all");
  f = WithNormalizers(good, {{"type", "Prepend"}, {"prepend", "_"}}, 65);
  EXPECT_EQ(LoadError(f), "t.json: field 'normalizer' has 65 steps; quantd reads at most 64");
  f = good;
  for (int i = 0; i < 65; ++i) {
    f["pre_tokenizer"]["pretokenizers"].insert(f["pre_tokenizer"]["pretokenizers"].begin(), kWedge);
  }
  EXPECT_EQ(LoadError(f), "t.json: field 'pre_tokenizer' has 65 steps; quantd reads at most 64");
  f = good;
  const json long_split = {{"type", "Split"},
                           {"pattern", {{"String", std::string(20000, 'a')}}},
                           {"behavior", "Isolated"}};
  f["pre_tokenizer"]["pretokenizers"].insert(f["pre_tokenizer"]["pretokenizers"].begin(), long_split);
  EXPECT_EQ(LoadError(f),
            "t.json: field 'pre_tokenizer.pretokenizers[0].pattern.String' is longer than 16384 bytes (20000)");
  // The 5 MB component name is quoted as a short escaped excerpt.
  f = good;
  f["normalizer"] = {{"type", std::string(5 << 20, 'N') + "\n"}};
  const std::string error = LoadError(f);
  EXPECT_EQ(error, "t.json: field 'normalizer.type' has unsupported type \"" + std::string(64, 'N') +
                       "...\" (quantd reads Sequence, Prepend and Replace with a String pattern)");
}

TEST(TokenizerBudgetTest, JsonShapeIsBoundedBeforeParsing) {
  json f = SyntheticTokenizer({}, {});
  f["padding"] = json::array();
  for (int i = 0; i < (4 << 20); ++i) f["padding"].push_back(0);
  EXPECT_EQ(LoadError(f), "t.json: has more than 4194304 JSON values");
  std::string deep = "{\"padding\": " + std::string(65, '[') + std::string(65, ']') + "}";
  EXPECT_EQ(Tokenizer::FromJson(deep, "t.json").status().message(),
            "t.json: nests JSON deeper than 64 levels");
}

TEST(TokenizerBudgetTest, TokenizerConfigIsCappedAt4MiB) {
  const std::string dir = ::testing::TempDir() + "/tokenizer_config_cap";
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/tokenizer.json") << SyntheticTokenizer({}, {}).dump();
  std::ofstream(dir + "/tokenizer_config.json")
      << "{\"bos_token\": null, \"padding\": \"" << std::string(4 << 20, 'p') << "\"}";
  auto tokenizer = Tokenizer::LoadDir(dir);
  EXPECT_EQ(tokenizer.status().message(),
            dir + "/tokenizer_config.json: larger than the limit of 4194304 bytes for this file");
  std::filesystem::remove_all(dir);
}

TEST(TokenizerLoadTest, MissingDirectoryNamesTheFile) {
  auto tokenizer = Tokenizer::LoadDir("/nonexistent/dir");
  ASSERT_FALSE(tokenizer.ok());
  EXPECT_EQ(tokenizer.status().message(),
            "/nonexistent/dir/tokenizer.json: cannot open: No such file or directory");
}

}  // namespace
}  // namespace quantd::tokenizer
