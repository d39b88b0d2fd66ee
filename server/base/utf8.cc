#include "server/base/utf8.h"

#include <stdint.h>

namespace quantd::base {
namespace {

// Length of the well-formed sequence at `pos`, or (as a negative number) the length of its
// maximal ill-formed prefix: the lead byte plus the continuation bytes that could still have
// completed it (Unicode 15, table 3-7). Never 0.
int SequenceAt(absl::string_view s, size_t pos) {
  const uint8_t b0 = static_cast<uint8_t>(s[pos]);
  if (b0 < 0x80) return 1;
  int need;           // continuation bytes after the lead byte
  uint8_t lo = 0x80;  // allowed range of the first continuation byte
  uint8_t hi = 0xBF;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 1;
  } else if (b0 == 0xE0) {
    need = 2, lo = 0xA0;
  } else if ((b0 >= 0xE1 && b0 <= 0xEC) || b0 == 0xEE || b0 == 0xEF) {
    need = 2;
  } else if (b0 == 0xED) {
    need = 2, hi = 0x9F;
  } else if (b0 == 0xF0) {
    need = 3, lo = 0x90;
  } else if (b0 >= 0xF1 && b0 <= 0xF3) {
    need = 3;
  } else if (b0 == 0xF4) {
    need = 3, hi = 0x8F;
  } else {
    return -1;
  }
  for (int i = 1; i <= need; ++i) {
    if (pos + i >= s.size()) return -i;
    const uint8_t b = static_cast<uint8_t>(s[pos + i]);
    if (b < lo || b > hi) return -i;
    lo = 0x80, hi = 0xBF;
  }
  return need + 1;
}

}  // namespace

std::optional<size_t> FirstInvalidUtf8(absl::string_view text) {
  size_t pos = 0;
  while (pos < text.size()) {
    if (static_cast<uint8_t>(text[pos]) < 0x80) {
      ++pos;
      continue;
    }
    const int n = SequenceAt(text, pos);
    if (n < 0) return pos;
    pos += n;
  }
  return std::nullopt;
}

std::string Utf8Lossy(absl::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t pos = 0;
  while (pos < bytes.size()) {
    const int n = SequenceAt(bytes, pos);
    if (n > 0) {
      out.append(bytes.data() + pos, n);
      pos += n;
    } else {
      out.append("\xEF\xBF\xBD");  // U+FFFD
      pos += -n;
    }
  }
  return out;
}

char32_t NextCodePoint(absl::string_view text, size_t* pos) {
  const uint8_t b0 = static_cast<uint8_t>(text[*pos]);
  int extra = b0 < 0x80 ? 0 : b0 < 0xE0 ? 1 : b0 < 0xF0 ? 2 : 3;
  char32_t cp = extra == 0 ? b0 : b0 & (0x3F >> extra);
  for (int i = 1; i <= extra; ++i) cp = (cp << 6) | (static_cast<uint8_t>(text[*pos + i]) & 0x3F);
  *pos += extra + 1;
  return cp;
}

void AppendUtf8(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

}  // namespace quantd::base
