// quantd_v4_forward_bench: the DeepSeek-V4 forward on the CPU, layer by layer, on synthetic
// checkpoints (the `small` fixture shape with 4 and 8 layers, and the `bench` preset), against
// OpenBLAS sgemm measured in the same run.
//
//   quantd_v4_forward_bench --dir SCRATCH [--sequences 2] [--seq-len 256] [--threads 0]
//                           [--numerics official|math] [--table small4|small8|bench|threads]
//
// Prints, per layer: load seconds, run seconds, tokens/s, the GFLOP/s of the layer's GEMMs over
// the whole run time and over the time spent inside the GEMMs, and both as a fraction of the
// sgemm peak (best of 5 square 2048^3 products on the same threads). Then the peak RSS of a full
// layer-by-layer forward (embed, every layer, head) of a 4-layer and an 8-layer model, each in its
// own child process: flat in the layer count when only one layer is resident.
//
// --table threads prints only the host-thread table instead: one CSA layer (layer 1) of the tiny
// fixture and of the small4 model, run with the non-GEMM loops on 1 host thread and on --threads
// (OpenBLAS on --threads in both), alternately, best of 5 runs each: run time split into GEMM and
// non-GEMM, tokens/s, and the non-GEMM and whole-layer speed-ups.
//
// --table cuda (needs CUDA device 0) runs every layer of the small4 model whole on the device
// (LoadLayer / RunLayer on cuda:0, the CUDA ops of server/model/v4_cuda_ops.h): per layer the
// load seconds (decode on the device, kept there; routed experts decoded per expert in the run),
// the run seconds (best of 3 after a warm-up), tokens/s, and
// the TFLOP/s of its products over the run and over the time inside cuBLAS, against the cuBLAS
// peak of the same run (BF16 8192^3 for official numerics, whose products take BF16 operands;
// float32 4096^3 for math).
//
// --table cublas (needs CUDA device 0) records the products of every layer of the small4 model
// on the CPU, then replays each shape on cuBLAS with BF16 operands (fp32 accumulate) in device
// memory, best of 3: per layer the GEMM seconds and TFLOP/s on the GPU and the tokens/s the layer
// would reach if its products were its only cost, against the cuBLAS peak of the same run (BF16
// 8192^3 and float32 4096^3 products).
#include <stdio.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "kernels/backends.h"
#include "kernels/gemm.h"
#include "server/base/status_macros.h"
#include "server/compute/device.h"
#include "server/fixture/fixture.h"
#include "server/model/v4_layer.h"

namespace quantd {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

// The shape of one product out[m, n] = x[m, k] · w[n, k]^T.
struct GemmShape {
  int64_t m = 0, n = 0, k = 0;
  auto operator<=>(const GemmShape&) const = default;
};

// Counts the floating-point operations (2 m n k) of every product and the time inside them, and
// records the shapes.
class CountingGemm final : public kernels::Gemm {
 public:
  explicit CountingGemm(kernels::Gemm* inner) : inner_(inner) {}
  std::string name() const override { return inner_->name(); }
  absl::Status Sgemm(const kernels::SgemmArgs& g) override {
    const auto t = Clock::now();
    absl::Status s = inner_->Sgemm(g);
    seconds_ += Seconds(t);
    flops_ += 2.0 * g.m * g.n * g.k;
    shapes_.push_back({g.m, g.n, g.k});
    return s;
  }
  absl::Status MatMulNT(const kernels::DenseTensor& x, const kernels::DenseTensor& w, float* out,
                        bool accumulate) override {
    const auto t = Clock::now();
    absl::Status s = inner_->MatMulNT(x, w, out, accumulate);
    seconds_ += Seconds(t);
    flops_ += 2.0 * x.rows * w.rows * x.cols;
    shapes_.push_back({x.rows, w.rows, x.cols});
    return s;
  }
  void Reset() {
    flops_ = seconds_ = 0.0;
    shapes_.clear();
  }
  double flops() const { return flops_; }
  double seconds() const { return seconds_; }
  const std::vector<GemmShape>& shapes() const { return shapes_; }

