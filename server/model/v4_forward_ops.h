// The operations one DeepSeek-V4 forward is made of, behind one interface, so that the forward
// (RunLayer, the attention and MoE sub-blocks, the compressor and indexer, HeadForward, RunMtp)
// is written once over them, as one graph for every device: the host ops (v4_host_ops.h, the
// CPU device: host memory, host threads, the device's Gemm) and the CUDA ops (v4_cuda_ops.h,
// CUDA builds: device memory, the kernels of kernels/cuda/v4_*_blocks.h, cuBLAS).
//
// Every float or index pointer an op takes or writes is in the ops' memory (OpArray, or a weight
// view the ops placed, Place), unless it says "host". Small parameters (norm weights, mHC, sinks,
// ape, biases, tid2eid) stay host vectors in the weights; ops on a device copy each one there on
// its first use and keep the copy for the ops' lifetime (Parameter). Where the graph needs
// data-dependent control flow (which experts got tokens), the op returns a small host-side
// result. Every op runs with a ForwardContext's numerics, observer, threads and Gemm; the observer
// always sees host copies.
#ifndef QUANTD_SERVER_MODEL_V4_FORWARD_OPS_H_
#define QUANTD_SERVER_MODEL_V4_FORWARD_OPS_H_

#include <stdint.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/sparse_attention_args.h"
#include "server/compute/device.h"
#include "server/model/v4_attention.h"
#include "server/model/v4_config.h"
#include "server/model/v4_linear.h"
#include "server/model/v4_mhc.h"
#include "server/model/v4_moe.h"
#include "server/model/v4_rope.h"

namespace quantd::model {

// `size` values of T in the memory of the ops that allocated them, owned.
template <typename T>
class OpArray {
 public:
  OpArray() = default;
  OpArray(kernels::Buffer buffer, int64_t size) : buffer_(std::move(buffer)), size_(size) {}
  T* data() const { return buffer_.as<T>(); }
  int64_t size() const { return size_; }

 private:
  kernels::Buffer buffer_;
  int64_t size_ = 0;
};

// HcMix in the ops' memory.
struct OpHcMix {
  OpArray<float> pre, post, comb;  // [tokens, hc], [tokens, hc], [tokens, hc, hc]
};

// The rows routed to each expert: expert e's are rows[offsets[e], offsets[e + 1]), tokens
// ascending, with their routing weights.
struct OpExpertRows {
  std::vector<int64_t> offsets;      // host, [experts + 1]
  OpArray<int64_t> rows;             // [tokens * topk]
  OpArray<float> weights;            // [tokens * topk]
  std::vector<int64_t> host_rows;    // host copies of rows and weights (the observer's facts);
  std::vector<float> host_weights;   // empty on a device without an observer
};

// What ops on a device have copied there so far (all 0 for the host ops, which read host memory
// in place): cheap counters, for tests and timing reports.
struct OpsUploads {
  int64_t expert_layers = 0;    // layers whose routed experts were uploaded (once per layer)
  int64_t expert_bytes = 0;     // the stored bytes of those uploads
  int64_t experts_decoded = 0;  // experts decoded from uploaded bytes
  int64_t parameters = 0;       // small parameters copied (first uses, and changed values)
  int64_t parameter_bytes = 0;  // their bytes
  int64_t parameter_hits = 0;   // uses of a small parameter served by the copy already there
};

class ForwardOps {
 public:
  virtual ~ForwardOps() = default;

  virtual OpsUploads uploads() const { return {}; }

  // Memory. Allocate: `bytes` zeroed; ResourceExhausted names `what`. The copies wait for the
  // work before them; errors name `what`.
  virtual absl::StatusOr<kernels::Buffer> Allocate(size_t bytes, const std::string& what) const = 0;
  virtual absl::Status CopyIn(const void* host, size_t bytes, void* dst,
                              const std::string& what) const = 0;
  virtual absl::Status CopyOut(const void* src, size_t bytes, void* host,
                               const std::string& what) const = 0;
  // dst[n] = src[n].
  virtual absl::Status Copy(const float* src, int64_t n, float* dst) const = 0;

