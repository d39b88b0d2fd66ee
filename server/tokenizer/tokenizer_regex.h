// A pre-tokenizer pattern compiled by PCRE2 in UTF mode with Unicode properties (\p{L}, \s, ...),
// JIT-compiled where the platform allows. The `tokenizers` library runs the same patterns with
// Oniguruma; the syntax tokenizer.json files use (classes, \p{..}, lookahead, counted repeats)
// means the same in both once \s is read as Oniguruma reads it (White_Space, see the .cc).
#ifndef QUANTD_SERVER_TOKENIZER_TOKENIZER_REGEX_H_
#define QUANTD_SERVER_TOKENIZER_TOKENIZER_REGEX_H_

#include <stddef.h>

#include <memory>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"

namespace quantd::tokenizer {

// Scratch space for one matching thread; reusable across patterns and subjects.
class RegexScratch {
 public:
  RegexScratch();
  ~RegexScratch();
  RegexScratch(const RegexScratch&) = delete;
  RegexScratch& operator=(const RegexScratch&) = delete;

  void* match_data() const { return match_data_; }

 private:
  void* match_data_;  // pcre2_match_data_8*, room for the whole-match offsets
};

class TokenizerRegex {
 public:
  // `literal`: the pattern is a plain string (tokenizer.json's {"String": ...}). `field` names
  // the pattern in match errors. A rejected pattern is InvalidArgument("is rejected by PCRE2
  // (reason)"), for the caller to prefix with the field; it never quotes the pattern.
  static absl::StatusOr<TokenizerRegex> Compile(absl::string_view pattern, bool literal,
                                                const std::string& field);

  // Finds the first non-empty match in subject[from, end) (the subject is valid UTF-8 and
  // lookarounds see only `subject`); true with [*begin, *end) set, false when there is none.
  // An error when PCRE2 gives up (its match limit bounds pathological patterns).
  absl::StatusOr<bool> Find(absl::string_view subject, size_t from, RegexScratch& scratch,
                            size_t* begin, size_t* end) const;

 private:
  struct Code;
  explicit TokenizerRegex(std::shared_ptr<const Code> code) : code_(std::move(code)) {}

  std::shared_ptr<const Code> code_;  // compiled pattern and match context; immutable
};

}  // namespace quantd::tokenizer

#endif  // QUANTD_SERVER_TOKENIZER_TOKENIZER_REGEX_H_