 private:
  kernels::Gemm* inner_;            // the device's Gemm
  double flops_ = 0.0;              // since Reset()
  double seconds_ = 0.0;            // inside inner_, since Reset()
  std::vector<GemmShape> shapes_;   // every product since Reset(), in call order
};

// Resident bytes of this process now (statm's second field).
double ResidentMib() {
  FILE* f = fopen("/proc/self/statm", "re");
  if (f == nullptr) return 0.0;
  long size = 0, resident = 0;
  const int n = fscanf(f, "%ld %ld", &size, &resident);
  fclose(f);
  return n == 2 ? resident * static_cast<double>(sysconf(_SC_PAGESIZE)) / 1048576.0 : 0.0;
}

double SgemmPeakGflops(kernels::Gemm& gemm) {
  const int64_t n = 2048;
  std::vector<float> a(n * n, 0.5f), b(n * n, 0.25f), c(n * n);
  kernels::SgemmArgs g;
  g.m = g.n = g.k = n;
  g.a = a.data();
  g.b = b.data();
  g.c = c.data();
  g.lda = g.ldb = g.ldc = n;
  double best = 0.0;
  for (int i = 0; i < 5; ++i) {
    const auto t = Clock::now();
    if (!gemm.Sgemm(g).ok()) return 0.0;
    best = std::max(best, 2.0 * n * n * n / Seconds(t) / 1e9);
  }
  return best;
}

fixture::FixtureConfig BenchConfig(int64_t layers) {
  fixture::FixtureConfig c =
      fixture::MakeConfig(fixture::Arch::kDeepseekV4, fixture::Preset::kSmall);
  c.num_hidden_layers = layers;
  c.compress_ratios.clear();
  for (int64_t l = 0; l < layers; ++l) c.compress_ratios.push_back(l == 0 ? 0 : (l % 2 ? 4 : 128));
  c.compress_ratios.push_back(0);  // MTP
  return c;
}

absl::Status EnsureFixture(const std::string& dir, const fixture::FixtureConfig& config) {
  if (std::filesystem::exists(dir + "/config.json")) return absl::OkStatus();
  fprintf(stderr, "writing a %ld-layer fixture to %s\n",
          static_cast<long>(config.num_hidden_layers), dir.c_str());
  return fixture::WriteFixture(config, 1, dir, {}).status();
}

std::vector<int32_t> Ids(int64_t n, int64_t vocab) {
  std::vector<int32_t> ids(n);
  for (int64_t i = 0; i < n; ++i) ids[i] = static_cast<int32_t>((i * 7919 + 17) % vocab);
  return ids;
}

// The CPU forward of the model in `dir` over `sequences` x `seq_len` token ids, with its products
// counted: the checkpoint, the device, the counting Gemm the context multiplies through, and the
// embedded input. `threads`: the device's CPU threads (0: all cores).
struct CountedCpuForward {
  std::unique_ptr<model::V4Checkpoint> ckpt;
  std::unique_ptr<compute::Device> device;
  std::unique_ptr<CountingGemm> gemm;  // wraps device->gemm(); ctx.gemm points to it
  model::ForwardContext ctx;
  model::V4Activations acts;
};

absl::StatusOr<CountedCpuForward> OpenCountedCpuForward(const std::string& dir,
                                                        int64_t sequences, int64_t seq_len,
                                                        int threads, model::Numerics numerics) {
  CountedCpuForward f;
  ASSIGN_OR_RETURN(f.ckpt, model::OpenV4Checkpoint(dir));
  ASSIGN_OR_RETURN(f.device, compute::OpenDevice("cpu", {.cpu_threads = threads}));
  f.gemm = std::make_unique<CountingGemm>(f.device->gemm());
  ASSIGN_OR_RETURN(f.ctx, model::MakeForwardContext(*f.device, numerics, nullptr));
  f.ctx.gemm = f.gemm.get();
  const int64_t vocab = f.ckpt->config.vocab_size;
  ASSIGN_OR_RETURN(f.acts, model::Embed(*f.ckpt, Ids(sequences * seq_len, vocab), sequences,
                                        seq_len, f.ctx.threads));
  return f;
}

// Layer `layer` of `dir` on its embedded ids, with the non-GEMM loops on 1 host thread and on
// `threads`, alternately (so that a change in the machine's load hits both alike), 5 runs each:
// the fastest {run seconds, GEMM seconds} of each.
absl::StatusOr<std::pair<std::pair<double, double>, std::pair<double, double>>> TimeLayer(
    const std::string& dir, int64_t layer, int64_t sequences, int64_t seq_len, int threads,
    model::Numerics numerics) {
  ASSIGN_OR_RETURN(CountedCpuForward f,
                   OpenCountedCpuForward(dir, sequences, seq_len, threads, numerics));
  auto& [ckpt, device, counted, ctx, acts] = f;
  CountingGemm& gemm = *counted;
  const model::V4Config& c = ckpt->config;
  ASSIGN_OR_RETURN(model::V4LayerWeights w, model::LoadLayer(*ckpt, layer, *device));
  std::pair<double, double> best[2] = {{1e30, 0.0}, {1e30, 0.0}};
  for (int i = 0; i < 10; ++i) {
    ctx.threads.count = i % 2 == 0 ? 1 : threads;
    gemm.Reset();
    const auto t = Clock::now();
    ASSIGN_OR_RETURN(model::V4Activations out, model::RunLayer(ctx, c, w, acts));
    const double run = Seconds(t);
    if (run < best[i % 2].first) best[i % 2] = {run, gemm.seconds()};
  }
  return std::pair{best[0], best[1]};
}

// The host-thread table (--table threads) for the models (name, dir).
absl::Status HostThreadTable(const std::vector<std::pair<std::string, std::string>>& models,
                             int64_t sequences, int64_t seq_len, int threads,
                             model::Numerics numerics) {
  const int n =
      threads > 0 ? threads : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  printf("layer 1 (CSA), %ld x %ld tokens, %s numerics, OpenBLAS on %d threads; best of 5\n",
         static_cast<long>(sequences), static_cast<long>(seq_len), model::NumericsName(numerics),
         n);
  for (const auto& [name, dir] : models) {
    ASSIGN_OR_RETURN(auto times, TimeLayer(dir, 1, sequences, seq_len, n, numerics));
    const auto& [one, many] = times;
    const double tokens = static_cast<double>(sequences * seq_len);
    for (const auto& [host, r] : {std::pair{1, one}, std::pair{n, many}}) {
      printf("%-6s host threads %d  run %8.4f s  GEMM %8.4f s  non-GEMM %8.4f s (%4.1f%%)  "
             "%9.1f tokens/s\n",
             name.c_str(), host, r.first, r.second, r.first - r.second,
             100.0 * (r.first - r.second) / r.first, tokens / r.first);
    }
    printf("%-6s speed-up with %d host threads: non-GEMM %.2fx, layer %.2fx\n", name.c_str(), n,
           (one.first - one.second) / (many.first - many.second), one.first / many.first);
  }
  return absl::OkStatus();
}

// The layer-by-layer forward of `dir`; per-layer lines when `report`.
absl::Status Forward(const std::string& dir, int64_t sequences, int64_t seq_len, int threads,
                     model::Numerics numerics, bool report, double peak) {
  ASSIGN_OR_RETURN(CountedCpuForward f,
                   OpenCountedCpuForward(dir, sequences, seq_len, threads, numerics));
  auto& [ckpt, device, counted, ctx, acts] = f;
  CountingGemm& gemm = *counted;
  const model::V4Config& c = ckpt->config;
  const double tokens = static_cast<double>(sequences * seq_len);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    auto t = Clock::now();
    ASSIGN_OR_RETURN(model::V4LayerWeights w, model::LoadLayer(*ckpt, l, *device));
    const double load = Seconds(t);
    gemm.Reset();
    t = Clock::now();
    ASSIGN_OR_RETURN(acts, model::RunLayer(ctx, c, w, acts));
    const double run = Seconds(t);
    if (report) {
      printf(
          "layer %ld ratio %3ld  load %6.2f s  run %6.2f s  %8.1f tokens/s  GEMM %6.2f GFLOP "
          "%6.1f GFLOP/s of run (%4.1f%% of peak)  %6.1f GFLOP/s in GEMM (%4.1f%%)  GEMM share "
          "of run %4.1f%%  RSS %.0f MiB\n",
          static_cast<long>(l), static_cast<long>(c.CompressRatio(l)), load, run, tokens / run,
          gemm.flops() / 1e9, gemm.flops() / run / 1e9, 100.0 * gemm.flops() / run / 1e9 / peak,
          gemm.flops() / gemm.seconds() / 1e9, 100.0 * gemm.flops() / gemm.seconds() / 1e9 / peak,
          100.0 * gemm.seconds() / run, ResidentMib());
    }
  }
  ASSIGN_OR_RETURN(model::V4HeadWeights head, model::LoadHead(*ckpt, *device));
  std::vector<float> hidden, logits;
  return model::HeadForward(ctx, c, head, acts, &hidden, &logits);
}

