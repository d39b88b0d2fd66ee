// UTF-8 helpers: strict validation of input text (job spec paths, tokenizer input), and the lossy
// conversion that tokenizer decoding needs (byte-level tokens may end inside a character).
#ifndef QUANTD_SERVER_BASE_UTF8_H_
#define QUANTD_SERVER_BASE_UTF8_H_

#include <stddef.h>

#include <optional>
#include <string>
#include "absl/strings/string_view.h"

namespace quantd::base {

// Offset of the first byte that does not start a well-formed UTF-8 sequence (overlong forms,
// surrogates and code points above U+10FFFF are ill-formed); nullopt when `text` is valid.
std::optional<size_t> FirstInvalidUtf8(absl::string_view text);

// `bytes` with every maximal ill-formed subsequence replaced by U+FFFD, as Unicode recommends
// and Rust's String::from_utf8_lossy (hence the `tokenizers` library) does.
std::string Utf8Lossy(absl::string_view bytes);

// Decodes the code point at `*pos` of valid UTF-8 `text` and advances `*pos` past it.
char32_t NextCodePoint(absl::string_view text, size_t* pos);

// Appends the UTF-8 encoding of `cp` (at most U+10FFFF) to `out`.
void AppendUtf8(char32_t cp, std::string* out);

}  // namespace quantd::base

#endif  // QUANTD_SERVER_BASE_UTF8_H_
