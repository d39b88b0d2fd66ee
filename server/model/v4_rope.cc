#include "server/model/v4_rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "kernels/v4_row_math.h"
#include "server/model/v4_parallel.h"

namespace quantd::model {
namespace {

// The rotary dimension at which a wavelength makes `rotations` turns over `max_positions`.
double CorrectionDim(double rotations, int64_t dim, double theta, int64_t max_positions) {
  return static_cast<double>(dim) *
         std::log(static_cast<double>(max_positions) / (rotations * 2.0 * std::numbers::pi)) /
         (2.0 * std::log(theta));
}

}  // namespace

std::vector<float> RopeInvFreq(int64_t rope_dim, double theta, bool yarn, double factor,
                               int64_t original_max_position_embeddings, double beta_fast,
                               double beta_slow) {
  const int64_t pairs = rope_dim / 2;
  std::vector<float> freqs(static_cast<size_t>(pairs));
  const float theta_f = static_cast<float>(theta);
  for (int64_t i = 0; i < pairs; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(rope_dim);
    freqs[i] = 1.0f / std::pow(theta_f, exponent);
  }
  if (!yarn) return freqs;
  double low =
      std::floor(CorrectionDim(beta_fast, rope_dim, theta, original_max_position_embeddings));
  double high =
      std::ceil(CorrectionDim(beta_slow, rope_dim, theta, original_max_position_embeddings));
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(rope_dim - 1));
  if (low == high) high += 0.001;
  const float low_f = static_cast<float>(low);
  const float span_f = static_cast<float>(high - low);
  const float factor_f = static_cast<float>(factor);
  for (int64_t i = 0; i < pairs; ++i) {
    const float ramp = std::clamp((static_cast<float>(i) - low_f) / span_f, 0.0f, 1.0f);
    const float smooth = 1.0f - ramp;
    freqs[i] = freqs[i] / factor_f * (1.0f - smooth) + freqs[i] * smooth;
  }
  return freqs;
}

std::vector<float> LayerRopeInvFreq(const V4Config& config, int64_t layer) {
  if (config.CompressRatio(layer) == 0) {
    return RopeInvFreq(config.qk_rope_head_dim, config.rope_theta, /*yarn=*/false, 1.0, 0, 0.0,
                       0.0);
  }
  return RopeInvFreq(config.qk_rope_head_dim, config.compress_rope_theta, /*yarn=*/true,
                     config.rope_factor, config.original_max_position_embeddings, config.beta_fast,
                     config.beta_slow);
}

RopeTable::RopeTable(const std::vector<float>& inv_freq, int64_t num_positions)
    : pairs_(static_cast<int64_t>(inv_freq.size())),
      num_positions_(num_positions),
      cos_(static_cast<size_t>(num_positions * pairs_)),
      sin_(static_cast<size_t>(num_positions * pairs_)) {
  for (int64_t p = 0; p < num_positions; ++p) {
    for (int64_t i = 0; i < pairs_; ++i) {
      const float angle = static_cast<float>(p) * inv_freq[i];
      cos_[p * pairs_ + i] = std::cos(angle);
      sin_[p * pairs_ + i] = std::sin(angle);
    }
  }
}

void ApplyRope(const RopeTable& table, const int64_t* positions, bool inverse, float* x,
               int64_t rows, int64_t heads, int64_t head_dim, const HostThreads& threads) {
  const int64_t pairs = table.pairs();
  const int64_t first = head_dim - 2 * pairs;
  ParallelRows(threads, rows, 6 * heads * pairs, [&](int, int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t p = positions[r];
      for (int64_t h = 0; h < heads; ++h) {
        float* v = x + (r * heads + h) * head_dim + first;
        for (int64_t i = 0; i < pairs; ++i) {
          v4math::RotatePair(table.cos(p, i), inverse ? -table.sin(p, i) : table.sin(p, i),
                             v + 2 * i);
        }
      }
    }
  });
}

}  // namespace quantd::model