// Best of 3 seconds of out[m, n] = x[m, k] · w[n, k]^T on `gemm` with operands of `type` in
// `backend`'s memory (contents irrelevant to the time: zeros).
absl::StatusOr<double> TimeDeviceProduct(kernels::Gemm& gemm, kernels::Backend& backend,
                                         const GemmShape& s, kernels::FloatType type) {
  const size_t es = type == kernels::FloatType::kBF16 ? 2 : 4;
  ASSIGN_OR_RETURN(kernels::Buffer x, backend.Allocate(static_cast<size_t>(s.m * s.k) * es));
  ASSIGN_OR_RETURN(kernels::Buffer w, backend.Allocate(static_cast<size_t>(s.n * s.k) * es));
  ASSIGN_OR_RETURN(kernels::Buffer out, backend.Allocate(static_cast<size_t>(s.m * s.n) * 4));
  const std::vector<uint8_t> zeros(std::max(s.m, s.n) * s.k * es, 0);
  RETURN_IF_ERROR(backend.CopyToBackend(x.data(), zeros.data(), s.m * s.k * es));
  RETURN_IF_ERROR(backend.CopyToBackend(w.data(), zeros.data(), s.n * s.k * es));
  const kernels::DenseTensor xt{x.data(), type, s.m, s.k}, wt{w.data(), type, s.n, s.k};
  RETURN_IF_ERROR(gemm.MatMulNT(xt, wt, out.as<float>(), false));  // warm-up
  double best = 1e30;
  for (int i = 0; i < 3; ++i) {
    const auto t = Clock::now();
    RETURN_IF_ERROR(gemm.MatMulNT(xt, wt, out.as<float>(), false));  // synchronizes
    best = std::min(best, Seconds(t));
  }
  return best;
}

