// The KV compressor of DeepSeek-V4's compressed layers (official `Compressor.forward` at
// start_pos 0; transformers `DeepseekV4HCACompressor` / `DeepseekV4CSACompressor` without a
// cache). Every full window of `ratio` tokens of a sequence yields one entry of width `width`;
// the remainder (seq_len % ratio tokens) yields none.
//
//   kv = x · wkv^T, score = x · wgate^T                    float32, [S, coff*width]
//   ratio 128 (HCA, coff 1): entry w, channel c = softmax over the window's 128 tokens j of
//       (score[wr+j][c] + ape[j][c]) weighting kv[wr+j][c]
//   ratio 4 (CSA, coff 2, overlap): 8 slots per channel c: tokens j of window w-1 with
//       (kv, score + ape)[.][c] (absent for w = 0), then tokens j of window w with
//       (kv, score + ape)[.][width + c]
//   entry = RMSNorm(norm)(entry) (official: input rounded to BF16 first), then RoPE of its last
//   rope dims at position w * ratio.
// The FP8 simulation (main compressor) or Hadamard + FP4 simulation (indexer compressor) is the
// caller's.
#ifndef QUANTD_SERVER_MODEL_V4_COMPRESSOR_H_
#define QUANTD_SERVER_MODEL_V4_COMPRESSOR_H_

#include <stdint.h>

#include <vector>

#include "absl/status/statusor.h"
#include "server/model/v4_attention.h"
#include "server/model/v4_forward_ops.h"
#include "server/model/v4_linear.h"
#include "server/model/v4_parallel.h"
#include "server/model/v4_rope.h"

namespace quantd::model {

// The pooling of one sequence: kv and score [seq_len, coff*width] (coff = 2 when ratio == 4),
// ape [ratio, coff*width] -> out [seq_len / ratio, width], float32. Windows split over up to
// `threads` threads.
void PoolCompressorWindows(const float* kv, const float* score, const float* ape, int64_t seq_len,
                           int64_t ratio, int64_t width, float* out,
                           const HostThreads& threads = {});

// Projection, pooling, norm and RoPE for every sequence of `batch` over ctx's ops (batch.x and
// the result in their memory): entries [batch.sequences * (batch.seq_len / ratio), width],
// sequence-major. `rope` covers positions up to seq_len. The projections' inputs go to
// ctx.observer under w.wkv.module / w.wgate.module.
absl::StatusOr<OpArray<float>> RunCompressor(const ForwardContext& ctx,
                                             const V4CompressorWeights& w, int64_t ratio,
                                             int64_t width, float eps, const RopeTable& rope,
                                             const AttentionBatch& batch);

}  // namespace quantd::model

#endif  // QUANTD_SERVER_MODEL_V4_COMPRESSOR_H_
