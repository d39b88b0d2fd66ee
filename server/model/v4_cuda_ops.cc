#include "server/model/v4_cuda_ops.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/v4_attention_blocks.h"
#include "kernels/cuda/v4_blocks.h"
#include "kernels/cuda/v4_cast_blocks.h"
#include "kernels/cuda/v4_compressor_blocks.h"
#include "kernels/cuda/v4_head_norm_blocks.h"
#include "kernels/cuda/v4_mhc_blocks.h"
#include "kernels/cuda/v4_moe_blocks.h"
#include "kernels/nvfp4_fake_quant.h"
#include "server/base/status_macros.h"
#include "server/model/v4_act_quant.h"
#include "server/model/v4_device_context.h"
#include "server/model/v4_indexer.h"
#include "server/model/v4_linear_input.h"
#include "server/model/v4_parameter_cache.h"
#include "server/model/v4_stored_experts.h"

namespace quantd::model {
namespace {

namespace cuda = kernels::cuda;

// Score rows of the indexer's dot products held at once: [queries * heads, entries] floats.
constexpr int64_t kIndexerDotValues = int64_t{1} << 26;  // 256 MiB

// Layers whose routed experts stay uploaded at once: evaluation alternates between a source and
// a quantized layer, calibration runs one.
constexpr size_t kResidentExpertLayers = 2;

// Parts of the parameter cache's entries whose owner is not the host vector itself.
enum ParameterPart { kValues = 0, kRopeCos = 1, kRopeSin = 2 };

// Owners in the parameter cache of values the ops build per call rather than read from the
// weights: the indexer's head-weight scale, and the RoPE table of the layer being run (a local of
// the attention; one entry, copied again when the next layer's table differs).
const char kIndexerScale = 0;
const char kRopeTable = 0;

bool Official(const ForwardContext& ctx) { return ctx.numerics == Numerics::kOfficial; }

// InvalidArgument naming `what` and the [row, col] of a non-finite value at flat index `bad` of
// rows of `cols` values, unless `bad` is kNoBad.
absl::Status NonFinite(uint64_t bad, int64_t cols, const std::string& what) {
  if (bad == cuda::kNoBad) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(what,
                                                 ": activation quantization: non-finite value at [",
                                                 bad / cols, ", ", bad % cols, "]"));
}

class CudaForwardOps final : public ForwardOps {
 public:
  explicit CudaForwardOps(DeviceForwardContext d)
      : d_(std::move(d)),
        parameters_(&d_.device->backend(), [](void* dst, const void* host, size_t bytes) {
          // On the legacy default stream: after the kernels that read the old values.
          return CopyToDevice(host, bytes, dst, "a parameter");
        }) {}

  OpsUploads uploads() const override {
    OpsUploads u = experts_uploads_;
    u.parameters = parameters_.uploads();
    u.parameter_bytes = parameters_.upload_bytes();
    u.parameter_hits = parameters_.hits();
    return u;
  }

  absl::StatusOr<const float*> Parameter(const std::vector<float>& host,
                                         const std::string& what) const override {
    return Cached(&host, kValues, host, what);
  }

  absl::StatusOr<kernels::Buffer> Allocate(size_t bytes, const std::string& what) const override {
    RETURN_IF_ERROR(UseDevice(d_));
    absl::StatusOr<kernels::Buffer> b = d_.device->backend().Allocate(std::max<size_t>(bytes, 1));
    if (!b.ok()) {
      return absl::Status(b.status().code(), absl::StrCat(what, ": ", b.status().message()));
    }
    RETURN_IF_ERROR(
        LaunchStatus(cudaMemsetAsync(b->data(), 0, bytes, d_.launch.stream), what + " zeroing"));
    return b;
  }

  absl::Status CopyIn(const void* host, size_t bytes, void* dst,
                      const std::string& what) const override {
    return CopyToDevice(host, bytes, dst, what);
  }

  absl::Status CopyOut(const void* src, size_t bytes, void* host,
                       const std::string& what) const override {
    return CopyToHost(src, bytes, host, what);
  }

  absl::Status Copy(const float* src, int64_t n, float* dst) const override {
    return LaunchStatus(cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * sizeof(float),
                                        cudaMemcpyDeviceToDevice, d_.launch.stream),
                        "device copy");
  }

  std::string placement() const override { return d_.device->name(); }

