// libFuzzer target for the tokenizer.json loader (server/tokenizer/tokenizer.h): any input must
// load or give an error, never crash, hang or leak; a tokenizer that loads must encode and decode.
#include <stddef.h>
#include <stdint.h>

#include <string>

#include "server/tokenizer/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto tokenizer = quantd::tokenizer::Tokenizer::FromJson(text, "fuzz.json", "<s>");
  if (!tokenizer.ok()) return 0;
  for (const char* sample : {"Hello, world! 12345 <s> 你好 \xF0\x9F\x98\x80\n\n\t  x", ""}) {
    auto ids = (*tokenizer)->EncodeWithSpecialTokens(sample);
    if (ids.ok()) (void)(*tokenizer)->Decode(*ids);
  }
  return 0;
}
