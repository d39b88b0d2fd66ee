#include "server/checkpoint/json_file.h"

#include "absl/strings/str_cat.h"
#include "server/checkpoint/atomic_file.h"

namespace quantd::checkpoint {

bool JsonNestingExceeds(const uint8_t* text, uint64_t size, int limit) {
  int depth = 0;
  bool in_string = false;
  for (uint64_t i = 0; i < size; ++i) {
    uint8_t c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;  // the escaped character cannot end the string
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > limit) return true;
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return false;
}

absl::StatusOr<nlohmann::json> ParseJsonText(std::string_view text, const std::string& origin) {
  if (JsonNestingExceeds(reinterpret_cast<const uint8_t*>(text.data()), text.size(),
                         kMaxJsonFileDepth)) {
    return absl::InvalidArgumentError(
        absl::StrCat(origin, ": JSON nests deeper than ", kMaxJsonFileDepth, " levels"));
  }
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    // e.what() quotes the text around the error; the offset alone is enough to find it.
    return absl::InvalidArgumentError(
        absl::StrCat(origin, ": not valid JSON (syntax error at byte ", e.byte, ")"));
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(origin, ": not valid JSON"));
  }
}

absl::StatusOr<nlohmann::json> ReadJsonFile(const std::string& path, uint64_t max_bytes,
                                            const SourceRoots& roots, absl::string_view field) {
  absl::StatusOr<std::string> text = ReadFile(path, max_bytes, roots, field);
  if (!text.ok()) return text.status();
  return ParseJsonText(*text, path);
}

bool GetCount(const nlohmann::json& j, const char* field, int64_t* out) {
  if (!j.is_object() || !j.contains(field)) return false;
  const nlohmann::json& v = j[field];
  if (!v.is_number_integer() || v.get<int64_t>() < 0) return false;
  *out = v.get<int64_t>();
  return true;
}

bool GetName(const nlohmann::json& j, const char* field, const char* const* names, int n,
             int* out) {
  if (!j.is_object() || !j.contains(field) || !j[field].is_string()) return false;
  const std::string& name = j[field].get_ref<const std::string&>();
  for (int i = 0; i < n; ++i) {
    if (name == names[i]) {
      *out = i;
      return true;
    }
  }
  return false;
}

}  // namespace quantd::checkpoint
