#include "server/model/v4_host_ops.h"

#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/formats.h"
#include "server/base/status_macros.h"
#include "server/model/v4_act_quant.h"
#include "server/model/v4_attention_sparse.h"
#include "server/model/v4_compressor.h"
#include "server/model/v4_indexer.h"
#include "server/model/v4_parallel.h"

namespace quantd::model {
namespace {

// Queries per score GEMM of the indexer: bounds the [queries * n_heads, entries] dot-product
// block.
constexpr int64_t kQueryChunk = 64;

// The host copy of `a` as a vector (HcMix's representation).
std::vector<float> ToVector(const OpArray<float>& a) {
  return std::vector<float>(a.data(), a.data() + a.size());
}

class HostForwardOps final : public ForwardOps {
 public:
  absl::StatusOr<kernels::Buffer> Allocate(size_t bytes, const std::string& what) const override {
    void* p = calloc(std::max<size_t>(bytes, 1), 1);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat(what, ": cannot allocate ", bytes, " bytes of host memory"));
    }
    return kernels::Buffer(p, bytes, free);
  }

  absl::Status CopyIn(const void* host, size_t bytes, void* dst,
                      const std::string&) const override {
    if (bytes > 0) memcpy(dst, host, bytes);
    return absl::OkStatus();
  }

  absl::Status CopyOut(const void* src, size_t bytes, void* host,
                       const std::string&) const override {
    if (bytes > 0) memcpy(host, src, bytes);
    return absl::OkStatus();
  }

  absl::Status Copy(const float* src, int64_t n, float* dst) const override {
    std::copy(src, src + n, dst);
    return absl::OkStatus();
  }

  std::string placement() const override { return "host"; }

  absl::Status Place(LinearWeight&) const override { return absl::OkStatus(); }

  absl::StatusOr<const float*> Parameter(const std::vector<float>& host,
                                         const std::string&) const override {
    return host.data();
  }

  absl::StatusOr<ExpertWeights> DecodeExpert(const RoutedExperts& experts, int64_t e,
                                             ExpertWeights previous) const override {
    return experts.Decode(e, std::move(previous));
  }

  absl::Status Linear(const ForwardContext& ctx, const LinearWeight& w, const float* x,
                      int64_t rows, float* out, LinearOutput output,
                      const LinearRows& facts) const override {
    return ApplyLinear(ctx, w, x, rows, out, output, facts);
  }

  absl::Status ObserveLinearInput(const ForwardContext& ctx,
                                  const LinearInput& input) const override {
    if (ctx.observer != nullptr) ctx.observer->OnLinearInput(input);
    return absl::OkStatus();
  }

  absl::Status ObserveKv(const ForwardContext& ctx, const std::string& module, const float* kv,
                         int64_t rows, int64_t cols) const override {
    if (ctx.observer == nullptr || rows == 0) return absl::OkStatus();
    KvCacheInput input;
    input.module = &module;
    input.kv = kv;
    input.rows = rows;
    input.cols = cols;
    ctx.observer->OnKvCache(input);
    return absl::OkStatus();
  }

  absl::Status ToModelDtype(const ForwardContext& ctx, float* x, int64_t n) const override {
    model::ToModelDtype(ctx, x, n);
    return absl::OkStatus();
  }

  absl::Status RmsNorm(const ForwardContext& ctx, const float* x, int64_t rows, int64_t n,
                       const std::vector<float>& weight, float eps, float* out) const override {
    model::RmsNorm(ctx, x, rows, n, weight, eps, out);
    return absl::OkStatus();
  }

  absl::StatusOr<OpHcMix> HcPre(const ForwardContext& ctx, const V4Config& config,
                                const HyperConnectionWeights& w, const float* streams,
                                int64_t tokens, float* y) const override {
    HcMix mix;
    RETURN_IF_ERROR(model::HcPre(ctx, config, w, streams, tokens, y, &mix));
    OpHcMix out;
    ASSIGN_OR_RETURN(out.pre, UploadArray(*this, mix.pre, "hc pre"));
    ASSIGN_OR_RETURN(out.post, UploadArray(*this, mix.post, "hc post"));
    ASSIGN_OR_RETURN(out.comb, UploadArray(*this, mix.comb, "hc comb"));
    return out;
  }

  absl::Status HcPost(const ForwardContext& ctx, const V4Config& config, const OpHcMix& mix,
                      const float* f, const float* streams, int64_t tokens,
                      float* out) const override {
    const HcMix host{ToVector(mix.pre), ToVector(mix.post), ToVector(mix.comb)};
    model::HcPost(ctx, config, host, f, streams, tokens, out);
    return absl::OkStatus();
  }

  absl::Status HcHead(const ForwardContext& ctx, const V4Config& config,
                      const HyperConnectionWeights& w, const float* streams, int64_t tokens,
                      float* y) const override {
    return model::HcHead(ctx, config, w, streams, tokens, y);
  }

