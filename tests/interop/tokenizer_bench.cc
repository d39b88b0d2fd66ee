// quantd_tokenizer_bench DIR CORPUS.jsonl PASSES: encodes every JSON string of CORPUS (one per
// line) PASSES times on one thread with DIR/tokenizer.json (after one untimed warm-up pass) and
// prints {"tokens": N, "seconds": S, "tokens_per_second": R} for the timed passes.
// tests/bench/run_tokenizer_bench.sh compares it with the `tokenizers` library in the same run.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "server/tokenizer/tokenizer.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: %s TOKENIZER_DIR CORPUS.jsonl PASSES\n", argv[0]);
    return 2;
  }
  auto tokenizer = quantd::tokenizer::Tokenizer::LoadDir(argv[1]);
  if (!tokenizer.ok()) {
    fprintf(stderr, "%s\n", std::string(tokenizer.status().message()).c_str());
    return 1;
  }
  std::ifstream in(argv[2]);
  std::vector<std::string> corpus;
  for (std::string line; std::getline(in, line);) {
    nlohmann::json value = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!value.is_string()) {
      fprintf(stderr, "%s: line %zu is not a JSON string\n", argv[2], corpus.size() + 1);
      return 1;
    }
    corpus.push_back(value.get<std::string>());
  }
  const int passes = atoi(argv[3]);
  int64_t tokens = 0;
  double seconds = 0;
  for (int pass = -1; pass < passes; ++pass) {  // pass -1 warms up
    const auto start = std::chrono::steady_clock::now();
    int64_t n = 0;
    for (const std::string& text : corpus) {
      auto ids = (*tokenizer)->Encode(text);
      if (!ids.ok()) {
        fprintf(stderr, "%s\n", std::string(ids.status().message()).c_str());
        return 1;
      }
      n += static_cast<int64_t>(ids->size());
    }
    if (pass >= 0) {
      seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      tokens += n;
    }
  }
  printf("{\"tokens\": %lld, \"seconds\": %.6f, \"tokens_per_second\": %.1f}\n",
         static_cast<long long>(tokens), seconds, tokens / seconds);
  return 0;
}
