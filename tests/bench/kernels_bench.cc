// Throughput of every Backend operation on an expert-sized tensor ([2048, 4096]), in bytes read +
// written per second, for each CPU SIMD level on 1 and 2 threads (and CUDA device 0 when one
// exists), next to memcpy moving the same number of bytes on as many threads in the same run.
//
// Names: "op/<op>/<backend>/t<threads>" and "memcpy/<op>/t<threads>" (memcpy of half the op's
// bytes: as much read plus written). Rates are per wall-clock second; the CPU time reported is
// the whole process's, so that bytes per CPU-second can be derived where other load competes
// for the cores. tests/bench/run_kernels_bench.sh prints the table and the ratios.
#include <benchmark/benchmark.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/backends.h"
#include "kernels/cpu/parallel_for.h"
#include "kernels/formats.h"
#include "tests/unit/test_vectors.h"

namespace quantd::kernels {
namespace {

constexpr int64_t kRows = 2048;
constexpr int64_t kCols = 4096;
constexpr int64_t kN = kRows * kCols;
constexpr int64_t kFp8Scales = (kRows / 128) * (kCols / 128);

// Inputs and outputs of every benchmarked operation, in one backend's memory.
struct Workspace {
  Buffer bf16;                 // [kRows, kCols] BF16 weights
  Buffer fp8_data;             // E4M3 codes
  Buffer fp8_e8m0;             // E8M0 block scales
  Buffer fp8_f32;              // F32 block scales
  Buffer mx_data;              // packed E2M1
  Buffer mx_scales;            // E8M0 per 32
  Buffer nv_data;              // packed E2M1
  Buffer nv_scales;            // E4M3 per 16
  Buffer dense_out;            // BF16 output
  Buffer out_data;             // packed E2M1 output
  Buffer out_scales;           // E4M3 output scales
  Buffer block_amax;           // float per 16-block
  float nv_scale_2 = 0.0137f;  // weight_scale_2 of nv_*
  float partner_amax = 0.0f;   // a fused partner's (larger) amax for bf16
  float out_scale_2 = 0.0f;    // weight_scale_2 written by quantize / cast
};

// Exits with the error: a benchmark without its buffers has nothing to measure.
void CheckOk(const absl::Status& status) {
  if (status.ok()) return;
  fprintf(stderr, "quantd_kernels_bench: %s\n", status.ToString().c_str());
  exit(1);
}

Buffer Upload(Backend& backend, const std::vector<uint8_t>& bytes) {
  absl::StatusOr<Buffer> buf = backend.Allocate(bytes.size());
  CheckOk(buf.status());
  CheckOk(backend.CopyToBackend(buf->data(), bytes.data(), bytes.size()));
  return *std::move(buf);
}

// An output buffer with every page already touched, so no run pays for first-touch faults.
Buffer Output(Backend& backend, size_t size) {
  return Upload(backend, std::vector<uint8_t>(size, 0));
}

std::unique_ptr<Workspace> MakeWorkspace(Backend& backend) {
  auto ws = std::make_unique<Workspace>();
  const test_vectors::Dense weights =
      test_vectors::RandomWeights(FloatType::kBF16, kRows, kCols, 1);
  ws->bf16 = Upload(backend, weights.bytes);
  float amax = 0.0f;
  for (int64_t i = 0; i < kN; ++i)
    amax = std::max(amax, std::fabs(weights.Get(i / kCols, i % kCols)));
  ws->partner_amax = formats::Bf16ToFloat(formats::FloatToBf16(amax * 1.25f));
  const test_vectors::Fp8 e8m0 = test_vectors::RandomFp8(Fp8ScaleType::kE8M0, kRows, kCols, 2);
  ws->fp8_data = Upload(backend, e8m0.data);
  ws->fp8_e8m0 = Upload(backend, e8m0.scales);
  ws->fp8_f32 =
      Upload(backend, test_vectors::RandomFp8(Fp8ScaleType::kF32, kRows, kCols, 3).scales);
  // Realistic MXFP4 expert: exponents within 13 of the largest (0), so the cast keeps every block.
  const test_vectors::Mxfp4 mx = test_vectors::RandomMxfp4(kRows, kCols, 4, 114, 127);
  ws->mx_data = Upload(backend, mx.data);
  ws->mx_scales = Upload(backend, mx.scales);
  const test_vectors::Nvfp4 nv = test_vectors::RandomNvfp4(kRows, kCols, 5);
  ws->nv_data = Upload(backend, nv.data);
  ws->nv_scales = Upload(backend, nv.scales);
  ws->nv_scale_2 = nv.scale_2;
  ws->dense_out = Output(backend, kN * 2);
  ws->out_data = Output(backend, kN / 2);
  ws->out_scales = Output(backend, kN / 16);
  ws->block_amax = Output(backend, kN / 16 * sizeof(float));
  return ws;
}

struct Op {
  std::string name;
  int64_t bytes;  // read + written per run
  std::function<absl::Status(Backend&, Workspace&)> run;
};

std::vector<Op> Ops() {
  auto dense_in = [](Workspace& w) {
    return DenseTensor{w.bf16.data(), FloatType::kBF16, kRows, kCols};
  };
  auto bf16_out = [](Workspace& w) { return DenseOut{w.dense_out.data(), FloatType::kBF16}; };
  auto nv_out = [](Workspace& w) {
    return Nvfp4Out{w.out_data.as<uint8_t>(), w.out_scales.as<uint8_t>(), &w.out_scale_2};
  };
  auto mx_in = [](Workspace& w) {
    return Mxfp4Tensor{w.mx_data.as<uint8_t>(), w.mx_scales.as<uint8_t>(), kRows, kCols};
  };
  return {
      {"fp8_e8m0_dequant_bf16", kN + kFp8Scales + 2 * kN,
       [=](Backend& b, Workspace& w) {
         return b.Fp8BlockDequant(
             {w.fp8_data.as<uint8_t>(), w.fp8_e8m0.data(), Fp8ScaleType::kE8M0, kRows, kCols},
             bf16_out(w));
       }},
      {"fp8_f32scale_dequant_bf16", kN + 4 * kFp8Scales + 2 * kN,
       [=](Backend& b, Workspace& w) {
         return b.Fp8BlockDequant(
             {w.fp8_data.as<uint8_t>(), w.fp8_f32.data(), Fp8ScaleType::kF32, kRows, kCols},
             bf16_out(w));
       }},
      {"mxfp4_dequant_bf16", kN / 2 + kN / 32 + 2 * kN,
       [=](Backend& b, Workspace& w) { return b.Mxfp4Dequant(mx_in(w), bf16_out(w)); }},
      {"nvfp4_dequant_bf16", kN / 2 + kN / 16 + 2 * kN,
       [=](Backend& b, Workspace& w) {
         return b.Nvfp4Dequant(
             {w.nv_data.as<uint8_t>(), w.nv_scales.as<uint8_t>(), w.nv_scale_2, kRows, kCols},
             bf16_out(w));
       }},
      {"abs_max_bf16", 2 * kN,
       [=](Backend& b, Workspace& w) { return b.AbsMax(dense_in(w)).status(); }},
      {"block_abs_max16_bf16", 2 * kN + kN / 16 * 4,
       [=](Backend& b, Workspace& w) {
         return b.BlockAbsMax16(dense_in(w), w.block_amax.as<float>());
       }},
      // The tensor's own amax: a second pass over the input, not counted in the bytes.
      {"nvfp4_quantize_bf16", 2 * kN + kN / 2 + kN / 16,
       [=](Backend& b, Workspace& w) {
         return b.Nvfp4Quantize(dense_in(w), GlobalAmax(), nv_out(w));
       }},
      {"nvfp4_quantize_bf16_shared_amax", 2 * kN + kN / 2 + kN / 16,
       [=](Backend& b, Workspace& w) {
         return b.Nvfp4Quantize(dense_in(w), GlobalAmax(w.partner_amax), nv_out(w));
       }},
      {"mxfp4_to_nvfp4", (kN / 2 + kN / 32) + (kN / 2 + kN / 16),
       [=](Backend& b, Workspace& w) { return b.Mxfp4ToNvfp4(mx_in(w), 0, nv_out(w)).status(); }},
  };
}

void RunOp(benchmark::State& state, Backend* backend, Workspace* ws, const Op& op) {
  for (auto _ : state) {
    const absl::Status s = op.run(*backend, *ws);
    if (!s.ok()) {
      state.SkipWithError(s.ToString().c_str());
      break;
    }
  }
  state.SetBytesProcessed(state.iterations() * op.bytes);
}

// memcpy of `bytes` split into `threads` contiguous pieces, each on its own thread.
void RunMemcpy(benchmark::State& state, uint8_t* dst, const uint8_t* src, int64_t bytes,
               int threads) {
  for (auto _ : state) {
    cpu::ParallelFor(threads, threads, [&](int w, int64_t, int64_t) {
      const int64_t begin = bytes * w / threads;
      const int64_t end = bytes * (w + 1) / threads;
      memcpy(dst + begin, src + begin, end - begin);
    });
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * 2 * bytes);
}

const char* LevelName(SimdLevel level) {
  return level == SimdLevel::kScalar ? "scalar" : level == SimdLevel::kAvx2 ? "avx2" : "avx512";
}

// Owned for the whole run: backends, their workspaces and the memcpy buffers.
struct Registry {
  std::vector<std::unique_ptr<Backend>> backends;
  std::vector<std::unique_ptr<Workspace>> workspaces;
  std::vector<uint8_t> copy_src, copy_dst;
  std::vector<Op> ops = Ops();
};

void RegisterAll(Registry& reg) {
  int64_t max_bytes = 0;
  for (const Op& op : reg.ops) max_bytes = std::max(max_bytes, op.bytes);
  reg.copy_src.assign(max_bytes / 2 + 1, 1);
  reg.copy_dst.assign(max_bytes / 2 + 1, 0);
  const std::vector<SimdLevel> levels = SupportedSimdLevels();
  for (int threads : {1, 2}) {
    std::vector<Backend*> cpus;  // one per level
    for (SimdLevel level : levels) {
      absl::StatusOr<std::unique_ptr<Backend>> backend = MakeCpuBackend({threads, level});
      CheckOk(backend.status());
      reg.backends.push_back(*std::move(backend));
      cpus.push_back(reg.backends.back().get());
    }
    if (reg.workspaces.empty()) reg.workspaces.push_back(MakeWorkspace(*cpus[0]));
    Workspace* ws = reg.workspaces[0].get();  // host memory serves every CPU backend
    for (const Op& op : reg.ops) {
      benchmark::RegisterBenchmark(absl::StrCat("memcpy/", op.name, "/t", threads).c_str(),
                                   [&reg, &op, threads](benchmark::State& s) {
                                     RunMemcpy(s, reg.copy_dst.data(), reg.copy_src.data(),
                                               op.bytes / 2, threads);
                                   })
          ->UseRealTime()
          ->MeasureProcessCPUTime()
          ->Unit(benchmark::kMillisecond);
      for (size_t i = 0; i < levels.size(); ++i) {
        Backend* backend = cpus[i];
        benchmark::RegisterBenchmark(
            absl::StrCat("op/", op.name, "/", LevelName(levels[i]), "/t", threads).c_str(),
            [backend, ws, &op](benchmark::State& s) { RunOp(s, backend, ws, op); })
            ->UseRealTime()
            ->MeasureProcessCPUTime()
            ->Unit(benchmark::kMillisecond);
      }
    }
  }
  if (CudaDeviceCount() == 0) return;
  absl::StatusOr<std::unique_ptr<Backend>> cuda = MakeCudaBackend(0);
  if (!cuda.ok()) return;
  Backend* backend = cuda->get();
  reg.backends.push_back(*std::move(cuda));
  reg.workspaces.push_back(MakeWorkspace(*backend));
  Workspace* ws = reg.workspaces.back().get();
  for (const Op& op : reg.ops) {
    benchmark::RegisterBenchmark(
        absl::StrCat("op/", op.name, "/cuda0/t1").c_str(),
        [backend, ws, &op](benchmark::State& s) { RunOp(s, backend, ws, op); })
        ->UseRealTime()
        ->MeasureProcessCPUTime()
        ->Unit(benchmark::kMillisecond);
  }
}

}  // namespace
}  // namespace quantd::kernels

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  quantd::kernels::Registry registry;
  quantd::kernels::RegisterAll(registry);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