  // Where Place puts weights: "host", or the device's name ("cuda:0").
  virtual std::string placement() const = 0;
  // Makes a loaded weight readable by Linear (the host: as it is; a device: its values moved
  // there, the host copy dropped).
  virtual absl::Status Place(LinearWeight& w) const = 0;
  // A small parameter of the weights (host values that outlive the ops' use of them) readable
  // by the ops: the host values themselves, or a copy made on the first use and kept for the
  // ops' lifetime (copied again if the values at that address change). Errors name `what`.
  virtual absl::StatusOr<const float*> Parameter(const std::vector<float>& host,
                                                 const std::string& what) const = 0;
  // Routed expert `e`, decoded into `previous`'s buffers where they fit, placed.
  virtual absl::StatusOr<ExpertWeights> DecodeExpert(const RoutedExperts& experts, int64_t e,
                                                     ExpertWeights previous) const = 0;

  // ApplyLinear (v4_linear.h): observer, activation simulation, product, output rounding, then
  // ctx.alive. facts.tokens and facts.routing_weights are host, facts.unweighted ops memory.
  virtual absl::Status Linear(const ForwardContext& ctx, const LinearWeight& w, const float* x,
                              int64_t rows, float* out, LinearOutput output,
                              const LinearRows& facts) const = 0;
  // Shows the observer `input` (x and unweighted_x in ops memory, the rest host).
  virtual absl::Status ObserveLinearInput(const ForwardContext& ctx,
                                          const LinearInput& input) const = 0;
  // The KV cache rows kv [rows, cols] as attention reads them, to ctx.observer under `module`.
  virtual absl::Status ObserveKv(const ForwardContext& ctx, const std::string& module,
                                 const float* kv, int64_t rows, int64_t cols) const = 0;
  // ToModelDtype (v4_linear.h).
  virtual absl::Status ToModelDtype(const ForwardContext& ctx, float* x, int64_t n) const = 0;

  // RmsNorm, HcPre, HcPost, HcHead (v4_mhc.h).
  virtual absl::Status RmsNorm(const ForwardContext& ctx, const float* x, int64_t rows, int64_t n,
                               const std::vector<float>& weight, float eps, float* out) const = 0;
  virtual absl::StatusOr<OpHcMix> HcPre(const ForwardContext& ctx, const V4Config& config,
                                        const HyperConnectionWeights& w, const float* streams,
                                        int64_t tokens, float* y) const = 0;
  virtual absl::Status HcPost(const ForwardContext& ctx, const V4Config& config,
                              const OpHcMix& mix, const float* f, const float* streams,
                              int64_t tokens, float* out) const = 0;
  virtual absl::Status HcHead(const ForwardContext& ctx, const V4Config& config,
                              const HyperConnectionWeights& w, const float* streams,
                              int64_t tokens, float* y) const = 0;
  // The MTP input: x[t, j, :] = e[t, :] + x[t, j, :] for the hc streams j of each token.
  virtual absl::Status AddToStreams(const float* e, int64_t tokens, int64_t hc, int64_t d,
                                    float* x) const = 0;

  // Attention: NormalizeHeads (v4_attention.h), ApplyRope over host `positions` (v4_rope.h),
  // the KV FP8 simulation of the nope dims (errors name `module`), the sparse attention with
  // sinks of one sequence (v4_attention_sparse.h), wo_a's grouped product with its observer
  // call (official BF16 einsum, then the model dtype).
  virtual absl::Status NormalizeHeads(const ForwardContext& ctx, float eps, float* q,
                                      int64_t rows, int64_t dim) const = 0;
  virtual absl::Status Rope(const ForwardContext& ctx, const RopeTable& table,
                            const std::vector<int64_t>& positions, bool inverse, float* x,
                            int64_t rows, int64_t heads, int64_t head_dim) const = 0;
  virtual absl::Status SimulateKvFp8(const ForwardContext& ctx, const std::string& module,
                                     float* kv, int64_t rows, int64_t dim,
                                     int64_t rope_dim) const = 0;
  virtual absl::Status SparseAttention(const ForwardContext& ctx,
                                       const kernels::SparseAttentionArgs& in, float* o) const = 0;
  virtual absl::Status GroupedOutputA(const ForwardContext& ctx, const V4Config& config,
                                      const LinearWeight& wo_a, const float* o, int64_t tokens,
                                      float* u) const = 0;

