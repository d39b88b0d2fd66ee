#include "server/checkpoint/sha256.h"

#include <errno.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <string.h>
#include <unistd.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "server/checkpoint/atomic_file.h"

namespace quantd::checkpoint {

Sha256::Sha256() : ctx_(EVP_MD_CTX_new()) {
  EVP_DigestInit_ex(static_cast<EVP_MD_CTX*>(ctx_), EVP_sha256(), nullptr);
}

Sha256::~Sha256() { EVP_MD_CTX_free(static_cast<EVP_MD_CTX*>(ctx_)); }

void Sha256::Update(const void* data, size_t size) {
  EVP_DigestUpdate(static_cast<EVP_MD_CTX*>(ctx_), data, size);
}

std::string Sha256::HexDigest() {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_DigestFinal_ex(static_cast<EVP_MD_CTX*>(ctx_), digest, &len);
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned int i = 0; i < len; ++i) {
    out.push_back(kHex[digest[i] >> 4]);
    out.push_back(kHex[digest[i] & 0xF]);
  }
  return out;
}

absl::StatusOr<std::string> Sha256File(const std::string& path,
                                       const std::function<absl::Status(uint64_t)>& on_chunk) {
  struct stat st;
  absl::StatusOr<int> opened = OpenRegularFile(path, /*follow_symlink=*/false, &st);
  if (!opened.ok()) return opened.status();
  const int fd = *opened;
  Sha256 hash;
  std::vector<char> buf(4 << 20);
  while (true) {
    const ssize_t n = read(fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      close(fd);
      return absl::UnavailableError(absl::StrCat("reading ", path, ": ", strerror(err)));
    }
    if (n == 0) break;
    hash.Update(buf.data(), static_cast<size_t>(n));
    if (!on_chunk) continue;
    if (absl::Status s = on_chunk(static_cast<uint64_t>(n)); !s.ok()) {
      close(fd);
      return s;
    }
  }
  close(fd);
  return hash.HexDigest();
}

}  // namespace quantd::checkpoint
