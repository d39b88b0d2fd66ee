// Byte-level BPE: a word (the bytes of one pre-tokenized piece) starts as one symbol per byte and
// adjacent symbols are merged, lowest merge rank first and leftmost among equal ranks, until no
// adjacent pair has a merge. This is the `tokenizers` BPE model with its options at their
// defaults (no dropout, no unknown token, no subword prefix or suffix).
#ifndef QUANTD_SERVER_TOKENIZER_TOKENIZER_BPE_H_
#define QUANTD_SERVER_TOKENIZER_TOKENIZER_BPE_H_

#include <stdint.h>

#include <array>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/container/flat_hash_map.h"

namespace quantd::tokenizer {

class BpeModel {
 public:
  // `byte_ids[b]`: the token of the single byte b. `ignore_merges`: a word that is itself a
  // token is that token, whatever the merges would make of it.
  BpeModel(std::array<int32_t, 256> byte_ids, bool ignore_merges)
      : byte_ids_(byte_ids), ignore_merges_(ignore_merges) {}

  // Merge number `rank` joins tokens `left` and `right` into `merged`. A later merge of the same
  // pair replaces an earlier one (as in `tokenizers`).
  void AddMerge(int32_t left, int32_t right, int32_t merged, int32_t rank);
  // Registers a whole-word token for `ignore_merges`.
  void AddWord(std::string word, int32_t id);

  // Appends the tokens of `word` (non-empty) to `out`.
  void Encode(absl::string_view word, std::vector<int32_t>* out) const;

 private:
  struct Merge {
    int32_t rank;
    int32_t merged;
  };
  static uint64_t PairKey(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
  }
  const Merge* FindMerge(int32_t left, int32_t right) const {
    auto it = merges_.find(PairKey(left, right));
    return it == merges_.end() ? nullptr : &it->second;
  }
  // Short words: rescan the pairs after each merge. Long words: a heap of candidate merges, so a
  // run of thousands of spaces costs O(n log n) rather than O(n^2).
  void EncodeShort(absl::string_view word, std::vector<int32_t>* out) const;
  void EncodeLong(absl::string_view word, std::vector<int32_t>* out) const;

  std::array<int32_t, 256> byte_ids_;
  bool ignore_merges_;
  absl::flat_hash_map<uint64_t, Merge> merges_;         // (left, right) -> merge
  absl::flat_hash_map<std::string, int32_t> words_;     // ignore_merges only: bytes -> token
};

}  // namespace quantd::tokenizer

#endif  // QUANTD_SERVER_TOKENIZER_TOKENIZER_BPE_H_
