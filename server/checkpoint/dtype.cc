#include "server/checkpoint/dtype.h"

namespace quantd::checkpoint {
namespace {

struct DtypeInfo {
  Dtype dtype;
  std::string_view name;  // safetensors spelling
  size_t size;            // bytes per element
};

constexpr DtypeInfo kDtypes[] = {
    {Dtype::kBool, "BOOL", 1},      {Dtype::kU8, "U8", 1},   {Dtype::kI8, "I8", 1},
    {Dtype::kI32, "I32", 4},        {Dtype::kI64, "I64", 8}, {Dtype::kF8E4M3, "F8_E4M3", 1},
    {Dtype::kF8E8M0, "F8_E8M0", 1}, {Dtype::kBF16, "BF16", 2}, {Dtype::kF16, "F16", 2},
    {Dtype::kF32, "F32", 4},        {Dtype::kF64, "F64", 8},
};

const DtypeInfo& Info(Dtype d) {
  for (const DtypeInfo& info : kDtypes) {
    if (info.dtype == d) return info;
  }
  return kDtypes[0];  // unreachable for a valid enumerator
}

}  // namespace

std::string_view DtypeName(Dtype d) { return Info(d).name; }

std::optional<Dtype> ParseDtype(std::string_view name) {
  for (const DtypeInfo& info : kDtypes) {
    if (info.name == name) return info.dtype;
  }
  return std::nullopt;
}

size_t DtypeSize(Dtype d) { return Info(d).size; }

}  // namespace quantd::checkpoint
