#include "server/tokenizer/tokenizer_regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <time.h>

#include <algorithm>
#include <new>

#include "absl/strings/str_cat.h"

namespace quantd::tokenizer {
namespace {

// Backtracking steps a match attempt at one start position may take before PCRE2 gives up;
// tokenizer patterns need a few per character, so this only stops patterns that backtrack
// exponentially. The depth and heap limits bound the interpreter (without JIT) likewise.
constexpr uint32_t kMatchLimit = 1'000'000;
constexpr uint32_t kDepthLimit = 100'000;
constexpr uint32_t kHeapLimitKib = 64 << 10;
// Start positions one pcre2_match call may try (its offset limit): the work between two deadline
// checks is at most this many times the match limit.
constexpr size_t kWindowBytes = 64;

int64_t ClockNs(clockid_t clock) {
  struct timespec ts;
  clock_gettime(clock, &ts);
  return int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

std::string Pcre2Message(int code) {
  PCRE2_UCHAR buffer[256];
  if (pcre2_get_error_message(code, buffer, sizeof(buffer)) < 0) return absl::StrCat("error ", code);
  return reinterpret_cast<const char*>(buffer);
}

// `pattern` with \s and \S spelled as the White_Space property. Oniguruma (the `tokenizers`
// library's engine) reads \s as White_Space; PCRE2 reads it as \p{Zs}, \h and \v, which adds
// U+180E (MONGOLIAN VOWEL SEPARATOR, no longer a space since Unicode 6.3).
std::string WithWhiteSpaceProperty(absl::string_view pattern) {
  std::string out;
  out.reserve(pattern.size() + 16);
  for (size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] != '\\' || i + 1 == pattern.size()) {
      out.push_back(pattern[i]);
      continue;
    }
    const char next = pattern[++i];
    if (next == 's') {
      out.append("\\p{White_Space}");
    } else if (next == 'S') {
      out.append("\\P{White_Space}");
    } else if (next == 'Q') {  // \Q...\E is literal text
      const size_t end = pattern.find("\\E", i + 1);
      const size_t stop = end == absl::string_view::npos ? pattern.size() : end + 2;
      out.append(pattern.data() + i - 1, stop - (i - 1));
      i = stop - 1;
    } else {
      out.push_back('\\');
      out.push_back(next);
    }
  }
  return out;
}

}  // namespace

struct TokenizerRegex::Code {
  pcre2_code* code = nullptr;
  std::string where;  // names the pattern in match errors

  ~Code() { pcre2_code_free(code); }
};

TextBudget::TextBudget(absl::Duration cpu_time)
    : cpu_time_(cpu_time),
      cpu_limit_ns_(ClockNs(CLOCK_THREAD_CPUTIME_ID) + absl::ToInt64Nanoseconds(cpu_time)),
      next_check_ns_(ClockNs(CLOCK_MONOTONIC_COARSE) + absl::ToInt64Nanoseconds(cpu_time)) {}

bool TextBudget::Spent() {
  const int64_t now = ClockNs(CLOCK_MONOTONIC_COARSE);
  if (now < next_check_ns_) return false;
  const int64_t left = cpu_limit_ns_ - ClockNs(CLOCK_THREAD_CPUTIME_ID);
  if (left <= 0) return true;
  next_check_ns_ = now + left;  // the thread waited: CPU time cannot run out before this
  return false;
}

RegexScratch::RegexScratch()
    : match_data_(pcre2_match_data_create(1, nullptr)),
      match_context_(pcre2_match_context_create(nullptr)) {
  if (match_data_ == nullptr || match_context_ == nullptr) throw std::bad_alloc();
  auto* context = static_cast<pcre2_match_context*>(match_context_);
  pcre2_set_match_limit(context, kMatchLimit);
  pcre2_set_depth_limit(context, kDepthLimit);
  pcre2_set_heap_limit(context, kHeapLimitKib);
}

RegexScratch::~RegexScratch() {
  pcre2_match_context_free(static_cast<pcre2_match_context*>(match_context_));
  pcre2_match_data_free(static_cast<pcre2_match_data*>(match_data_));
}

absl::StatusOr<TokenizerRegex> TokenizerRegex::Compile(absl::string_view pattern, bool literal,
                                                       const std::string& where) {
  if (pattern.size() > kMaxPatternBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("is longer than ", kMaxPatternBytes, " bytes (", pattern.size(), ")"));
  }
  auto code = std::make_shared<Code>();
  code->where = where;
  int error = 0;
  PCRE2_SIZE offset = 0;
  const uint32_t options =
      PCRE2_UTF | PCRE2_USE_OFFSET_LIMIT | (literal ? PCRE2_LITERAL : PCRE2_UCP);
  const std::string source = literal ? std::string(pattern) : WithWhiteSpaceProperty(pattern);
  code->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(source.data()), source.size(), options,
                             &error, &offset, nullptr);
  if (code->code == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("is rejected by PCRE2 (", Pcre2Message(error), ")"));
  }
  // Without JIT support (or memory for it) PCRE2 interprets the pattern: slower, same matches.
  pcre2_jit_compile(code->code, PCRE2_JIT_COMPLETE);
  return TokenizerRegex(std::move(code));
}

absl::StatusOr<bool> TokenizerRegex::Find(absl::string_view subject, size_t from,
                                          TextBudget& budget, RegexScratch& scratch,
                                          size_t* begin, size_t* end) const {
  auto* data = static_cast<pcre2_match_data*>(scratch.match_data());
  auto* context = static_cast<pcre2_match_context*>(scratch.match_context());
  while (from < subject.size()) {
    if (budget.Spent()) {
      return absl::DeadlineExceededError(absl::StrCat(
          code_->where, " spent the text's budget of ", absl::FormatDuration(budget.cpu_time()),
          " CPU time (at byte ", from, " of ", subject.size(), ")"));
    }
    // A match must start in [from, window]: the leftmost match, if it starts there, is the
    // one an unlimited search finds; otherwise the next call goes on from the window's end.
    const size_t window = std::min(subject.size(), from + kWindowBytes);
    pcre2_set_offset_limit(context, window);
    const int rc = pcre2_match(code_->code, reinterpret_cast<PCRE2_SPTR>(subject.data()),
                               subject.size(), from, PCRE2_NO_UTF_CHECK, data, context);
    if (rc == PCRE2_ERROR_NOMATCH) {
      from = window;
      while (from < subject.size() && (static_cast<uint8_t>(subject[from]) & 0xC0) == 0x80) ++from;
      continue;
    }
    if (rc < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          code_->where, " failed on the text (at byte ", from, "): ", Pcre2Message(rc)));
    }
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data);
    if (ovector[1] > ovector[0]) {
      *begin = ovector[0];
      *end = ovector[1];
      return true;
    }
    // An empty match yields no piece: look again from the next character.
    from = ovector[0] + 1;
    while (from < subject.size() && (static_cast<uint8_t>(subject[from]) & 0xC0) == 0x80) ++from;
  }
  return false;
}

}  // namespace quantd::tokenizer
