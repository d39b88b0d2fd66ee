#include "server/tokenizer/tokenizer_bpe.h"

#include <limits>
#include <queue>

#include "absl/container/inlined_vector.h"

namespace quantd::tokenizer {
namespace {

// Words up to this many bytes take the rescanning path.
constexpr size_t kShortWord = 64;
constexpr int32_t kNoMerge = std::numeric_limits<int32_t>::max();

}  // namespace

void BpeModel::AddMerge(int32_t left, int32_t right, int32_t merged, int32_t rank) {
  merges_.insert_or_assign(PairKey(left, right), Merge{rank, merged});
}

void BpeModel::AddWord(std::string word, int32_t id) { words_.insert_or_assign(std::move(word), id); }

void BpeModel::Encode(absl::string_view word, std::vector<int32_t>* out) const {
  if (word.size() == 1) {
    out->push_back(byte_ids_[static_cast<uint8_t>(word[0])]);
    return;
  }
  if (ignore_merges_) {
    if (auto it = words_.find(word); it != words_.end()) {
      out->push_back(it->second);
      return;
    }
  }
  if (word.size() <= kShortWord) {
    EncodeShort(word, out);
  } else {
    EncodeLong(word, out);
  }
}

void BpeModel::EncodeShort(absl::string_view word, std::vector<int32_t>* out) const {
  absl::InlinedVector<int32_t, kShortWord> symbols;
  for (char c : word) symbols.push_back(byte_ids_[static_cast<uint8_t>(c)]);
  // ranks[i]: the merge of symbols[i] and symbols[i + 1].
  absl::InlinedVector<Merge, kShortWord> merges;
  for (size_t i = 0; i + 1 < symbols.size(); ++i) {
    const Merge* m = FindMerge(symbols[i], symbols[i + 1]);
    merges.push_back(m ? *m : Merge{kNoMerge, -1});
  }
  while (!merges.empty()) {
    size_t best = 0;
    for (size_t i = 1; i < merges.size(); ++i) {
      if (merges[i].rank < merges[best].rank) best = i;
    }
    if (merges[best].rank == kNoMerge) break;
    symbols[best] = merges[best].merged;
    symbols.erase(symbols.begin() + best + 1);
    merges.erase(merges.begin() + best);
    if (best > 0) {
      const Merge* m = FindMerge(symbols[best - 1], symbols[best]);
      merges[best - 1] = m ? *m : Merge{kNoMerge, -1};
    }
    if (best < merges.size()) {
      const Merge* m = FindMerge(symbols[best], symbols[best + 1]);
      merges[best] = m ? *m : Merge{kNoMerge, -1};
    }
  }
  out->insert(out->end(), symbols.begin(), symbols.end());
}

void BpeModel::EncodeLong(absl::string_view word, std::vector<int32_t>* out) const {
  // A doubly linked list over the byte positions; a merge keeps the left symbol's position.
  struct Symbol {
    int32_t id;
    int32_t prev;  // -1: first
    int32_t next;  // -1: last
    bool alive;
  };
  const int32_t n = static_cast<int32_t>(word.size());
  std::vector<Symbol> symbols(n);
  for (int32_t i = 0; i < n; ++i) {
    symbols[i] = Symbol{byte_ids_[static_cast<uint8_t>(word[i])], i - 1, i + 1 < n ? i + 1 : -1, true};
  }
  // Candidates ordered by (rank, position), smallest first; stale ones are skipped when popped.
  struct Candidate {
    int32_t rank;
    int32_t pos;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
  auto push = [&](int32_t pos) {
    const int32_t next = symbols[pos].next;
    if (next < 0) return;
    if (const Merge* m = FindMerge(symbols[pos].id, symbols[next].id)) queue.push({m->rank, pos});
  };
  for (int32_t i = 0; i + 1 < n; ++i) push(i);
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[top.pos];
    if (!left.alive || left.next < 0) continue;
    const Merge* m = FindMerge(left.id, symbols[left.next].id);
    if (m == nullptr || m->rank != top.rank) continue;  // the pair changed since it was queued
    Symbol& right = symbols[left.next];
    right.alive = false;
    left.id = m->merged;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = top.pos;
    if (left.prev >= 0) push(left.prev);
    push(top.pos);
  }
  for (int32_t i = 0; i >= 0; i = symbols[i].next) out->push_back(symbols[i].id);
}

}  // namespace quantd::tokenizer
