// JSON files read from paths that a caller names (config.json, the shard index, an amax file, a
// job spec, the serve config): read under a size cap with ReadFile's checks (regular file only,
// O_NONBLOCK), nesting bounded before any parser sees the text, and errors that give the byte
// offset of a syntax error but never quote the text (it may be a secret the caller cannot read).
// Also the field readers that the parsers of quantd's own stored JSON share.
#ifndef QUANTD_SERVER_CHECKPOINT_JSON_FILE_H_
#define QUANTD_SERVER_CHECKPOINT_JSON_FILE_H_

#include <stdint.h>

#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "server/checkpoint/source_roots.h"
#include "nlohmann/json.hpp"

namespace quantd::checkpoint {

// Brackets nested deeper than this (outside string literals) are refused before parsing.
inline constexpr int kMaxJsonFileDepth = 32;

// True when brackets outside string literals nest deeper than `limit`.
bool JsonNestingExceeds(const uint8_t* text, uint64_t size, int limit);

// Parses `text`; errors start with `origin` (a path, "request").
absl::StatusOr<nlohmann::json> ParseJsonText(std::string_view text, const std::string& origin);

// ReadFile(path, max_bytes), then ParseJsonText.
// With `roots`, the opened file must lie inside them (ReadFile, naming `field`).
absl::StatusOr<nlohmann::json> ReadJsonFile(const std::string& path, uint64_t max_bytes,
                                            const SourceRoots& roots = std::nullopt,
                                            absl::string_view field = "source");

// Field readers for the parsers of what quantd stored itself (task payloads, checkpoint
// manifests). Each is false, and leaves *out alone, when `j` is not an object or its `field` is
// missing or not of the kind asked for.
// A count: an integer >= 0.
bool GetCount(const nlohmann::json& j, const char* field, int64_t* out);
// A name: the string j[field] is names[*out], 0 <= *out < n.
bool GetName(const nlohmann::json& j, const char* field, const char* const* names, int n,
             int* out);

}  // namespace quantd::checkpoint

#endif  // QUANTD_SERVER_CHECKPOINT_JSON_FILE_H_
