#include "server/tokenizer/tokenizer_added_tokens.h"

namespace quantd::tokenizer {

int32_t AddedTokenMatcher::Child(int32_t node, uint8_t byte) const {
  for (const auto& [b, child] : nodes_[node].children) {
    if (b == byte) return child;
  }
  return -1;
}

void AddedTokenMatcher::Add(absl::string_view content, int32_t id) {
  int32_t node = 0;
  for (char c : content) {
    const uint8_t byte = static_cast<uint8_t>(c);
    int32_t next = Child(node, byte);
    if (next < 0) {
      next = static_cast<int32_t>(nodes_.size());
      nodes_[node].children.emplace_back(byte, next);
      nodes_.emplace_back();
    }
    node = next;
  }
  nodes_[node].id = id;
  starts_[static_cast<uint8_t>(content[0])] = true;
}

bool AddedTokenMatcher::Find(absl::string_view text, size_t from, Match* match) const {
  for (size_t begin = from; begin < text.size(); ++begin) {
    if (!starts_[static_cast<uint8_t>(text[begin])]) continue;
    int32_t node = 0;
    match->id = -1;
    for (size_t pos = begin; pos < text.size(); ++pos) {
      node = Child(node, static_cast<uint8_t>(text[pos]));
      if (node < 0) break;
      if (nodes_[node].id >= 0) {
        match->id = nodes_[node].id;
        match->end = pos + 1;
      }
    }
    if (match->id >= 0) {
      match->begin = begin;
      return true;
    }
  }
  return false;
}

}  // namespace quantd::tokenizer
