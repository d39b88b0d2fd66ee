// libstdc++'s selection algorithms (GCC 12 bits/stl_algo.h and bits/stl_heap.h: partial_sort,
// nth_element, sort) transcribed step by step for one device thread, so that the CUDA indexer
// picks (v4_attention_blocks.h) resolve equal scores exactly as the CPU's SelectTopEntries
// (server/model/v4_indexer.h), which calls those algorithms: with ties, the order and even the
// set of the picked entries depends on the algorithm's every swap, so no other top-k can match.
// Compiled for host and device; v4_cuda_attention_test checks the host build against the
// library's own algorithms on the machine that runs it.
//
// Iterators become indices over a ScoredEntry array; the introsort recursion (right part first,
// then the loop on the left part) becomes an explicit stack: the two parts are disjoint and
// each part's result depends only on its own elements and its depth limit, so the order in
// which they are sorted does not change the result.
#ifndef QUANTD_KERNELS_CUDA_LIBSTDCXX_SELECTION_H_
#define QUANTD_KERNELS_CUDA_LIBSTDCXX_SELECTION_H_

#include <stdint.h>

#include "kernels/formats.h"

#if defined(__CUDACC__)
#define QUANTD_SELECT_HD __host__ __device__ inline
#else
#define QUANTD_SELECT_HD inline
#endif

