// DeepSeek-V4 rotary position embedding: interleaved pairs (x[2i], x[2i+1]) of the last
// `rope_dim` values of a head, rotated by position * inv_freq[i] (official `precompute_freqs_cis`
// and `apply_rotary_emb`; transformers' `apply_rotary_pos_emb` with `rotate_half` on pairs).
//
// Layers with compress ratio 0 (and the MTP block) use plain frequencies with rope_theta;
// compressed layers use compress_rope_theta blended with YaRN:
//   freqs[i] = theta^(-2i/rope_dim)
//   [low, high] = [floor(corr(beta_fast)), ceil(corr(beta_slow))] clamped to [0, rope_dim-1],
//       corr(r) = rope_dim * ln(original_max_position_embeddings / (2*pi*r)) / (2 ln theta)
//   smooth[i] = 1 - clamp((i - low) / (high - low), 0, 1)       (high += 0.001 when equal)
//   freqs[i] = freqs[i] / factor * (1 - smooth[i]) + freqs[i] * smooth[i]
// No attention-temperature (mscale) factor. Angles are float(position) * freqs[i] in float32.
#ifndef QUANTD_SERVER_MODEL_V4_ROPE_H_
#define QUANTD_SERVER_MODEL_V4_ROPE_H_

#include <stdint.h>

#include <vector>

#include "server/model/v4_config.h"
#include "server/model/v4_parallel.h"

namespace quantd::model {

// The rope_dim / 2 inverse frequencies, float32 as the official code computes them.
// `yarn` false: plain theta^(-2i/rope_dim).
std::vector<float> RopeInvFreq(int64_t rope_dim, double theta, bool yarn, double factor,
                               int64_t original_max_position_embeddings, double beta_fast,
                               double beta_slow);

// The frequencies of `layer` (num_hidden_layers: the MTP block): YaRN with compress_rope_theta
// when its compress ratio is non-zero, plain rope_theta otherwise.
std::vector<float> LayerRopeInvFreq(const V4Config& config, int64_t layer);

// cos and sin of position * inv_freq for positions [0, num_positions).
class RopeTable {
 public:
  RopeTable(const std::vector<float>& inv_freq, int64_t num_positions);

  int64_t pairs() const { return pairs_; }
  int64_t num_positions() const { return num_positions_; }
  float cos(int64_t position, int64_t pair) const { return cos_[position * pairs_ + pair]; }
  float sin(int64_t position, int64_t pair) const { return sin_[position * pairs_ + pair]; }

 private:
  int64_t pairs_;
  int64_t num_positions_;
  std::vector<float> cos_;  // [num_positions, pairs]
  std::vector<float> sin_;  // [num_positions, pairs]
};

// Rotates, in place, the last 2 * table.pairs() values of each of the `heads` heads (width
// `head_dim`, side by side) of every row of x [rows, heads * head_dim]. Row r is at position
// positions[r] (< table.num_positions()). `inverse` rotates by the negated angle (the conjugate,
// used on the attention output). Computed in float32, rows split over up to `threads` threads.
void ApplyRope(const RopeTable& table, const int64_t* positions, bool inverse, float* x,
               int64_t rows, int64_t heads, int64_t head_dim, const HostThreads& threads = {});

}  // namespace quantd::model

#endif  // QUANTD_SERVER_MODEL_V4_ROPE_H_
