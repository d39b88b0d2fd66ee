// The tokenizer on the real DeepSeek-V3 tokenizer.json (ids below are what the `tokenizers`
// library gives; tests/interop/test_tokenizer_peer.py compares 5,000+ strings), on small
// synthetic files that pin BPE ranks, split behaviours and the post-processor, and a named error
// for each kind of bad file.
#include "server/tokenizer/tokenizer.h"

#include <gtest/gtest.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

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
  EXPECT_EQ(LoadError(f), "t.json: field 'model.vocab' must be a token id from 0 to 16777215");
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

TEST(TokenizerLoadTest, MissingDirectoryNamesTheFile) {
  auto tokenizer = Tokenizer::LoadDir("/nonexistent/dir");
  ASSERT_FALSE(tokenizer.ok());
  EXPECT_EQ(tokenizer.status().message(),
            "/nonexistent/dir/tokenizer.json: cannot open: No such file or directory");
}

}  // namespace
}  // namespace quantd::tokenizer