  // Keeps the values LoadLinear decoded on this device (LinearWeight::decoded), or copies them
  // here when they were decoded elsewhere (the CPU, read in place), dropping the host copy.
  absl::Status Place(LinearWeight& w) const override {
    RETURN_IF_ERROR(UseDevice(d_));
    const size_t bytes = static_cast<size_t>(w.view.rows * w.view.cols) *
                         (w.view.type == kernels::FloatType::kBF16 ? 2 : 4);
    checkpoint::DenseWeight& decoded = w.decoded;
    if (decoded.holder.data() != nullptr && w.view.data == decoded.holder.data() &&
        decoded.bytes == bytes && IsMemoryOf(d_, decoded.holder.data())) {
      return absl::OkStatus();
    }
    ASSIGN_OR_RETURN(kernels::Buffer values, d_.device->backend().Allocate(bytes));
    RETURN_IF_ERROR(CopyToDevice(w.view.data, bytes, values.data(), w.module));
    w.view.data = values.data();
    decoded = checkpoint::DenseWeight();
    decoded.tensor = w.view;
    decoded.bytes = bytes;
    decoded.holder = std::move(values);
    w.copy = std::vector<uint8_t>();
    return absl::OkStatus();
  }

  // From the layer's stored experts, uploaded on the layer's first decode (StoredExperts).
  absl::StatusOr<ExpertWeights> DecodeExpert(const RoutedExperts& experts, int64_t e,
                                             ExpertWeights previous) const override {
    RETURN_IF_ERROR(UseDevice(d_));
    ASSIGN_OR_RETURN(const StoredExperts* stored, Resident(experts));
    // The backend decodes on a stream of its own, into the previous expert's buffers: the
    // products that read them (this stream) must be done first. Its decode waits for itself.
    RETURN_IF_ERROR(WaitForWork(d_, experts.prefix() + "experts"));
    ASSIGN_OR_RETURN(ExpertWeights w, stored->Decode(e, std::move(previous)));
    ++experts_uploads_.experts_decoded;
    return w;
  }

  absl::Status Linear(const ForwardContext& ctx, const LinearWeight& w, const float* x,
                      int64_t rows, float* out, LinearOutput output,
                      const LinearRows& facts) const override {
    const int64_t in = w.in_features();
    if (ctx.observer != nullptr && rows > 0) {
      RETURN_IF_ERROR(ObserveLinearInput(ctx, LinearInputOf(w, x, rows, facts)));
    }
    if (rows <= 0) return absl::OkStatus();
    const float* operand = x;
    if ((Official(ctx) && w.quantized_source) || w.input_scale > 0.0f) {
      const size_t bytes = static_cast<size_t>(rows * in) * sizeof(float);
      ASSIGN_OR_RETURN(void* scratch,
                       d_.scratch->Get(*d_.device, DeviceScratch::kSimulated, bytes));
      float* simulated = static_cast<float*>(scratch);
      RETURN_IF_ERROR(LaunchStatus(
          cudaMemcpyAsync(simulated, x, bytes, cudaMemcpyDeviceToDevice, d_.launch.stream),
          w.module + " input"));
      if (Official(ctx) && w.quantized_source) {
        if (in % kActQuantBlock != 0) {
          return absl::InvalidArgumentError(
              absl::StrCat(w.module, " input: activation quantization of [", rows, ", ", in,
                           "] needs whole blocks of ", kActQuantBlock));
        }
        RETURN_IF_ERROR(LaunchStatus(cuda::LaunchSimulateFp8Act(simulated, rows, in, in,
                                                                kActQuantBlock, d_.results(),
                                                                d_.launch),
                                     w.module + " input"));
        ASSIGN_OR_RETURN(const uint64_t bad, FirstBad(d_, w.module + " input"));
        RETURN_IF_ERROR(NonFinite(bad, in, w.module + " input"));
      } else {
        // NVFP4 W4A4: the runtime's activation quantization, on a host copy.
        ASSIGN_OR_RETURN(std::vector<float> host,
                         DownloadArray<float>(*this, simulated, rows * in, w.module + " input"));
        if (absl::Status s = kernels::Nvfp4FakeQuantRows(host.data(), rows, in, in, w.input_scale);
            !s.ok()) {
          return absl::Status(s.code(), absl::StrCat(w.module, " input: ", s.message()));
        }
        RETURN_IF_ERROR(CopyToDevice(host.data(), bytes, simulated, w.module));
      }
      operand = simulated;
    }
    RETURN_IF_ERROR(MatMulNT(ctx, operand, rows, w.view, out, w.module));
    if (output == LinearOutput::kModelDtype) {
      RETURN_IF_ERROR(ToModelDtype(ctx, out, rows * w.out_features()));
    }
    if (ctx.alive) ctx.alive();
    return absl::OkStatus();
  }

