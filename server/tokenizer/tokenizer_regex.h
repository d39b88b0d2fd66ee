// A pre-tokenizer pattern compiled by PCRE2 in UTF mode with Unicode properties (\p{L}, \s, ...),
// JIT-compiled where the platform allows. The `tokenizers` library runs the same patterns with
// Oniguruma; the syntax tokenizer.json files use (classes, \p{..}, lookahead, counted repeats)
// means the same in both once \s is read as Oniguruma reads it (White_Space, see the .cc).
//
// A pattern comes from a file the job's submitter wrote, so matching is bounded: PCRE2's match,
// depth and heap limits bound the work at one start position, each pcre2_match call may start a
// match only within a short window of positions (PCRE2's offset limit), and the text's CPU time
// budget is checked between calls. A pattern that backtracks exponentially, or one that costs
// 2^18 steps at every position, fails the text within about a window's work past its budget.
#ifndef QUANTD_SERVER_TOKENIZER_TOKENIZER_REGEX_H_
#define QUANTD_SERVER_TOKENIZER_TOKENIZER_REGEX_H_

#include <stddef.h>
#include <stdint.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace quantd::tokenizer {

// The CPU time one text may take to encode, on the encoding thread's clock (CPU time, so that a
// loaded machine does not fail a text it merely ran slowly). Checked often, so the check reads a
// coarse wall clock and reads the thread's CPU clock only once the wall clock says the budget
// could be spent.
class TextBudget {
 public:
  // Starts now, on the calling thread (the thread that encodes).
  explicit TextBudget(absl::Duration cpu_time);

  bool Spent();
  absl::Duration cpu_time() const { return cpu_time_; }

 private:
  absl::Duration cpu_time_;
  int64_t cpu_limit_ns_;   // the thread's CPU clock when the budget is spent
  int64_t next_check_ns_;  // coarse monotonic clock before which it cannot be
};

// Scratch space for one matching thread; reusable across patterns and subjects.
class RegexScratch {
 public:
  RegexScratch();
  ~RegexScratch();
  RegexScratch(const RegexScratch&) = delete;
  RegexScratch& operator=(const RegexScratch&) = delete;

  void* match_data() const { return match_data_; }
  void* match_context() const { return match_context_; }

 private:
  void* match_data_;     // pcre2_match_data_8*, room for the whole-match offsets
  void* match_context_;  // pcre2_match_context_8*: the limits, and this call's offset limit
};

class TokenizerRegex {
 public:
  // The longest pattern compiled (DeepSeek's longest is under 300 bytes).
  static constexpr size_t kMaxPatternBytes = 16 << 10;

  // `literal`: the pattern is a plain string (tokenizer.json's {"String": ...}). `where` names
  // the pattern (file and field) in match errors. A rejected pattern is InvalidArgument("is
  // rejected by PCRE2 (reason)"), for the caller to prefix with the field; it never quotes the
  // pattern.
  static absl::StatusOr<TokenizerRegex> Compile(absl::string_view pattern, bool literal,
                                                const std::string& where);

  // Finds the first non-empty match in subject[from, end) (the subject is valid UTF-8 and
  // lookarounds see only `subject`); true with [*begin, *end) set, false when there is none.
  // InvalidArgument when PCRE2 gives up at a position (its limits), DeadlineExceeded when
  // `budget` is spent; both name the pattern, never the subject.
  absl::StatusOr<bool> Find(absl::string_view subject, size_t from, TextBudget& budget,
                            RegexScratch& scratch, size_t* begin, size_t* end) const;

 private:
  struct Code;
  explicit TokenizerRegex(std::shared_ptr<const Code> code) : code_(std::move(code)) {}

  std::shared_ptr<const Code> code_;  // compiled pattern; immutable
};

}  // namespace quantd::tokenizer

#endif  // QUANTD_SERVER_TOKENIZER_TOKENIZER_REGEX_H_
