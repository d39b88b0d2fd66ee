// libFuzzer target: SafetensorsFile::FromBytes on arbitrary bytes. Besides the sanitizers'
// checks, every accepted file must satisfy the reader's documented invariants.
#include <stddef.h>
#include <stdint.h>

#include "server/checkpoint/safetensors_reader.h"

namespace {

// Aborts (a finding for the fuzzer) when an accepted file breaks an invariant.
void Check(bool condition) {
  if (!condition) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using quantd::checkpoint::DtypeSize;
  using quantd::checkpoint::SafetensorsFile;
  using quantd::checkpoint::TensorView;
  auto file = SafetensorsFile::FromBytes("fuzz-input", data, size);
  if (!file.ok()) return 0;
  const auto& tensors = (*file)->tensors();
  // Tensors tile [data section start, end of file) in order, each the size its shape says.
  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= static_cast<uint64_t>(data[i]) << (8 * i);
  uint64_t next = 8 + header_len;
  uint8_t sum = 0;
  for (const TensorView& t : tensors) {
    Check(t.offset == next && t.data == data + t.offset);
    Check(t.size == static_cast<uint64_t>(t.numel()) * DtypeSize(t.dtype));
    Check((*file)->Find(t.name) == &t);
    for (uint64_t i = 0; i < t.size; ++i) sum += t.data[i];  // ASan checks every byte is inside
    next = t.offset + t.size;
  }
  Check(next == size);
  asm volatile("" : : "r"(sum));  // keeps the reads from being optimized away
  return 0;
}
