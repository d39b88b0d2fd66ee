#include "client/job_json.h"

#include <google/protobuf/util/json_util.h>

#include "absl/strings/str_cat.h"

namespace quantd::client {

absl::StatusOr<std::string> MessageToJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = false;                // one line: `watch -o json` is JSON Lines
  options.always_print_primitive_fields = true;  // scripts see every field, zeros included
  options.always_print_enums_as_ints = false;    // "state": "RUNNING"
  options.preserve_proto_field_names = false;    // lowerCamelCase, the canonical proto3 JSON
  std::string out;
  const auto status = google::protobuf::util::MessageToJsonString(message, &out, options);
  if (!status.ok()) {
    return absl::InternalError(
        absl::StrCat("cannot print ", message.GetTypeName(), " as JSON: ", status.ToString()));
  }
  return out;
}

}  // namespace quantd::client