  absl::Status ObserveLinearInput(const ForwardContext& ctx,
                                  const LinearInput& input) const override {
    if (ctx.observer == nullptr || input.rows <= 0) return absl::OkStatus();
    const std::string& module = *input.module;
    ASSIGN_OR_RETURN(std::vector<float> x,
                     DownloadArray(*this, input.x, input.rows * input.cols, module + " input"));
    std::vector<float> unweighted;
    if (input.unweighted_x != nullptr) {
      ASSIGN_OR_RETURN(unweighted, DownloadArray(*this, input.unweighted_x,
                                                 input.rows * input.cols,
                                                 module + " unweighted input"));
    }
    LinearInput host = input;
    host.x = x.data();
    host.ld = input.cols;
    host.unweighted_x = input.unweighted_x != nullptr ? unweighted.data() : nullptr;
    ctx.observer->OnLinearInput(host);
    return absl::OkStatus();
  }

  absl::Status ObserveKv(const ForwardContext& ctx, const std::string& module, const float* kv,
                         int64_t rows, int64_t cols) const override {
    if (ctx.observer == nullptr || rows == 0) return absl::OkStatus();
    ASSIGN_OR_RETURN(std::vector<float> host, DownloadArray(*this, kv, rows * cols, module));
    KvCacheInput input;
    input.module = &module;
    input.kv = host.data();
    input.rows = rows;
    input.cols = cols;
    ctx.observer->OnKvCache(input);
    return absl::OkStatus();
  }

  absl::Status ToModelDtype(const ForwardContext& ctx, float* x, int64_t n) const override {
    if (!Official(ctx)) return absl::OkStatus();
    return LaunchStatus(cuda::LaunchRoundToBf16(x, n, d_.launch), "BF16 rounding");
  }

  absl::Status RmsNorm(const ForwardContext& ctx, const float* x, int64_t rows, int64_t n,
                       const std::vector<float>& weight, float eps, float* out) const override {
    ASSIGN_OR_RETURN(const float* w, Cached(&weight, kValues, weight, "RMSNorm weight"));
    return LaunchStatus(cuda::LaunchRmsNorm(x, rows, n, w, eps, Official(ctx), out, d_.launch),
                        "RMSNorm");
  }

  absl::StatusOr<OpHcMix> HcPre(const ForwardContext& ctx, const V4Config& config,
                                const HyperConnectionWeights& w, const float* streams,
                                int64_t tokens, float* y) const override {
    const int64_t hc = config.hc_mult, d = config.hidden_size;
    const int64_t mix_width = (2 + hc) * hc;
    ASSIGN_OR_RETURN(const OpArray<float> mixes, Mixes(ctx, config, w, mix_width, streams, tokens));
    ASSIGN_OR_RETURN(const float* scale, Cached(&w.scale, kValues, w.scale, "hc scale"));
    ASSIGN_OR_RETURN(const float* base, Cached(&w.base, kValues, w.base, "hc base"));
    OpHcMix mix;
    ASSIGN_OR_RETURN(mix.pre, AllocateArray<float>(*this, tokens * hc, "hc pre"));
    ASSIGN_OR_RETURN(mix.post, AllocateArray<float>(*this, tokens * hc, "hc post"));
    ASSIGN_OR_RETURN(mix.comb, AllocateArray<float>(*this, tokens * hc * hc, "hc comb"));
    RETURN_IF_ERROR(LaunchStatus(
        cuda::LaunchSplitSinkhorn(mixes.data(), scale, base, tokens, hc,
                                  config.hc_sinkhorn_iters, config.hc_eps, mix.pre.data(),
                                  mix.post.data(), mix.comb.data(), d_.launch),
        "hc Sinkhorn"));
    RETURN_IF_ERROR(LaunchStatus(cuda::LaunchHcCollapse(mix.pre.data(), streams, tokens, hc, d,
                                                        Official(ctx), y, d_.launch),
                                 "hc collapse"));
    return mix;
  }