// The cuBLAS table (--table cublas) for the model `config`, written to `dir` unless it is there.
absl::Status CublasTable(const std::string& dir, const fixture::FixtureConfig& config,
                         int64_t sequences, int64_t seq_len, model::Numerics numerics) {
  ASSIGN_OR_RETURN(auto cublas, kernels::MakeCublasGemm(0));
  ASSIGN_OR_RETURN(auto backend, kernels::MakeCudaBackend(0));
  RETURN_IF_ERROR(EnsureFixture(dir, config));
  const GemmShape bf16_peak{8192, 8192, 8192}, f32_peak{4096, 4096, 4096};
  ASSIGN_OR_RETURN(const double bf16_s,
                   TimeDeviceProduct(*cublas, *backend, bf16_peak, kernels::FloatType::kBF16));
  ASSIGN_OR_RETURN(const double f32_s,
                   TimeDeviceProduct(*cublas, *backend, f32_peak, kernels::FloatType::kF32));
  const double peak = 2.0 * 8192 * 8192 * 8192 / bf16_s / 1e12;
  printf("cuBLAS peak: BF16 8192^3 %.1f TFLOP/s, float32 4096^3 %.1f TFLOP/s (%s)\n", peak,
         2.0 * 4096 * 4096 * 4096 / f32_s / 1e12, cublas->name().c_str());
  printf("per-layer products of %s on cuBLAS, BF16 operands, %ld x %ld tokens, %s numerics\n",
         dir.c_str(), static_cast<long>(sequences), static_cast<long>(seq_len),
         model::NumericsName(numerics));
  ASSIGN_OR_RETURN(CountedCpuForward f,
                   OpenCountedCpuForward(dir, sequences, seq_len, 0, numerics));
  auto& [ckpt, device, counted, ctx, acts] = f;
  CountingGemm& gemm = *counted;
  const model::V4Config& c = ckpt->config;
  const double tokens = static_cast<double>(sequences * seq_len);
  std::map<GemmShape, double> seconds;  // per distinct shape, measured once
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    ASSIGN_OR_RETURN(model::V4LayerWeights w, model::LoadLayer(*ckpt, l, *device));
    gemm.Reset();
    ASSIGN_OR_RETURN(acts, model::RunLayer(ctx, c, w, acts));
    double total = 0.0;
    for (const GemmShape& s : gemm.shapes()) {
      auto it = seconds.find(s);
      if (it == seconds.end()) {
        ASSIGN_OR_RETURN(const double t,
                         TimeDeviceProduct(*cublas, *backend, s, kernels::FloatType::kBF16));
        it = seconds.emplace(s, t).first;
      }
      total += it->second;
    }
    printf("layer %ld ratio %3ld  %4zu products  %7.3f GFLOP  GEMM %8.5f s  %7.2f TFLOP/s "
           "(%4.1f%% of peak)  %10.0f tokens/s if GEMM-bound\n",
           static_cast<long>(l), static_cast<long>(c.CompressRatio(l)), gemm.shapes().size(),
           gemm.flops() / 1e9, total, gemm.flops() / total / 1e12,
           100.0 * gemm.flops() / total / 1e12 / peak, tokens / total);
  }
  return absl::OkStatus();
}

