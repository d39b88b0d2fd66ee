// Small parameters of a layer (norm weights, mHC weights, attention sinks, compressor ape, router
// bias, tid2eid, RoPE tables) copied into a backend's memory on their first use and reused by
// every later op call, instead of one copy (an allocation, a transfer and a free) per call. The
// CUDA ops keep one for their lifetime, which is a layer task's (MakeForwardContext): the layer's
// parameters go up once and are freed with the ops.
//
// An entry is filed under an owner (the host values' address, or an object they are built from)
// and a part, and remembers the bytes it copied: a use whose bytes differ (a parameter freed and
// another allocated at the same address) copies them again into the entry, so a stale device copy
// is never read. The check is a comparison of host memory, much cheaper than the transfer.
#ifndef QUANTD_SERVER_MODEL_V4_PARAMETER_CACHE_H_
#define QUANTD_SERVER_MODEL_V4_PARAMETER_CACHE_H_

#include <stddef.h>
#include <stdint.h>

#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace quantd::model {

class ParameterCache {
 public:
  // Copies `bytes` of host memory to backend memory `dst`, after every use of `dst` queued before
  // it (a changed parameter is copied over its old values).
  using CopyIn = std::function<absl::Status(void* dst, const void* host, size_t bytes)>;

  // Copies are allocated by `backend` and filled by `copy_in`.
  ParameterCache(kernels::Backend* backend, CopyIn copy_in)
      : backend_(backend), copy_in_(std::move(copy_in)) {}

  // The backend's copy of the `bytes` at host `values`, filed under (`owner`, `part`): made on
  // the first use, and again when the bytes differ from the copied ones. Valid until the cache is
  // destroyed or the same entry is used with other bytes. Errors name `what`.
  absl::StatusOr<const void*> Get(const void* owner, int part, const void* values, size_t bytes,
                                  const std::string& what);

  int64_t uploads() const { return uploads_; }            // copies made
  int64_t upload_bytes() const { return upload_bytes_; }  // their bytes
  int64_t hits() const { return hits_; }                  // uses served without a copy
  size_t held_bytes() const { return held_bytes_; }       // backend memory held now

 private:
  struct Entry {
    std::vector<uint8_t> host;  // the bytes copied
    kernels::Buffer copy;       // in the backend's memory
  };

  kernels::Backend* backend_;
  CopyIn copy_in_;
  std::map<std::pair<const void*, int>, Entry> entries_;
  int64_t uploads_ = 0;
  int64_t upload_bytes_ = 0;
  int64_t hits_ = 0;
  size_t held_bytes_ = 0;
};

}  // namespace quantd::model

#endif  // QUANTD_SERVER_MODEL_V4_PARAMETER_CACHE_H_