  absl::Status HcPost(const ForwardContext& ctx, const V4Config& config, const OpHcMix& mix,
                      const float* f, const float* streams, int64_t tokens,
                      float* out) const override {
    return LaunchStatus(
        cuda::LaunchHcPost(mix.post.data(), mix.comb.data(), f, streams, tokens, config.hc_mult,
                           config.hidden_size, Official(ctx), out, d_.launch),
        "hc_post");
  }

  absl::Status HcHead(const ForwardContext& ctx, const V4Config& config,
                      const HyperConnectionWeights& w, const float* streams, int64_t tokens,
                      float* y) const override {
    const int64_t hc = config.hc_mult;
    ASSIGN_OR_RETURN(const OpArray<float> mixes, Mixes(ctx, config, w, hc, streams, tokens));
    ASSIGN_OR_RETURN(const float* scale, Cached(&w.scale, kValues, w.scale, "hc_head scale"));
    ASSIGN_OR_RETURN(const float* base, Cached(&w.base, kValues, w.base, "hc_head base"));
    ASSIGN_OR_RETURN(const OpArray<float> pre, AllocateArray<float>(*this, tokens * hc, "hc pre"));
    RETURN_IF_ERROR(LaunchStatus(cuda::LaunchHcHeadPre(mixes.data(), scale, base, tokens, hc,
                                                       config.hc_eps, pre.data(), d_.launch),
                                 "hc_head pre"));
    return LaunchStatus(cuda::LaunchHcCollapse(pre.data(), streams, tokens, hc,
                                               config.hidden_size, Official(ctx), y, d_.launch),
                        "hc_head collapse");
  }

  absl::Status AddToStreams(const float* e, int64_t tokens, int64_t hc, int64_t d,
                            float* x) const override {
    return LaunchStatus(cuda::LaunchAddToStreams(e, tokens, hc, d, x, d_.launch),
                        "MTP stream input");
  }

  absl::Status NormalizeHeads(const ForwardContext& ctx, float eps, float* q, int64_t rows,
                              int64_t dim) const override {
    return LaunchStatus(cuda::LaunchNormalizeHeads(Official(ctx), eps, q, rows, dim, d_.launch),
                        "q head norm");
  }

  absl::Status Rope(const ForwardContext&, const RopeTable& table,
                    const std::vector<int64_t>& positions, bool inverse, float* x, int64_t rows,
                    int64_t heads, int64_t head_dim) const override {
    const int64_t pairs = table.pairs(), n = table.num_positions() * pairs;
    std::vector<float> cos(static_cast<size_t>(n)), sin(cos.size());
    for (int64_t p = 0; p < table.num_positions(); ++p) {
      for (int64_t i = 0; i < pairs; ++i) {
        cos[p * pairs + i] = table.cos(p, i);
        sin[p * pairs + i] = table.sin(p, i);
      }
    }
    ASSIGN_OR_RETURN(const float* cos_d, Cached(&kRopeTable, kRopeCos, cos, "RoPE cos"));
    ASSIGN_OR_RETURN(const float* sin_d, Cached(&kRopeTable, kRopeSin, sin, "RoPE sin"));
    ASSIGN_OR_RETURN(const OpArray<int64_t> positions_d,
                     UploadArray(*this, positions, "RoPE positions"));
    return LaunchStatus(cuda::LaunchRope(cos_d, sin_d, pairs, positions_d.data(), inverse, x, rows,
                                         heads, head_dim, d_.launch),
                        "RoPE");
  }

  absl::Status SimulateKvFp8(const ForwardContext&, const std::string& module, float* kv,
                             int64_t rows, int64_t dim, int64_t rope_dim) const override {
    const int64_t nope = dim - rope_dim;
    RETURN_IF_ERROR(LaunchStatus(cuda::LaunchSimulateFp8Act(kv, rows, nope, dim, kKvQuantBlock,
                                                            d_.results(), d_.launch),
                                 module + " FP8 simulation"));
    ASSIGN_OR_RETURN(const uint64_t bad, FirstBad(d_, module));
    return NonFinite(bad, nope, module);
  }

  absl::Status SparseAttention(const ForwardContext& ctx, const kernels::SparseAttentionArgs& in,
                               float* o) const override {
    return LaunchStatus(cuda::LaunchSparseAttention(in, Official(ctx), o, d_.launch),
                        "sparse attention");
  }

