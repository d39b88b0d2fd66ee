#include "server/api/token_file.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace quantd::api {
namespace {

constexpr size_t kMinTokenLength = 16;
constexpr size_t kMaxTokenLength = 1024;
constexpr off_t kMaxTokenFileBytes = 4096;

absl::Status Invalid(const std::string& path, const std::string& rule) {
  return absl::InvalidArgumentError(absl::StrCat("token file ", path, ": ", rule));
}

}  // namespace

absl::StatusOr<std::string> ReadTokenFile(const std::string& path, TokenFileAccess access) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer; the fstat below refuses it.
  const int fd = open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return Invalid(path, absl::StrCat("cannot open (", strerror(errno), ")"));
  struct stat st = {};
  std::string text;
  absl::Status status;
  if (fstat(fd, &st) != 0) {
    status = Invalid(path, absl::StrCat("cannot stat (", strerror(errno), ")"));
  } else if (!S_ISREG(st.st_mode)) {
    status = Invalid(path, "not a regular file");
  } else if (access == TokenFileAccess::kPrivate && (st.st_mode & 077) != 0) {
    status = Invalid(path, absl::StrFormat("readable by group or others (mode %04o); chmod 600 it",
                                           st.st_mode & 07777));
  } else if (st.st_size > kMaxTokenFileBytes) {
    status = Invalid(path, absl::StrCat("larger than ", kMaxTokenFileBytes, " bytes"));
  } else {
    text.resize(static_cast<size_t>(st.st_size));
    const ssize_t n = pread(fd, text.data(), text.size(), 0);
    if (n != static_cast<ssize_t>(text.size())) status = Invalid(path, "short read");
  }
  close(fd);
  if (!status.ok()) return status;

  if (!text.empty() && text.back() == '\n') text.pop_back();
  if (!text.empty() && text.back() == '\r') text.pop_back();
  if (text.size() < kMinTokenLength || text.size() > kMaxTokenLength) {
    return Invalid(path, absl::StrCat("the token must have ", kMinTokenLength, " to ",
                                      kMaxTokenLength, " characters, it has ", text.size()));
  }
  for (size_t i = 0; i < text.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c <= 0x20 || c >= 0x7f) {
      return Invalid(path, absl::StrCat("the token must be printable ASCII without spaces; byte ",
                                        i, " is not"));
    }
  }
  return text;
}

}  // namespace quantd::api