  absl::Status AddToStreams(const float* e, int64_t tokens, int64_t hc, int64_t d,
                            float* x) const override {
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t j = 0; j < hc; ++j) {
        float* row = x + (t * hc + j) * d;
        for (int64_t i = 0; i < d; ++i) row[i] = e[t * d + i] + row[i];
      }
    }
    return absl::OkStatus();
  }

  absl::Status NormalizeHeads(const ForwardContext& ctx, float eps, float* q, int64_t rows,
                              int64_t dim) const override {
    model::NormalizeHeads(ctx, eps, q, rows, dim);
    return absl::OkStatus();
  }

  absl::Status Rope(const ForwardContext& ctx, const RopeTable& table,
                    const std::vector<int64_t>& positions, bool inverse, float* x, int64_t rows,
                    int64_t heads, int64_t head_dim) const override {
    ApplyRope(table, positions.data(), inverse, x, rows, heads, head_dim, ctx.threads);
    return absl::OkStatus();
  }

  absl::Status SimulateKvFp8(const ForwardContext& ctx, const std::string& module, float* kv,
                             int64_t rows, int64_t dim, int64_t rope_dim) const override {
    absl::Status s = SimulateFp8Act(kv, rows, dim - rope_dim, dim, kKvQuantBlock, ctx.threads);
    if (!s.ok()) return absl::Status(s.code(), absl::StrCat(module, ": ", s.message()));
    return s;
  }

  absl::Status SparseAttention(const ForwardContext& ctx, const kernels::SparseAttentionArgs& in,
                               float* o) const override {
    return model::SparseAttention(ctx, in, o);
  }

  // Per group g, u[:, g] = o[:, g] · wo_a[g]^T through the Gemm.
  absl::Status GroupedOutputA(const ForwardContext& ctx, const V4Config& config,
                              const LinearWeight& wo_a, const float* o, int64_t tokens,
                              float* u) const override {
    const int64_t groups = config.o_groups;
    const int64_t rank = config.o_lora_rank;
    const int64_t width = wo_a.in_features();  // H*D / groups
    if (ctx.observer != nullptr) {
      LinearInput input;
      input.module = &wo_a.module;
      input.x = o;
      input.rows = tokens;
      input.cols = groups * width;
      input.ld = groups * width;
      ctx.observer->OnLinearInput(input);
    }
    std::vector<float> slice(static_cast<size_t>(tokens * width));
    std::vector<float> part(static_cast<size_t>(tokens * rank));
    const size_t weight_bytes = wo_a.view.type == kernels::FloatType::kBF16 ? 2 : 4;
    for (int64_t g = 0; g < groups; ++g) {
      ParallelRows(ctx.threads, tokens, width, [&](int, int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const float* src = o + t * groups * width + g * width;
          std::copy(src, src + width, slice.data() + t * width);
        }
      });
      kernels::DenseTensor x{slice.data(), kernels::FloatType::kF32, tokens, width};
      kernels::DenseTensor w = wo_a.view;
      w.data = static_cast<const char*>(wo_a.view.data) + g * rank * width * weight_bytes;
      w.rows = rank;
      RETURN_IF_ERROR(ctx.gemm->MatMulNT(x, w, part.data(), /*accumulate=*/false));
      ParallelRows(ctx.threads, tokens, rank, [&](int, int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          std::copy(part.data() + t * rank, part.data() + (t + 1) * rank,
                    u + t * groups * rank + g * rank);
        }
      });
    }
    model::ToModelDtype(ctx, u, tokens * groups * rank);
    return absl::OkStatus();
  }

  absl::Status PoolCompressor(const ForwardContext& ctx, const float* kv, const float* score,
                              const std::vector<float>& ape, int64_t sequences, int64_t seq_len,
                              int64_t ratio, int64_t width, float* out) const override {
    const int64_t projected = ape.size() / ratio, windows = seq_len / ratio;
    for (int64_t b = 0; b < sequences; ++b) {
      const int64_t first = b * seq_len * projected;
      PoolCompressorWindows(kv + first, score + first, ape.data(), seq_len, ratio, width,
                            out + b * windows * width, ctx.threads);
    }
    return absl::OkStatus();
  }

  absl::Status SimulateIndexerFp4(const ForwardContext& ctx, float* x, int64_t rows, int64_t n,
                                  const std::string&) const override {
    return model::SimulateIndexerFp4(x, rows, n, ctx.threads);
  }

  absl::Status IndexerTopK(const ForwardContext& ctx, const V4Config& config, const float* q,
                            const float* keys, float* weights, int64_t sequences, int64_t seq_len,
                            int64_t ratio, int64_t k, const std::string&,
                            int32_t* picks) const override {
    const int64_t heads = config.index_n_heads, dim = config.index_head_dim;
    const int64_t tokens = sequences * seq_len, entries = seq_len / ratio;
    const float head_scale = 1.0f / std::sqrt(static_cast<float>(heads));
    if (ctx.numerics == Numerics::kOfficial) {
      const float scale = static_cast<float>(std::pow(static_cast<double>(dim), -0.5) *
                                             std::pow(static_cast<double>(heads), -0.5));
      for (int64_t i = 0; i < tokens * heads; ++i) {
        weights[i] = formats::RoundToBf16(weights[i] * scale);
      }
    } else {
      for (int64_t i = 0; i < tokens * heads; ++i) weights[i] *= head_scale;
    }
    if (k == 0) return absl::OkStatus();
    std::vector<float> dots(static_cast<size_t>(kQueryChunk * heads * entries));
    std::vector<float> scores(static_cast<size_t>(kQueryChunk * entries));
    for (int64_t b = 0; b < sequences; ++b) {
      const float* seq_keys = keys + b * entries * dim;
      for (int64_t t0 = 0; t0 < seq_len; t0 += kQueryChunk) {
        const int64_t queries = std::min(kQueryChunk, seq_len - t0);
        const float* seq_q = q + (b * seq_len + t0) * heads * dim;
        RETURN_IF_ERROR(ctx.gemm->Sgemm(
            IndexerDotsProduct(seq_q, seq_keys, queries * heads, entries, dim, dots.data())));
        // Queries are independent: each thread scores and selects its own.
        ParallelRows(ctx.threads, queries, 4 * heads * entries, [&](int, int64_t i0, int64_t i1) {
          IndexerScores(ctx.numerics, dots.data() + i0 * heads * entries,
                        weights + (b * seq_len + t0 + i0) * heads, i1 - i0, heads, dim, entries,
                        t0 + i0, ratio, scores.data() + i0 * entries);
          SelectTopEntries(scores.data() + i0 * entries, t0 + i0, i1 - i0, entries, ratio, k,
                           picks + (b * seq_len + t0 + i0) * k);
        });
      }
    }
    return absl::OkStatus();
  }

  absl::StatusOr<OpExpertRows> RouteAndGroup(const ForwardContext& ctx, const V4Config& config,
                                             const MoeWeights& w, const float* logits,
                                             int64_t tokens,
                                             const int32_t* token_ids) const override {
    const int64_t experts = config.n_routed_experts, topk = config.num_experts_per_tok;
    const Routing routing = Route(config, w, logits, tokens, token_ids, ctx.threads);
    const ExpertRows grouped = GroupByExpert(routing, tokens, topk, experts);
    OpExpertRows r;
    r.offsets.assign(1, 0);
    for (int64_t e = 0; e < experts; ++e) {
      r.host_rows.insert(r.host_rows.end(), grouped.tokens[e].begin(), grouped.tokens[e].end());
      r.host_weights.insert(r.host_weights.end(), grouped.weights[e].begin(),
                            grouped.weights[e].end());
      r.offsets.push_back(static_cast<int64_t>(r.host_rows.size()));
    }
    ASSIGN_OR_RETURN(r.rows, UploadArray(*this, r.host_rows, "expert rows"));
    ASSIGN_OR_RETURN(r.weights, UploadArray(*this, r.host_weights, "expert weights"));
    return r;
  }

  absl::Status GatherRows(const ForwardContext& ctx, const float* x, int64_t d,
                          const int64_t* rows, int64_t n, float* out) const override {
    model::GatherRows(x, d, rows, n, out, ctx.threads);
    return absl::OkStatus();
  }

  absl::Status ClampedSwiglu(const ForwardContext& ctx, float* g, const float* u, int64_t n,
                             float limit) const override {
    ParallelRows(ctx.threads, n, 24, [&](int, int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) g[i] = model::ClampedSwiglu(g[i], u[i], limit);
    });
    return absl::OkStatus();
  }

  absl::Status ScaleRows(const ForwardContext& ctx, const float* weights, int64_t rows,
                         int64_t cols, float* x) const override {
    model::ScaleRows(weights, rows, cols, x, ctx.threads);
    model::ToModelDtype(ctx, x, rows * cols);
    return absl::OkStatus();
  }

  absl::Status AddRows(const ForwardContext& ctx, const float* out, const int64_t* rows,
                       int64_t n, int64_t d, float* sum) const override {
    model::AddRows(out, rows, n, d, sum, ctx.threads);
    return absl::OkStatus();
  }

  absl::Status AddRoutedSum(const ForwardContext& ctx, const float* sum, int64_t n,
                            float* y) const override {
    ParallelRows(ctx.threads, n, 1, [&](int, int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) y[i] = sum[i] + y[i];
    });
    model::ToModelDtype(ctx, y, n);
    return absl::OkStatus();
  }
};

}  // namespace

const ForwardOps& HostOps() {
  static const HostForwardOps* const ops = new HostForwardOps();
  return *ops;
}

std::shared_ptr<ForwardOps> MakeHostOps() { return std::make_shared<HostForwardOps>(); }

const ForwardOps& OpsOf(const ForwardContext& ctx) {
  return ctx.ops != nullptr ? *ctx.ops : HostOps();
}

}  // namespace quantd::model