  // Per group g, u[:, g] = o[:, g] · wo_a[g]^T, the group's columns copied out (and its product
  // back) with strided copies.
  absl::Status GroupedOutputA(const ForwardContext& ctx, const V4Config& config,
                              const LinearWeight& wo_a, const float* o, int64_t tokens,
                              float* u) const override {
    const int64_t groups = config.o_groups, rank = config.o_lora_rank;
    const int64_t width = wo_a.in_features();
    LinearInput input;
    input.module = &wo_a.module;
    input.x = o;
    input.rows = tokens;
    input.cols = groups * width;
    input.ld = groups * width;
    RETURN_IF_ERROR(ObserveLinearInput(ctx, input));
    ASSIGN_OR_RETURN(const OpArray<float> slice,
                     AllocateArray<float>(*this, tokens * width, wo_a.module + " group input"));
    ASSIGN_OR_RETURN(const OpArray<float> part,
                     AllocateArray<float>(*this, tokens * rank, wo_a.module + " group output"));
    const size_t weight_bytes = wo_a.view.type == kernels::FloatType::kBF16 ? 2 : 4;
    for (int64_t g = 0; g < groups; ++g) {
      RETURN_IF_ERROR(LaunchStatus(
          cudaMemcpy2DAsync(slice.data(), width * sizeof(float), o + g * width,
                            groups * width * sizeof(float), width * sizeof(float), tokens,
                            cudaMemcpyDeviceToDevice, d_.launch.stream),
          wo_a.module + " group input"));
      kernels::DenseTensor w = wo_a.view;
      w.data = static_cast<const char*>(wo_a.view.data) + g * rank * width * weight_bytes;
      w.rows = rank;
      RETURN_IF_ERROR(MatMulNT(ctx, slice.data(), tokens, w, part.data(), wo_a.module));
      RETURN_IF_ERROR(LaunchStatus(
          cudaMemcpy2DAsync(u + g * rank, groups * rank * sizeof(float), part.data(),
                            rank * sizeof(float), rank * sizeof(float), tokens,
                            cudaMemcpyDeviceToDevice, d_.launch.stream),
          wo_a.module + " group output"));
    }
    return ToModelDtype(ctx, u, tokens * groups * rank);
  }

  absl::Status PoolCompressor(const ForwardContext&, const float* kv, const float* score,
                              const std::vector<float>& ape, int64_t sequences, int64_t seq_len,
                              int64_t ratio, int64_t width, float* out) const override {
    ASSIGN_OR_RETURN(const float* ape_d, Cached(&ape, kValues, ape, "compressor ape"));
    return LaunchStatus(cuda::LaunchPoolCompressorWindows(kv, score, ape_d, sequences, seq_len,
                                                          ratio, width, out, d_.launch),
                        "compressor pooling");
  }

  absl::Status SimulateIndexerFp4(const ForwardContext&, float* x, int64_t rows, int64_t n,
                                  const std::string& what) const override {
    RETURN_IF_ERROR(
        LaunchStatus(cuda::LaunchSimulateIndexerFp4(x, rows, n, d_.results(), d_.launch),
                     what + " FP4 simulation"));
    ASSIGN_OR_RETURN(const uint64_t bad, FirstBad(d_, what));
    return NonFinite(bad, n, what);
  }