  // Compressor and indexer: the window pooling of every sequence (PoolCompressorWindows,
  // v4_compressor.h), the indexer's Hadamard + FP4 simulation (SimulateIndexerFp4) naming
  // `what`, and its picks: the head weights [tokens, heads] scaled in place as RunIndexer scales
  // them, then per query the scores and the top k entries (picks [tokens, k], -1 for none).
  virtual absl::Status PoolCompressor(const ForwardContext& ctx, const float* kv,
                                      const float* score, const std::vector<float>& ape,
                                      int64_t sequences, int64_t seq_len, int64_t ratio,
                                      int64_t width, float* out) const = 0;
  virtual absl::Status SimulateIndexerFp4(const ForwardContext& ctx, float* x, int64_t rows,
                                          int64_t n, const std::string& what) const = 0;
  virtual absl::Status IndexerTopK(const ForwardContext& ctx, const V4Config& config,
                                    const float* q, const float* keys, float* weights,
                                    int64_t sequences, int64_t seq_len, int64_t ratio, int64_t k,
                                    const std::string& what, int32_t* picks) const = 0;

  // MoE: routing of the router logits [tokens, experts] and grouping by expert (token_ids in
  // ops memory, checked in range by the caller); the gather, SwiGLU, routing weights (then the
  // model dtype), scatter-add and final sum of v4_moe.h's steps.
  virtual absl::StatusOr<OpExpertRows> RouteAndGroup(const ForwardContext& ctx,
                                                     const V4Config& config, const MoeWeights& w,
                                                     const float* logits, int64_t tokens,
                                                     const int32_t* token_ids) const = 0;
  virtual absl::Status GatherRows(const ForwardContext& ctx, const float* x, int64_t d,
                                  const int64_t* rows, int64_t n, float* out) const = 0;
  virtual absl::Status ClampedSwiglu(const ForwardContext& ctx, float* g, const float* u,
                                     int64_t n, float limit) const = 0;
  virtual absl::Status ScaleRows(const ForwardContext& ctx, const float* weights, int64_t rows,
                                 int64_t cols, float* x) const = 0;
  virtual absl::Status AddRows(const ForwardContext& ctx, const float* out, const int64_t* rows,
                               int64_t n, int64_t d, float* sum) const = 0;
  // y[n] = sum[n] + y[n], then the model dtype.
  virtual absl::Status AddRoutedSum(const ForwardContext& ctx, const float* sum, int64_t n,
                                    float* y) const = 0;
};

// The ops ctx runs on: ctx.ops, or the host ops when it has none.
const ForwardOps& OpsOf(const ForwardContext& ctx);

// The ops of `device`: the host ops for a host-visible device with a Gemm, the CUDA ops for a
// CUDA device (Unavailable in a build without CUDA). FailedPrecondition for another device.
absl::StatusOr<std::shared_ptr<ForwardOps>> MakeForwardOps(compute::Device& device);

// `n` zeroed values of T in ops memory.
template <typename T>
absl::StatusOr<OpArray<T>> AllocateArray(const ForwardOps& ops, int64_t n,
                                         const std::string& what) {
  absl::StatusOr<kernels::Buffer> b = ops.Allocate(static_cast<size_t>(n) * sizeof(T), what);
  if (!b.ok()) return b.status();
  return OpArray<T>(std::move(*b), n);
}

// An ops copy of host values.
template <typename T>
absl::StatusOr<OpArray<T>> UploadArray(const ForwardOps& ops, const std::vector<T>& host,
                                       const std::string& what) {
  absl::StatusOr<OpArray<T>> a = AllocateArray<T>(ops, static_cast<int64_t>(host.size()), what);
  if (!a.ok()) return a.status();
  absl::Status s = ops.CopyIn(host.data(), host.size() * sizeof(T), a->data(), what);
  if (!s.ok()) return s;
  return a;
}

// A host copy of `n` values at ops pointer `values`.
template <typename T>
absl::StatusOr<std::vector<T>> DownloadArray(const ForwardOps& ops, const T* values, int64_t n,
                                             const std::string& what) {
  std::vector<T> host(static_cast<size_t>(n));
  absl::Status s = ops.CopyOut(values, host.size() * sizeof(T), host.data(), what);
  if (!s.ok()) return s;
  return host;
}

}  // namespace quantd::model

#endif  // QUANTD_SERVER_MODEL_V4_FORWARD_OPS_H_
