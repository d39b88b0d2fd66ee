#include "server/model/tokenizer_regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "absl/strings/str_cat.h"

namespace quantd::model {
namespace {

// Backtracking steps one match may take before PCRE2 gives up; tokenizer patterns need a few
// per character, so this only stops patterns that backtrack exponentially.
constexpr uint32_t kMatchLimit = 10'000'000;

std::string Pcre2Message(int code) {
  PCRE2_UCHAR buffer[256];
  if (pcre2_get_error_message(code, buffer, sizeof(buffer)) < 0) return absl::StrCat("error ", code);
  return reinterpret_cast<const char*>(buffer);
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
  const uint32_t options = PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0);
  code->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options,
                             &error, &offset, nullptr);
  if (code->code == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("field '", field, "': PCRE2 rejects the pattern (",
                                                   Pcre2Message(error), " at offset ", offset, ")"));
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

}  // namespace quantd::model