  absl::Status IndexerTopK(const ForwardContext& ctx, const V4Config& config, const float* q,
                           const float* keys, float* weights, int64_t sequences, int64_t seq_len,
                           int64_t ratio, int64_t k, const std::string& what,
                           int32_t* picks) const override {
    const int64_t heads = config.index_n_heads, dim = config.index_head_dim;
    const int64_t tokens = sequences * seq_len, entries = seq_len / ratio;
    // The host's head weights: official bf16(w * (dim^-0.5 * heads^-0.5)), math w * heads^-0.5,
    // as ScaleRows over one row (the same product, then the same rounding).
    const float scale = Official(ctx)
                            ? static_cast<float>(std::pow(static_cast<double>(dim), -0.5) *
                                                 std::pow(static_cast<double>(heads), -0.5))
                            : 1.0f / std::sqrt(static_cast<float>(heads));
    ASSIGN_OR_RETURN(const float* scale_d, Cached(&kIndexerScale, kValues,
                                                  std::vector<float>{scale}, "indexer head scale"));
    RETURN_IF_ERROR(LaunchStatus(cuda::LaunchScaleRows(scale_d, 1, tokens * heads,
                                                       Official(ctx), weights, d_.launch),
                                 what + " head weights"));
    if (k == 0) return absl::OkStatus();
    const int64_t chunk = std::clamp<int64_t>(kIndexerDotValues / (heads * entries), 1, seq_len);
    ASSIGN_OR_RETURN(const OpArray<float> dots,
                     AllocateArray<float>(*this, chunk * heads * entries, what + " dots"));
    ASSIGN_OR_RETURN(const OpArray<float> scores,
                     AllocateArray<float>(*this, chunk * entries, what + " scores"));
    const int64_t scratch_bytes = cuda::TopEntriesScratchBytes(chunk, entries);
    if (scratch_bytes < 0) {
      return absl::InternalError(absl::StrCat(what, " top-k: CUB gives no scratch size for ",
                                              chunk, " queries of ", entries, " entries"));
    }
    ASSIGN_OR_RETURN(const OpArray<uint8_t> scratch,
                     AllocateArray<uint8_t>(*this, scratch_bytes, what + " top-k"));
    for (int64_t b = 0; b < sequences; ++b) {
      const float* seq_keys = keys + b * entries * dim;
      for (int64_t t0 = 0; t0 < seq_len; t0 += chunk) {
        const int64_t queries = std::min(chunk, seq_len - t0);
        const float* seq_q = q + (b * seq_len + t0) * heads * dim;
        RETURN_IF_ERROR(ctx.gemm->Sgemm(
            IndexerDotsProduct(seq_q, seq_keys, queries * heads, entries, dim, dots.data())));
        RETURN_IF_ERROR(LaunchStatus(
            cuda::LaunchIndexerScores(Official(ctx), dots.data(),
                                      weights + (b * seq_len + t0) * heads, queries, heads, dim,
                                      entries, t0, ratio, scores.data(), d_.launch),
            what + " scores"));
        RETURN_IF_ERROR(LaunchStatus(
            cuda::LaunchSelectTopEntries(scores.data(), t0, queries, entries, ratio, k,
                                         scratch.data(), picks + (b * seq_len + t0) * k,
                                         d_.launch),
            what + " top-k"));
      }
    }
    return absl::OkStatus();
  }

  absl::StatusOr<OpExpertRows> RouteAndGroup(const ForwardContext& ctx, const V4Config& config,
                                             const MoeWeights& w, const float* logits,
                                             int64_t tokens,
                                             const int32_t* token_ids) const override {
    const int64_t experts = config.n_routed_experts, topk = config.num_experts_per_tok;
    const std::string& module = w.gate.module;
    ASSIGN_OR_RETURN(const OpArray<int32_t> ids,
                     AllocateArray<int32_t>(*this, tokens * topk, module + " ids"));
    ASSIGN_OR_RETURN(const OpArray<float> weights,
                     AllocateArray<float>(*this, tokens * topk, module + " weights"));
    if (!w.tid2eid.empty()) {
      ASSIGN_OR_RETURN(const void* tid2eid_d,
                       parameters_.Get(&w.tid2eid, kValues, w.tid2eid.data(),
                                       w.tid2eid.size() * sizeof(int32_t), module + ".tid2eid"));
      const int32_t* tid2eid = static_cast<const int32_t*>(tid2eid_d);
      RETURN_IF_ERROR(LaunchStatus(
          cuda::LaunchRouteByHash(logits, tokens, experts, token_ids, tid2eid,
                                  config.vocab_size, topk, config.routed_scaling_factor,
                                  ids.data(), weights.data(), d_.results(), d_.launch),
          module + " routing"));
      ASSIGN_OR_RETURN(const uint64_t bad, FirstBad(d_, module + " routing"));
      if (bad != cuda::kNoBad) {
        return absl::InvalidArgumentError(absl::StrCat(
            "MoE of ", module, ": token ", bad, " has an id outside [0, ", config.vocab_size, ")"));
      }
    } else {
      ASSIGN_OR_RETURN(const float* bias, Cached(&w.bias, kValues, w.bias, module + ".bias"));
      RETURN_IF_ERROR(LaunchStatus(
          cuda::LaunchRouteByScore(logits, tokens, experts, bias, topk,
                                   config.routed_scaling_factor, ids.data(), weights.data(),
                                   d_.results(), d_.launch),
          module + " routing"));
      ASSIGN_OR_RETURN(const uint64_t bad, FirstBad(d_, module + " routing"));
      if (bad != cuda::kNoBad) {
        return absl::InvalidArgumentError(absl::StrCat("MoE of ", module, ": token ",
                                                       bad / experts, ", expert ", bad % experts,
                                                       ": the router's score is not finite"));
      }
    }
    OpExpertRows r;
    ASSIGN_OR_RETURN(const OpArray<int64_t> offsets,
                     AllocateArray<int64_t>(*this, experts + 1, module + " offsets"));
    ASSIGN_OR_RETURN(r.rows, AllocateArray<int64_t>(*this, tokens * topk, module + " rows"));
    ASSIGN_OR_RETURN(r.weights, AllocateArray<float>(*this, tokens * topk, module + " weights"));
    RETURN_IF_ERROR(LaunchStatus(
        cuda::LaunchGroupByExpert(ids.data(), weights.data(), tokens, topk, experts,
                                  offsets.data(), r.rows.data(), r.weights.data(), d_.results(),
                                  d_.launch),
        module + " grouping"));
    ASSIGN_OR_RETURN(const uint64_t bad, FirstBad(d_, module + " grouping"));
    if (bad != cuda::kNoBad) {
      return absl::InternalError(absl::StrCat("MoE of ", module, ": routed expert id at ", bad,
                                              " is outside [0, ", experts, ")"));
    }
    ASSIGN_OR_RETURN(r.offsets,
                     DownloadArray(*this, offsets.data(), experts + 1, module + " offsets"));
    if (ctx.observer != nullptr) {
      ASSIGN_OR_RETURN(r.host_rows,
                       DownloadArray(*this, r.rows.data(), tokens * topk, module + " rows"));
      ASSIGN_OR_RETURN(r.host_weights, DownloadArray(*this, r.weights.data(), tokens * topk,
                                                     module + " weights"));
    }
    return r;
  }

