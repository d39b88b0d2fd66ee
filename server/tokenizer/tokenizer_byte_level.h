// The byte-level alphabet of GPT-2 style BPE (the `tokenizers` ByteLevel pre-tokenizer and
// decoder): every byte is shown as one printable character. Printable Latin-1 bytes ('!'..'~',
// U+00A1..U+00AC, U+00AE..U+00FF) stand for themselves; the other 68 bytes, in increasing order,
// become U+0100, U+0101, ... (so the space 0x20 is 'Ġ' U+0120, '\n' is 'Ċ' U+010A).
//
// quantd's BPE works on raw bytes, so this alphabet only matters where tokenizer.json spells
// tokens: the vocabulary and the merges are translated back to bytes when the file is loaded.
#ifndef QUANTD_SERVER_TOKENIZER_TOKENIZER_BYTE_LEVEL_H_
#define QUANTD_SERVER_TOKENIZER_TOKENIZER_BYTE_LEVEL_H_

#include <stdint.h>

#include <optional>
#include <string>
#include "absl/strings/string_view.h"

namespace quantd::tokenizer {

// The character that stands for `byte`.
char32_t ByteLevelChar(uint8_t byte);

// The bytes a token spelled in the byte-level alphabet stands for; nullopt when `token` (valid
// UTF-8) has a character outside the alphabet.
std::optional<std::string> ByteLevelToBytes(absl::string_view token);

}  // namespace quantd::tokenizer

#endif  // QUANTD_SERVER_TOKENIZER_TOKENIZER_BYTE_LEVEL_H_
