// The proto3 JSON that `quantctl -o json` prints: canonical lowerCamelCase names, enum names
// ("state": "RUNNING"), every primitive field present, one object per line.
#ifndef QUANTD_CLIENT_JOB_JSON_H_
#define QUANTD_CLIENT_JOB_JSON_H_

#include <string>

#include "absl/status/statusor.h"
#include "google/protobuf/message.h"

namespace quantd::client {

// One line of JSON, without the trailing newline.
absl::StatusOr<std::string> MessageToJson(const google::protobuf::Message& message);

}  // namespace quantd::client

#endif  // QUANTD_CLIENT_JOB_JSON_H_
