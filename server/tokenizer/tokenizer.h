// Tokenizer: a byte-level BPE tokenizer read from a Hugging Face tokenizer.json (the file every
// DeepSeek checkpoint ships), giving the ids the `tokenizers` library gives for
// `encode(text, add_special_tokens=False)`.
//
// Encoding, in the library's order:
//   1. added tokens whose `normalized` is false (the special tokens) are cut out of the raw text;
//   2. the normalizer (Sequence / Prepend / Replace with a string) runs on the remaining pieces,
//      and the added tokens whose `normalized` is true are cut out of the result;
//   3. the pre-tokenizer (Split with a regex or string pattern, any split behaviour, invert; then
//      ByteLevel, with or without its own GPT-2 regex and prefix space) cuts pieces into words;
//   4. each word is BPE-encoded (tokenizer_bpe.h) on its bytes;
//   5. with special tokens, the post-processor (TemplateProcessing, ByteLevel, Sequence) adds its
//      ids around the sequence.
// Decoding maps ids back to bytes (the ByteLevel decoder) and replaces ill-formed UTF-8 by U+FFFD.
//
// Loading validates the whole file: a missing or mistyped field, an unknown model, normalizer,
// pre-tokenizer or post-processor type, a pattern PCRE2 rejects, a merge naming an unknown token
// are InvalidArgument errors naming the field, never a crash (fuzzed: tests/fuzz). A file is
// bounded before it is parsed (values, nesting) and as it is read (vocabulary, merges, added
// tokens, normalizer and pre-tokenizer steps, pattern length), and encoding one text is bounded
// in memory (the normalizer's growth) and time (Encode's CPU time budget): a hostile file fails the
// text or the load with an error, never with an exhausted machine.
// A Tokenizer is immutable and safe to use from several threads.
#ifndef QUANTD_SERVER_TOKENIZER_TOKENIZER_H_
#define QUANTD_SERVER_TOKENIZER_TOKENIZER_H_

#include <stdint.h>

#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/checkpoint/source_roots.h"

namespace quantd::tokenizer {

class Tokenizer {
 public:
  // Reads DIR/tokenizer.json and, when present, DIR/tokenizer_config.json (its `bos_token`).
  // Both files must resolve inside `roots` (checkpoint/source_roots.h: a job's source).
  static absl::StatusOr<std::unique_ptr<Tokenizer>> LoadDir(
      const std::string& dir, const checkpoint::SourceRoots& roots = std::nullopt);
  // Parses tokenizer.json text; `origin` names the file in errors. `bos_token`: the content of
  // the beginning-of-sequence token, if known (tokenizer_config.json's bos_token).
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromJson(
      absl::string_view tokenizer_json, const std::string& origin,
      std::optional<std::string> bos_token = std::nullopt);

  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // The CPU time one text may take to encode: kEncodeBaseBudget plus kEncodeBudgetPerMib per
  // MiB, rounded up to a millisecond (DeepSeek's tokenizer encodes about 15 MiB a second on one
  // core; a hostile pre-tokenizer pattern that costs 2^18 steps a character takes milliseconds a
  // character).
  static constexpr absl::Duration kEncodeBaseBudget = absl::Milliseconds(100);
  static constexpr absl::Duration kEncodeBudgetPerMib = absl::Seconds(1);
  static absl::Duration EncodeBudget(size_t bytes);

  // The ids of `text`, without the post-processor's special tokens. InvalidArgument when `text`
  // is not valid UTF-8 (the error gives the byte offset), when the normalizer would make it more
  // than 4 times longer, or when a pre-tokenizer pattern exceeds PCRE2's limits at a position;
  // DeadlineExceeded when encoding takes more than `cpu_budget` of the calling thread's CPU time
  // (by default EncodeBudget(text.size())). Errors name tokenizer.json and the field, never the
  // text.
  absl::StatusOr<std::vector<int32_t>> Encode(absl::string_view text) const;
  absl::StatusOr<std::vector<int32_t>> Encode(absl::string_view text,
                                              absl::Duration cpu_budget) const;
  // Encode, then the post-processor's special tokens (e.g. a BOS the file's template adds).
  absl::StatusOr<std::vector<int32_t>> EncodeWithSpecialTokens(absl::string_view text) const;

  // The text of `ids` (special tokens included). InvalidArgument for an id without a token.
  absl::StatusOr<std::string> Decode(std::span<const int32_t> ids) const;

  // Whether `id` has a token (ids run from 0 to vocab_size() - 1, possibly with gaps).
  bool HasToken(int32_t id) const;
  int32_t vocab_size() const;
  // The id of the token spelled `token` (model vocabulary or added token).
  std::optional<int32_t> TokenId(absl::string_view token) const;
  // The beginning-of-sequence token from tokenizer_config.json, when it names one.
  std::optional<int32_t> bos_id() const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);

  std::unique_ptr<Impl> impl_;  // immutable after loading
};

}  // namespace quantd::tokenizer

#endif  // QUANTD_SERVER_TOKENIZER_TOKENIZER_H_