  absl::Status GatherRows(const ForwardContext&, const float* x, int64_t d, const int64_t* rows,
                          int64_t n, float* out) const override {
    return LaunchStatus(cuda::LaunchGatherRows(x, d, rows, n, out, d_.launch), "expert gather");
  }

  absl::Status ClampedSwiglu(const ForwardContext&, float* g, const float* u, int64_t n,
                             float limit) const override {
    return LaunchStatus(cuda::LaunchClampedSwiglu(g, u, n, limit, d_.launch), "SwiGLU");
  }

  absl::Status ScaleRows(const ForwardContext& ctx, const float* weights, int64_t rows,
                         int64_t cols, float* x) const override {
    return LaunchStatus(cuda::LaunchScaleRows(weights, rows, cols, Official(ctx), x, d_.launch),
                        "routing weights");
  }

  absl::Status AddRows(const ForwardContext&, const float* out, const int64_t* rows, int64_t n,
                       int64_t d, float* sum) const override {
    return LaunchStatus(cuda::LaunchAddRows(out, rows, n, d, sum, d_.launch), "routed sum");
  }

  absl::Status AddRoutedSum(const ForwardContext& ctx, const float* sum, int64_t n,
                            float* y) const override {
    return LaunchStatus(cuda::LaunchAddRoutedSum(sum, n, Official(ctx), y, d_.launch),
                        "routed sum");
  }

 private:
  // out[m, n] = x[m, k] · w[n, k]^T for a device F32 input and a device weight view of either
  // dtype, with the operand policy of v4_cuda_ops.h.
  absl::Status MatMulNT(const ForwardContext& ctx, const float* x, int64_t m,
                        const kernels::DenseTensor& w, float* out, const std::string& what) const {
    const int64_t n = w.rows, k = w.cols;
    kernels::DenseTensor xt{x, kernels::FloatType::kF32, m, k};
    if (w.type == kernels::FloatType::kF32) return ctx.gemm->MatMulNT(xt, w, out, false);
    if (Official(ctx)) {
      ASSIGN_OR_RETURN(void* narrow, d_.scratch->Get(*d_.device, DeviceScratch::kOperand,
                                                     static_cast<size_t>(m * k) * 2));
      RETURN_IF_ERROR(LaunchStatus(
          cuda::LaunchNarrowToBf16(x, m * k, static_cast<uint16_t*>(narrow), d_.launch),
          what + " input to BF16"));
      xt.data = narrow;
      xt.type = kernels::FloatType::kBF16;
      return ctx.gemm->MatMulNT(xt, w, out, false);
    }
    ASSIGN_OR_RETURN(void* wide, d_.scratch->Get(*d_.device, DeviceScratch::kOperand,
                                                 static_cast<size_t>(n * k) * 4));
    RETURN_IF_ERROR(LaunchStatus(cuda::LaunchWidenBf16(static_cast<const uint16_t*>(w.data),
                                                       n * k, static_cast<float*>(wide),
                                                       d_.launch),
                                 what + " weight to F32"));
    kernels::DenseTensor wt = w;
    wt.data = wide;
    wt.type = kernels::FloatType::kF32;
    return ctx.gemm->MatMulNT(xt, wt, out, false);
  }

