// Incremental SHA-256 (OpenSSL's EVP implementation, which uses the CPU's SHA extensions where
// present). Task outputs are recorded with their checksum in the same transaction that marks the
// task done.
#ifndef QUANTD_SERVER_CHECKPOINT_SHA256_H_
#define QUANTD_SERVER_CHECKPOINT_SHA256_H_

#include <stddef.h>

#include <stdint.h>

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace quantd::checkpoint {

class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;

  void Update(const void* data, size_t size);
  // Lowercase hex digest; the object must not be updated afterwards.
  std::string HexDigest();

 private:
  void* ctx_;  // EVP_MD_CTX*, kept opaque so callers need no OpenSSL headers
};

// SHA-256 of a whole file, read in large chunks; errors name the path. `on_chunk`, when given, is
// called with the size of each chunk once it is hashed; an error from it stops the read and is
// returned as it is (a cancelled task, ...).
absl::StatusOr<std::string> Sha256File(
    const std::string& path, const std::function<absl::Status(uint64_t)>& on_chunk = {});

}  // namespace quantd::checkpoint

#endif  // QUANTD_SERVER_CHECKPOINT_SHA256_H_
