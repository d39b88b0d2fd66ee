#include "server/evaluation/sqnr.h"

#include <cmath>
#include <limits>

namespace quantd::evaluation {

void Sqnr::Add(const float* ref, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double r = ref[i], e = r - static_cast<double>(x[i]);
    signal += r * r;
    noise += e * e;
  }
}

double Sqnr::Db() const {
  if (noise == 0.0) return std::numeric_limits<double>::infinity();
  if (signal == 0.0) return -std::numeric_limits<double>::infinity();
  return 10.0 * std::log10(signal / noise);
}

}  // namespace quantd::evaluation