namespace quantd::kernels::cuda {

// The CPU's (score, entry) pair; its comparator is Better.
struct ScoredEntry {
  float score;
  int32_t entry;
};

// The CPU's `better`: a.score > b.score (entries do not take part).
QUANTD_SELECT_HD bool Better(const ScoredEntry& a, const ScoredEntry& b) {
  return a.score > b.score;
}

namespace libstdcxx {

QUANTD_SELECT_HD void Swap(ScoredEntry* v, int64_t a, int64_t b) {
  const ScoredEntry t = v[a];
  v[a] = v[b];
  v[b] = t;
}

// std::__lg: floor(log2(n)) for n > 0.
QUANTD_SELECT_HD int64_t Lg(int64_t n) {
  int64_t lg = 0;
  while (n > 1) {
    n >>= 1;
    ++lg;
  }
  return lg;
}

// std::__push_heap over v[0, ...).
QUANTD_SELECT_HD void PushHeap(ScoredEntry* v, int64_t hole, int64_t top, ScoredEntry value) {
  int64_t parent = (hole - 1) / 2;
  while (hole > top && Better(v[parent], value)) {
    v[hole] = v[parent];
    hole = parent;
    parent = (hole - 1) / 2;
  }
  v[hole] = value;
}

// std::__adjust_heap.
QUANTD_SELECT_HD void AdjustHeap(ScoredEntry* v, int64_t hole, int64_t len, ScoredEntry value) {
  const int64_t top = hole;
  int64_t second = hole;
  while (second < (len - 1) / 2) {
    second = 2 * (second + 1);
    if (Better(v[second], v[second - 1])) second--;
    v[hole] = v[second];
    hole = second;
  }
  if ((len & 1) == 0 && second == (len - 2) / 2) {
    second = 2 * (second + 1);
    v[hole] = v[second - 1];
    hole = second - 1;
  }
  PushHeap(v, hole, top, value);
}

// std::__pop_heap(first, last, result): v[result] gets the heap's top, the heap [0, len)
// takes the old v[result].
QUANTD_SELECT_HD void PopHeap(ScoredEntry* v, int64_t len, int64_t result) {
  const ScoredEntry value = v[result];
  v[result] = v[0];
  AdjustHeap(v, 0, len, value);
}

// std::__make_heap over v[0, len).
QUANTD_SELECT_HD void MakeHeap(ScoredEntry* v, int64_t len) {
  if (len < 2) return;
  int64_t parent = (len - 2) / 2;
  while (true) {
    AdjustHeap(v, parent, len, v[parent]);
    if (parent == 0) return;
    parent--;
  }
}

// std::__heap_select(first, first + middle, first + last).
QUANTD_SELECT_HD void HeapSelect(ScoredEntry* v, int64_t middle, int64_t last) {
  MakeHeap(v, middle);
  for (int64_t i = middle; i < last; ++i) {
    if (Better(v[i], v[0])) PopHeap(v, middle, i);
  }
}

// std::__sort_heap over v[0, len).
QUANTD_SELECT_HD void SortHeap(ScoredEntry* v, int64_t len) {
  while (len > 1) {
    --len;
    PopHeap(v, len, len);
  }
}

// std::__move_median_to_first(result, a, b, c).
QUANTD_SELECT_HD void MoveMedianToFirst(ScoredEntry* v, int64_t result, int64_t a, int64_t b,
                                        int64_t c) {
  if (Better(v[a], v[b])) {
    if (Better(v[b], v[c])) {
      Swap(v, result, b);
    } else if (Better(v[a], v[c])) {
      Swap(v, result, c);
    } else {
      Swap(v, result, a);
    }
  } else if (Better(v[a], v[c])) {
    Swap(v, result, a);
  } else if (Better(v[b], v[c])) {
    Swap(v, result, c);
  } else {
    Swap(v, result, b);
  }
}

// std::__unguarded_partition_pivot over v[first, last): returns the cut.
QUANTD_SELECT_HD int64_t UnguardedPartitionPivot(ScoredEntry* v, int64_t first, int64_t last) {
  const int64_t mid = first + (last - first) / 2;
  MoveMedianToFirst(v, first, first + 1, mid, last - 1);
  const int64_t pivot = first;
  ++first;  // std::__unguarded_partition(first + 1, last, first)
  while (true) {
    while (Better(v[first], v[pivot])) ++first;
    --last;
    while (Better(v[pivot], v[last])) --last;
    if (!(first < last)) return first;
    Swap(v, first, last);
    ++first;
  }
}

// std::__unguarded_linear_insert(v + last).
QUANTD_SELECT_HD void UnguardedLinearInsert(ScoredEntry* v, int64_t last) {
  const ScoredEntry value = v[last];
  int64_t next = last - 1;
  while (Better(value, v[next])) {
    v[last] = v[next];
    last = next;
    --next;
  }
  v[last] = value;
}

// std::__insertion_sort over v[first, last).
QUANTD_SELECT_HD void InsertionSort(ScoredEntry* v, int64_t first, int64_t last) {
  if (first == last) return;
  for (int64_t i = first + 1; i != last; ++i) {
    if (Better(v[i], v[first])) {
      const ScoredEntry value = v[i];
      for (int64_t j = i; j > first; --j) v[j] = v[j - 1];  // std::move_backward
      v[first] = value;
    } else {
      UnguardedLinearInsert(v, i);
    }
  }
}

// std::sort over v[0, len), len < 2^31: __introsort_loop (threshold 16) then
// __final_insertion_sort.
QUANTD_SELECT_HD void Sort(ScoredEntry* v, int64_t len) {
  constexpr int64_t kThreshold = 16;  // _S_threshold
  if (len == 0) return;
  // Pending parts (first, last, depth limit). Depths strictly decrease from the bottom of the
  // stack to its top (a part pushes only parts of smaller depth), so it never holds more than
  // 2 * Lg(len) + 1 <= 61 parts.
  struct Part {
    int64_t first, last, depth;
  };
  Part stack[64];
  int top = 0;
  stack[top++] = {0, len, 2 * Lg(len)};
  while (top > 0) {
    Part p = stack[--top];
    while (p.last - p.first > kThreshold) {
      if (p.depth == 0) {  // std::__partial_sort(first, last, last)
        HeapSelect(v + p.first, p.last - p.first, p.last - p.first);
        SortHeap(v + p.first, p.last - p.first);
        break;
      }
      --p.depth;
      const int64_t cut = UnguardedPartitionPivot(v, p.first, p.last);
      stack[top++] = {cut, p.last, p.depth};
      p.last = cut;
    }
  }
  if (len > kThreshold) {
    InsertionSort(v, 0, kThreshold);
    for (int64_t i = kThreshold; i != len; ++i) UnguardedLinearInsert(v, i);
  } else {
    InsertionSort(v, 0, len);
  }
}

// std::nth_element(v, v + nth, v + len).
QUANTD_SELECT_HD void NthElement(ScoredEntry* v, int64_t nth, int64_t len) {
  if (len == 0 || nth == len) return;
  int64_t first = 0, last = len;
  int64_t depth = 2 * Lg(len);
  while (last - first > 3) {
    if (depth == 0) {
      HeapSelect(v + first, nth + 1 - first, last - first);
      Swap(v, first, nth);
      return;
    }
    --depth;
    const int64_t cut = UnguardedPartitionPivot(v, first, last);
    if (cut <= nth) {
      first = cut;
    } else {
      last = cut;
    }
  }
  InsertionSort(v, first, last);
}

// std::partial_sort(v, v + middle, v + len).
QUANTD_SELECT_HD void PartialSort(ScoredEntry* v, int64_t middle, int64_t len) {
  HeapSelect(v, middle, len);
  SortHeap(v, middle);
}

}  // namespace libstdcxx

// SelectTopEntries (v4_indexer.h) for one query: `row` holds its scores [entries], the first
// `visible` of them visible; `queue` is scratch [entries]; picks [k] get the visible entries
// with the k largest scores, best first, then -1. Needs 0 < k <= entries < 2^31.
QUANTD_SELECT_HD void SelectTopOfRow(const float* row, int64_t visible, int64_t entries,
                                     int64_t k, ScoredEntry* queue, int32_t* picks) {
  const float neg_inf = formats::BitsToFloat(0xFF800000u);
  for (int64_t s = 0; s < entries; ++s) {
    queue[s] = {s < visible ? row[s] : neg_inf, static_cast<int32_t>(s)};
  }
  if (k * 64 <= entries) {
    libstdcxx::PartialSort(queue, k, entries);
  } else {
    libstdcxx::NthElement(queue, k - 1, entries);
    libstdcxx::Sort(queue, k - 1);
  }
  for (int64_t j = 0; j < k; ++j) picks[j] = queue[j].entry < visible ? queue[j].entry : -1;
}

}  // namespace quantd::kernels::cuda

#endif  // QUANTD_KERNELS_CUDA_LIBSTDCXX_SELECTION_H_
