// How far the quantized model's next-token distributions are from the source's, over the same
// token sequences, from the float32 logits of both heads:
//   - KL(source || quantized) = sum_v p(v) (log p(v) - log q(v)) at every position (log-softmax
//     in double precision; identical logits give exactly 0), its mean, p99 (nearest rank: the
//     ceil(0.99 n)-th smallest) and max over all positions;
//   - top-1 agreement: the fraction of positions where both argmaxes (the lowest id among equal
//     maxima) are the same token;
//   - perplexity of each model on the text: exp(mean over positions t < len-1 of -log p(id[t+1]))
//     and their ratio quantized / source.
#ifndef QUANTD_SERVER_EVALUATION_NEXT_TOKEN_METRICS_H_
#define QUANTD_SERVER_EVALUATION_NEXT_TOKEN_METRICS_H_

#include <stdint.h>

#include <vector>

namespace quantd::evaluation {

struct NextTokenQuality {
  int64_t positions = 0;            // positions compared (KL, top-1)
  int64_t predicted = 0;            // positions with a next token (perplexity)
  double mean_kl = 0.0;             // nats
  double p99_kl = 0.0;
  double max_kl = 0.0;
  double top1_agreement = 0.0;      // in [0, 1]
  double source_ppl = 0.0;
  double quantized_ppl = 0.0;
  double ppl_ratio = 0.0;           // quantized_ppl / source_ppl
};

class NextTokenMetrics {
 public:
  // Adds one sequence: both models' logits [seq_len, vocab] and its token ids [seq_len].
  void AddSequence(const float* source_logits, const float* quantized_logits,
                   const int32_t* ids, int64_t seq_len, int64_t vocab);
  NextTokenQuality Finish() const;

 private:
  std::vector<double> kl_;        // per position, in the order added
  int64_t top1_same_ = 0;         // positions whose argmaxes agree
  int64_t predicted_ = 0;         // positions with a next token
  double source_nll_ = 0.0;       // sum of -log p(next) under the source
  double quantized_nll_ = 0.0;    // the same under the quantized model
};

}  // namespace quantd::evaluation

#endif  // QUANTD_SERVER_EVALUATION_NEXT_TOKEN_METRICS_H_
