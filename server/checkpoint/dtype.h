// safetensors element types that quantd reads or writes.
#ifndef QUANTD_SERVER_CHECKPOINT_DTYPE_H_
#define QUANTD_SERVER_CHECKPOINT_DTYPE_H_

#include <stddef.h>

#include <optional>
#include <string_view>

namespace quantd::checkpoint {

enum class Dtype {
  kBool,
  kU8,
  kI8,
  kI32,
  kI64,
  kF8E4M3,  // "F8_E4M3" (E4M3FN)
  kF8E8M0,  // "F8_E8M0"
  kBF16,
  kF16,
  kF32,
  kF64,
};

// Every Dtype, in enum order (for tests and tables).
inline constexpr Dtype kAllDtypes[] = {
    Dtype::kBool, Dtype::kU8,   Dtype::kI8,  Dtype::kI32, Dtype::kI64, Dtype::kF8E4M3,
    Dtype::kF8E8M0, Dtype::kBF16, Dtype::kF16, Dtype::kF32, Dtype::kF64,
};

// The safetensors spelling ("BF16", "F8_E4M3", ...).
std::string_view DtypeName(Dtype d);
// Inverse of DtypeName; nullopt for a name quantd does not handle.
std::optional<Dtype> ParseDtype(std::string_view name);
size_t DtypeSize(Dtype d);

}  // namespace quantd::checkpoint

#endif  // QUANTD_SERVER_CHECKPOINT_DTYPE_H_
