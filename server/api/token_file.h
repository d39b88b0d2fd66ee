// Bearer tokens kept in files (quantd serve --token-file, quantctl --token-file, and the
// "token_file" entries of the access config). The file holds one token: 16 to 1024 printable
// ASCII characters without spaces, optionally followed by a newline. Errors name the file and the
// rule that failed, never the file's content.
#ifndef QUANTD_SERVER_API_TOKEN_FILE_H_
#define QUANTD_SERVER_API_TOKEN_FILE_H_

#include <string>

#include "absl/status/statusor.h"

namespace quantd::api {

enum class TokenFileAccess {
  kPrivate,  // the daemon's side: the file must not be readable by group or others (mode 0600)
  kAny,      // the client's side: the caller chose the file
};

// Reads the token in `path`. The file must be a regular file (a symlink, FIFO or device is
// refused before any read) of at most 4 KiB. InvalidArgument otherwise.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path, TokenFileAccess access);

}  // namespace quantd::api

#endif  // QUANTD_SERVER_API_TOKEN_FILE_H_
