// Signal-to-quantization-noise ratio of a hidden state against its reference, accumulated over
// any number of values: 10 log10(sum ref^2 / sum (ref - x)^2), in double precision.
#ifndef QUANTD_SERVER_EVALUATION_SQNR_H_
#define QUANTD_SERVER_EVALUATION_SQNR_H_

#include <stdint.h>

namespace quantd::evaluation {

struct Sqnr {
  double signal = 0.0;  // sum of ref^2
  double noise = 0.0;   // sum of (ref - x)^2

  void Add(const float* ref, const float* x, int64_t n);
  // In dB; +infinity when the values are identical (noise 0), -infinity for a zero reference
  // with noise.
  double Db() const;
};

}  // namespace quantd::evaluation

#endif  // QUANTD_SERVER_EVALUATION_SQNR_H_