  // hc's mixes: streams_flat · fn^T [tokens, mix_width], times each token's rsqrt.
  absl::StatusOr<OpArray<float>> Mixes(const ForwardContext& ctx, const V4Config& config,
                                       const HyperConnectionWeights& w, int64_t mix_width,
                                       const float* streams, int64_t tokens) const {
    const int64_t width = config.hc_mult * config.hidden_size;
    ASSIGN_OR_RETURN(const float* fn, Cached(&w.fn, kValues, w.fn, "hc fn"));
    ASSIGN_OR_RETURN(OpArray<float> mixes,
                     AllocateArray<float>(*this, tokens * mix_width, "hc mixes"));
    const kernels::DenseTensor fn_t{fn, kernels::FloatType::kF32, mix_width, width};
    RETURN_IF_ERROR(MatMulNT(ctx, streams, tokens, fn_t, mixes.data(), "hc fn"));
    RETURN_IF_ERROR(LaunchStatus(cuda::LaunchHcScaleMixes(streams, tokens, width,
                                                          config.rms_norm_eps, mixes.data(),
                                                          mix_width, d_.launch),
                                 "hc mixes"));
    return mixes;
  }

  // The device copy of float parameter `values` filed under (`owner`, `part`) (ParameterCache).
  absl::StatusOr<const float*> Cached(const void* owner, int part,
                                      const std::vector<float>& values,
                                      const std::string& what) const {
    RETURN_IF_ERROR(UseDevice(d_));
    ASSIGN_OR_RETURN(const void* p, parameters_.Get(owner, part, values.data(),
                                                    values.size() * sizeof(float), what));
    return static_cast<const float*>(p);
  }

  // The uploaded stored experts of `experts`' layer: uploaded now unless one of the last
  // kResidentExpertLayers layers used was it (the least recently used one is freed first).
  absl::StatusOr<const StoredExperts*> Resident(const RoutedExperts& experts) const {
    ++use_clock_;
    for (ResidentLayer& r : resident_) {
      if (r.experts.Holds(experts)) {
        r.last_use = use_clock_;
        return &r.experts;
      }
    }
    if (resident_.size() >= kResidentExpertLayers) {
      resident_.erase(std::min_element(
          resident_.begin(), resident_.end(),
          [](const ResidentLayer& a, const ResidentLayer& b) { return a.last_use < b.last_use; }));
    }
    ASSIGN_OR_RETURN(StoredExperts stored, StoredExperts::Upload(experts, d_.device->backend()));
    ++experts_uploads_.expert_layers;
    experts_uploads_.expert_bytes += static_cast<int64_t>(stored.bytes());
    resident_.push_back({std::move(stored), use_clock_});
    return &resident_.back().experts;
  }

  struct ResidentLayer {
    StoredExperts experts;
    int64_t last_use = 0;  // use_clock_ at its last use
  };

  DeviceForwardContext d_;
  // Small parameters, copied once for the ops' lifetime (one layer task).
  mutable ParameterCache parameters_;
  // The uploaded routed experts of the layers used last, and what was uploaded and decoded.
  mutable std::vector<ResidentLayer> resident_;
  mutable int64_t use_clock_ = 0;
  mutable OpsUploads experts_uploads_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<ForwardOps>> MakeCudaOps(compute::Device& device) {
  ASSIGN_OR_RETURN(DeviceForwardContext d, MakeDeviceForwardContext(device));
  return std::make_shared<CudaForwardOps>(std::move(d));
}

}  // namespace quantd::model
