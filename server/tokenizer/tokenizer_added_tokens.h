// Finds added tokens (special tokens such as <｜begin▁of▁sentence｜>, and the other entries of
// tokenizer.json's added_tokens) in text before BPE sees it, as the `tokenizers` library does:
// scanning left to right, the match that starts first wins, and of those the longest.
#ifndef QUANTD_SERVER_TOKENIZER_TOKENIZER_ADDED_TOKENS_H_
#define QUANTD_SERVER_TOKENIZER_TOKENIZER_ADDED_TOKENS_H_

#include <stddef.h>
#include <stdint.h>

#include <array>
#include "absl/strings/string_view.h"
#include <utility>
#include <vector>

namespace quantd::tokenizer {

class AddedTokenMatcher {
 public:
  // `content` must be non-empty; a second token with the same content replaces the first's id.
  void Add(absl::string_view content, int32_t id);
  bool empty() const { return nodes_.size() <= 1; }

  struct Match {
    size_t begin = 0;
    size_t end = 0;
    int32_t id = -1;
  };
  // The leftmost-longest match in text[from, text.size()); false when there is none.
  bool Find(absl::string_view text, size_t from, Match* match) const;

 private:
  struct Node {
    std::vector<std::pair<uint8_t, int32_t>> children;  // byte -> node index
    int32_t id = -1;                                    // token ending here, or -1
  };
  int32_t Child(int32_t node, uint8_t byte) const;

  std::vector<Node> nodes_ = std::vector<Node>(1);  // a byte trie; node 0 is the root
  std::array<bool, 256> starts_{};                 // bytes some token starts with
};

}  // namespace quantd::tokenizer

#endif  // QUANTD_SERVER_TOKENIZER_TOKENIZER_ADDED_TOKENS_H_
