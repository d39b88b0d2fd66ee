#include "server/evaluation/next_token_metrics.h"

#include <algorithm>
#include <cmath>

namespace quantd::evaluation {
namespace {

// log sum exp of one row, in double precision.
double LogSumExp(const float* logits, int64_t vocab) {
  double m = logits[0];
  for (int64_t v = 1; v < vocab; ++v) m = std::max(m, static_cast<double>(logits[v]));
  double sum = 0.0;
  for (int64_t v = 0; v < vocab; ++v) sum += std::exp(logits[v] - m);
  return m + std::log(sum);
}

int64_t ArgMax(const float* logits, int64_t vocab) {
  int64_t best = 0;
  for (int64_t v = 1; v < vocab; ++v) {
    if (logits[v] > logits[best]) best = v;
  }
  return best;
}

}  // namespace

void NextTokenMetrics::AddSequence(const float* source_logits, const float* quantized_logits,
                                   const int32_t* ids, int64_t seq_len, int64_t vocab) {
  for (int64_t t = 0; t < seq_len; ++t) {
    const float* p = source_logits + t * vocab;
    const float* q = quantized_logits + t * vocab;
    const double lse_p = LogSumExp(p, vocab), lse_q = LogSumExp(q, vocab);
    double kl = 0.0;
    for (int64_t v = 0; v < vocab; ++v) {
      const double log_p = p[v] - lse_p, log_q = q[v] - lse_q;
      kl += std::exp(log_p) * (log_p - log_q);
    }
    // KL >= 0; the sum of rounded terms of nearly equal distributions can end a few ulps below.
    kl_.push_back(std::max(kl, 0.0));
    top1_same_ += ArgMax(p, vocab) == ArgMax(q, vocab);
    if (t + 1 < seq_len) {
      const int32_t next = ids[t + 1];
      source_nll_ += lse_p - p[next];
      quantized_nll_ += lse_q - q[next];
      ++predicted_;
    }
  }
}

NextTokenQuality NextTokenMetrics::Finish() const {
  NextTokenQuality r;
  r.positions = static_cast<int64_t>(kl_.size());
  r.predicted = predicted_;
  if (r.positions == 0) return r;
  std::vector<double> sorted = kl_;
  std::sort(sorted.begin(), sorted.end());
  double sum = 0.0;
  for (double k : kl_) sum += k;
  r.mean_kl = sum / static_cast<double>(r.positions);
  const int64_t rank = static_cast<int64_t>(std::ceil(0.99 * static_cast<double>(r.positions)));
  r.p99_kl = sorted[static_cast<size_t>(std::max<int64_t>(rank, 1) - 1)];
  r.max_kl = sorted.back();
  r.top1_agreement = static_cast<double>(top1_same_) / static_cast<double>(r.positions);
  if (predicted_ > 0) {
    r.source_ppl = std::exp(source_nll_ / static_cast<double>(predicted_));
    r.quantized_ppl = std::exp(quantized_nll_ / static_cast<double>(predicted_));
    r.ppl_ratio = r.quantized_ppl / r.source_ppl;
  }
  return r;
}

}  // namespace quantd::evaluation
