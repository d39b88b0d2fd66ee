#include "server/tokenizer/tokenizer_regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "absl/strings/str_cat.h"

namespace quantd::tokenizer {
namespace {

// Backtracking steps one match may take before PCRE2 gives up; tokenizer patterns need a few
// per character, so this only stops patterns that backtrack exponentially.
constexpr uint32_t kMatchLimit = 10'000'000;

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
  pcre2_match_context* context = nullptr;
  std::string field;  // names the pattern in match errors

  ~Code() {
    pcre2_match_context_free(context);
    pcre2_code_free(code);
  }
};

RegexScratch::RegexScratch() : match_data_(pcre2_match_data_create(1, nullptr)) {}

RegexScratch::~RegexScratch() {
  pcre2_match_data_free(static_cast<pcre2_match_data*>(match_data_));
}

absl::StatusOr<TokenizerRegex> TokenizerRegex::Compile(absl::string_view pattern, bool literal,
                                                       const std::string& field) {
  auto code = std::make_shared<Code>();
  code->field = field;
  int error = 0;
  PCRE2_SIZE offset = 0;
  const uint32_t options = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
  const std::string source = literal ? std::string(pattern) : WithWhiteSpaceProperty(pattern);
  code->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(source.data()), source.size(), options,
                             &error, &offset, nullptr);
  if (code->code == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("is rejected by PCRE2 (", Pcre2Message(error), ")"));
  }
  // Without JIT support (or memory for it) PCRE2 interprets the pattern: slower, same matches.
  pcre2_jit_compile(code->code, PCRE2_JIT_COMPLETE);
  code->context = pcre2_match_context_create(nullptr);
  if (code->context == nullptr) return absl::ResourceExhaustedError("PCRE2 match context");
  pcre2_set_match_limit(code->context, kMatchLimit);
  return TokenizerRegex(std::move(code));
}

absl::StatusOr<bool> TokenizerRegex::Find(absl::string_view subject, size_t from,
                                          RegexScratch& scratch, size_t* begin, size_t* end) const {
  auto* data = static_cast<pcre2_match_data*>(scratch.match_data());
  while (from < subject.size()) {
    const int rc = pcre2_match(code_->code, reinterpret_cast<PCRE2_SPTR>(subject.data()),
                               subject.size(), from, PCRE2_NO_UTF_CHECK, data, code_->context);
    if (rc == PCRE2_ERROR_NOMATCH) return false;
    if (rc < 0) {
      return absl::ResourceExhaustedError(
          absl::StrCat("pattern '", code_->field, "' failed on the input: ", Pcre2Message(rc)));
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