// The whole-layer device table (--table cuda) for the model `config`, written to `dir` unless
// it is there.
absl::Status CudaLayerTable(const std::string& dir, const fixture::FixtureConfig& config,
                            int64_t sequences, int64_t seq_len, model::Numerics numerics) {
  RETURN_IF_ERROR(EnsureFixture(dir, config));
  ASSIGN_OR_RETURN(auto cuda, compute::OpenDevice("cuda:0", {}));
  ASSIGN_OR_RETURN(auto backend, kernels::MakeCudaBackend(0));
  const bool official = numerics == model::Numerics::kOfficial;
  const GemmShape peak_shape = official ? GemmShape{8192, 8192, 8192} : GemmShape{4096, 4096, 4096};
  ASSIGN_OR_RETURN(const double peak_s,
                   TimeDeviceProduct(*cuda->gemm(), *backend, peak_shape,
                                     official ? kernels::FloatType::kBF16
                                              : kernels::FloatType::kF32));
  const double peak = 2.0 * peak_shape.m * peak_shape.n * peak_shape.k / peak_s / 1e12;
  printf("cuBLAS peak: %s %ld^3 %.1f TFLOP/s (%s)\n", official ? "BF16" : "float32",
         static_cast<long>(peak_shape.m), peak, cuda->gemm()->name().c_str());
  printf("whole layers of %s on %s, %ld x %ld tokens, %s numerics\n", dir.c_str(),
         cuda->name().c_str(), static_cast<long>(sequences), static_cast<long>(seq_len),
         model::NumericsName(numerics));
  ASSIGN_OR_RETURN(auto ckpt, model::OpenV4Checkpoint(dir));
  CountingGemm gemm(cuda->gemm());
  ASSIGN_OR_RETURN(model::ForwardContext ctx, model::MakeForwardContext(*cuda, numerics, nullptr));
  ctx.gemm = &gemm;
  const model::V4Config& c = ckpt->config;
  ASSIGN_OR_RETURN(model::V4Activations acts,
                   model::Embed(*ckpt, Ids(sequences * seq_len, c.vocab_size), sequences,
                                seq_len));
  const double tokens = static_cast<double>(sequences * seq_len);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    auto t = Clock::now();
    ASSIGN_OR_RETURN(model::V4LayerWeights w, model::LoadLayer(*ckpt, l, *cuda));
    const double load = Seconds(t);
    ASSIGN_OR_RETURN(model::V4Activations out, model::RunLayer(ctx, c, w, acts));
    double run = 1e30, in_gemm = 0.0, flops = 0.0;
    for (int i = 0; i < 3; ++i) {
      gemm.Reset();
      t = Clock::now();
      ASSIGN_OR_RETURN(out, model::RunLayer(ctx, c, w, acts));
      if (Seconds(t) < run) {
        run = Seconds(t);
        in_gemm = gemm.seconds();
        flops = gemm.flops();
      }
    }
    printf("layer %ld ratio %3ld  load %6.2f s  run %8.5f s  %9.0f tokens/s  %7.3f GFLOP  "
           "%6.2f TFLOP/s over the run (%4.1f%% of peak), %6.2f inside cuBLAS (%4.1f%%, %4.1f%% "
           "of the run)\n",
           static_cast<long>(l), static_cast<long>(c.CompressRatio(l)), load, run, tokens / run,
           flops / 1e9, flops / run / 1e12, 100.0 * flops / run / 1e12 / peak,
           flops / in_gemm / 1e12, 100.0 * flops / in_gemm / 1e12 / peak,
           100.0 * in_gemm / run);
    acts = std::move(out);
  }
  return absl::OkStatus();
}

