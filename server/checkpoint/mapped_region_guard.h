// Survives a mapped file that shrinks under the process. Reading a page of a file mapping that
// lies past the file's (new) end raises SIGBUS, which by default kills the whole daemon; quantd
// maps source shards for zero-copy reads, and anyone who can write a source file can truncate it.
//
// The guard installs one process-wide SIGBUS handler. A fault inside a registered region is
// absorbed: the handler maps a page of zeros over the faulting page (so the read completes) and
// marks the region faulted. The region's owner asks Faulted() before it trusts what it read and
// turns a fault into DataLoss for the one job that read it (the scheme systemd's journal uses).
// A fault anywhere else restores the default action, so real bugs still crash.
//
// Cost: nothing on the read path; a few atomics per Register/Unregister.
#ifndef QUANTD_SERVER_CHECKPOINT_MAPPED_REGION_GUARD_H_
#define QUANTD_SERVER_CHECKPOINT_MAPPED_REGION_GUARD_H_

#include <stddef.h>

#include "absl/status/statusor.h"

namespace quantd::checkpoint {

// Regions registered at once, at most (one per open shard mapping).
inline constexpr int kMaxGuardedRegions = 4096;

// Installs the handler on first use and registers [begin, begin + size). Returns the region's
// slot; ResourceExhausted when kMaxGuardedRegions regions are registered.
absl::StatusOr<int> RegisterMappedRegion(const void* begin, size_t size);
// Forgets a region (before it is unmapped).
void UnregisterMappedRegion(int slot);
// Whether a read of the region faulted (its file shrank) since it was registered.
bool MappedRegionFaulted(int slot);

}  // namespace quantd::checkpoint

#endif  // QUANTD_SERVER_CHECKPOINT_MAPPED_REGION_GUARD_H_
