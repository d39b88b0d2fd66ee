// Excerpt: how an error message quotes text that came from outside (a name in a checkpoint's
// JSON, a tensor name, a model_type): hostile text can be megabytes long or hold control bytes,
// and an error is stored, logged and sent to every client that lists the job.
#ifndef QUANTD_SERVER_BASE_EXCERPT_H_
#define QUANTD_SERVER_BASE_EXCERPT_H_

#include <stddef.h>

#include <algorithm>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace quantd::base {

// The most bytes of the text that an excerpt shows.
inline constexpr size_t kMaxExcerptBytes = 200;

// `text` in double quotes, its first `max_bytes` bytes only (then "..." inside the quotes), with
// quotes, backslashes, control and non-ASCII bytes escaped (absl::CHexEscape): at most
// 4 * max_bytes + 5 bytes whatever the text.
inline std::string Excerpt(absl::string_view text, size_t max_bytes = kMaxExcerptBytes) {
  const absl::string_view shown = text.substr(0, std::min(text.size(), max_bytes));
  return absl::StrCat("\"", absl::CHexEscape(shown), text.size() > max_bytes ? "...\"" : "\"");
}

}  // namespace quantd::base

#endif  // QUANTD_SERVER_BASE_EXCERPT_H_