// Peak RSS (bytes) of Forward(dir) in a child process.
long ChildPeakRss(const std::string& dir, int64_t sequences, int64_t seq_len, int threads,
                  model::Numerics numerics) {
  const pid_t pid = fork();
  if (pid == 0) {
    const absl::Status s = Forward(dir, sequences, seq_len, threads, numerics, false, 1.0);
    if (!s.ok()) fprintf(stderr, "%s\n", s.ToString().c_str());
    _exit(s.ok() ? 0 : 1);
  }
  int status = 0;
  struct rusage usage {};
  if (pid < 0 || wait4(pid, &status, 0, &usage) != pid || !WIFEXITED(status) ||
      WEXITSTATUS(status) != 0) {
    return -1;
  }
  return usage.ru_maxrss * 1024L;
}

}  // namespace
}  // namespace quantd

int main(int argc, char** argv) {
  CLI::App app{"DeepSeek-V4 CPU forward benchmark"};
  std::string dir, numerics = "official";
  int64_t sequences = 2, seq_len = 256;
  int threads = 0;
  std::string table = "small4";
  app.add_option("--dir", dir, "scratch directory for the fixtures (reused)")->required();
  app.add_option("--sequences", sequences, "samples per batch");
  app.add_option("--seq-len", seq_len, "tokens per sample");
  app.add_option("--threads", threads, "CPU threads (0: all)");
  app.add_option("--numerics", numerics, "official or math")
      ->check(CLI::IsMember({"official", "math"}));
  app.add_option("--table", table,
                 "the model of the per-layer table: small4 / small8 (the small preset's shape "
                 "with 4 / 8 layers) or bench (the bench preset)")
      ->check(CLI::IsMember({"small4", "small8", "bench", "threads", "cublas", "cuda"}));
  CLI11_PARSE(app, argc, argv);
  using namespace quantd;
  const model::Numerics mode =
      numerics == "math" ? model::Numerics::kMath : model::Numerics::kOfficial;
  const std::string l4 = dir + "/layers4", l8 = dir + "/layers8", bench = dir + "/bench";
  if (table == "threads") {
    const std::string tiny = dir + "/tiny";
    for (const auto& [path, config] :
         {std::pair{tiny, fixture::MakeConfig(fixture::Arch::kDeepseekV4, fixture::Preset::kTiny)},
          std::pair{l4, BenchConfig(4)}}) {
      if (absl::Status s = EnsureFixture(path, config); !s.ok()) {
        fprintf(stderr, "%s\n", s.ToString().c_str());
        return 1;
      }
    }
    const absl::Status s =
        HostThreadTable({{"tiny", tiny}, {"small4", l4}}, sequences, seq_len, threads, mode);
    if (!s.ok()) fprintf(stderr, "%s\n", s.ToString().c_str());
    return s.ok() ? 0 : 1;
  }
  if (table == "cublas") {
    const absl::Status s = CublasTable(l4, BenchConfig(4), sequences, seq_len, mode);
    if (!s.ok()) fprintf(stderr, "%s\n", s.ToString().c_str());
    return s.ok() ? 0 : 1;
  }
  if (table == "cuda") {
    const absl::Status s = CudaLayerTable(l4, BenchConfig(4), sequences, seq_len, mode);
    if (!s.ok()) fprintf(stderr, "%s\n", s.ToString().c_str());
    return s.ok() ? 0 : 1;
  }
  std::vector<std::pair<std::string, fixture::FixtureConfig>> fixtures = {{l4, BenchConfig(4)},
                                                                          {l8, BenchConfig(8)}};
  if (table == "bench") {
    fixtures.push_back(
        {bench, fixture::MakeConfig(fixture::Arch::kDeepseekV4, fixture::Preset::kBench)});
  }
  for (const auto& [path, config] : fixtures) {
    if (absl::Status s = EnsureFixture(path, config); !s.ok()) {
      fprintf(stderr, "%s\n", s.ToString().c_str());
      return 1;
    }
  }
  // The children first, while this process is small: a child's peak RSS starts from what it
  // inherits at fork.
  const long rss4 = ChildPeakRss(l4, sequences, seq_len, threads, mode);
  const long rss8 = ChildPeakRss(l8, sequences, seq_len, threads, mode);
  auto gemm = kernels::MakeOpenBlasGemm(threads);
  const double peak = SgemmPeakGflops(*gemm);
  printf("OpenBLAS sgemm 2048^3 peak: %.1f GFLOP/s (threads %d, 0 = all)\n", peak, threads);
  printf("per-layer table: %s, %ld x %ld tokens, %s numerics\n", table.c_str(),
         static_cast<long>(sequences), static_cast<long>(seq_len), numerics.c_str());
  const std::string table_dir = table == "bench" ? bench : (table == "small8" ? l8 : l4);
  if (absl::Status s = Forward(table_dir, sequences, seq_len, threads, mode, true, peak); !s.ok()) {
    fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  printf(
      "peak RSS, whole forward layer by layer: 4 layers %.1f MiB, 8 layers %.1f MiB "
      "(ratio %.3f)\n",
      rss4 / 1048576.0, rss8 / 1048576.0, static_cast<double>(rss8) / static_cast<double>(rss4));
  return rss4 > 0 && rss8 > 0 ? 0 : 1;
}
