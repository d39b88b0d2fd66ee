#include "server/tokenizer/tokenizer_byte_level.h"

#include <array>

#include "server/base/utf8.h"

namespace quantd::tokenizer {

using base::NextCodePoint;

namespace {

bool StandsForItself(int b) {
  return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

// byte -> character, and character (all below U+0144) -> byte + 1 (0: not in the alphabet).
struct Alphabet {
  std::array<char32_t, 256> chars{};
  std::array<uint16_t, 0x144> bytes{};

  Alphabet() {
    char32_t next = 0x100;
    for (int b = 0; b < 256; ++b) {
      chars[b] = StandsForItself(b) ? static_cast<char32_t>(b) : next++;
      bytes[chars[b]] = static_cast<uint16_t>(b + 1);
    }
  }
};

const Alphabet& GetAlphabet() {
  static const Alphabet* const alphabet = new Alphabet();
  return *alphabet;
}

}  // namespace

char32_t ByteLevelChar(uint8_t byte) { return GetAlphabet().chars[byte]; }

std::optional<std::string> ByteLevelToBytes(absl::string_view token) {
  const Alphabet& alphabet = GetAlphabet();
  std::string out;
  out.reserve(token.size());
  size_t pos = 0;
  while (pos < token.size()) {
    const char32_t cp = NextCodePoint(token, &pos);
    if (cp >= alphabet.bytes.size() || alphabet.bytes[cp] == 0) return std::nullopt;
    out.push_back(static_cast<char>(alphabet.bytes[cp] - 1));
  }
  return out;
}

}  // namespace quantd::tokenizer
