// The CPU backend: validates arguments, splits the rows of each operation across threads and runs
// the row kernels of the chosen SIMD level (kernels/cpu/row_kernels.h) on each range.
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "absl/strings/str_cat.h"
#include "kernels/backends.h"
#include "kernels/cpu/row_kernels.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/formats.h"
#include "kernels/validate.h"

namespace quantd::kernels {
namespace {

using cpu::RowKernels;

constexpr size_t kAlignment = 64;
// Below this many elements per worker, waking a worker costs about as much as it saves.
constexpr int64_t kMinElementsPerWorker = 32 * 1024;
// Row-independent work on a tensor with few rows is cut into this many ranges per worker...
constexpr int64_t kRangesPerWorker = 8;
// ...each at least this many columns wide (or the whole row, if shorter).
constexpr int64_t kMinViewCols = 1024;

// Holds the SSE control register at its defaults (round to nearest even, no flush-to-zero, no
// denormals-are-zero) for a scope, so that kernels compute with IEEE subnormals as formats.h
// specifies even in a process that enabled FTZ/DAZ (e.g. through a library built -ffast-math).
class DefaultFloatModes {
 public:
#if defined(__x86_64__)
  DefaultFloatModes() : saved_(_mm_getcsr()) { _mm_setcsr(kDefaultMxcsr); }
  ~DefaultFloatModes() { _mm_setcsr(saved_); }

 private:
  static constexpr unsigned kDefaultMxcsr = 0x1F80;  // all exceptions masked, nothing else set
  unsigned saved_;                                   // the caller's MXCSR, restored on exit
#endif
};

// Why the FP8 element at flat index `i` was rejected, checked in the order the kernels check.
std::string Fp8Problem(const Fp8BlockTensor& src, int64_t i) {
  const int64_t scale_cols = (src.cols + kFp8BlockSize - 1) / kFp8BlockSize;
  const int64_t si = (i / src.cols / kFp8BlockSize) * scale_cols + (i % src.cols) / kFp8BlockSize;
  if (src.scale_type == Fp8ScaleType::kE8M0) {
    if (formats::E8m0IsNan(static_cast<const uint8_t*>(src.scales)[si])) return "NaN E8M0 scale";
  } else {
    const float scale = static_cast<const float*>(src.scales)[si];
    if (!formats::IsFinite(scale) || !(scale > 0.0f)) return "non-finite or non-positive F32 scale";
  }
  return "NaN E4M3 code";
}

class CpuBackend final : public Backend {
 public:
  CpuBackend(const RowKernels* kernels, int threads)
      : kernels_(kernels),
        threads_(threads),
        pool_(threads > 1 ? std::make_unique<cpu::ThreadPool>(threads) : nullptr) {}

  std::string name() const override { return absl::StrCat("cpu-", kernels_->name); }
  bool host_memory() const override { return true; }

  absl::StatusOr<Buffer> Allocate(size_t bytes) override {
    const size_t size = std::max<size_t>((bytes + kAlignment - 1) / kAlignment, 1) * kAlignment;
    if (size < bytes)
      return absl::InvalidArgumentError(absl::StrCat("cannot allocate ", bytes, " bytes"));
    void* data = aligned_alloc(kAlignment, size);
    if (data == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot allocate ", bytes, " bytes of host memory"));
    }
    return Buffer(data, bytes, &free);
  }

  absl::Status CopyToBackend(void* dst, const void* host_src, size_t bytes) override {
    return Copy(dst, host_src, bytes);
  }

  absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes) override {
    return Copy(host_dst, src, bytes);
  }

  absl::Status Fp8BlockDequant(const Fp8BlockTensor& src, const DenseOut& dst) override {
    if (auto s = ValidateFp8Block(src); !s.ok()) return s;
    if (auto s = ValidateOut(dst.data, "FP8 block dequant"); !s.ok()) return s;
    // 128x128 blocks span rows, so FP8 work is split by rows only.
    const int64_t bad = RunRows(src.rows, src.cols, [&](int, int64_t begin, int64_t end) {
      return kernels_->fp8_block_dequant(src, dst, begin, end);
    });
    if (bad >= 0) return BadElement(Fp8Problem(src, bad), bad, src.cols);
    return absl::OkStatus();
  }

  absl::Status Mxfp4Dequant(const Mxfp4Tensor& src, const DenseOut& dst) override {
    if (auto s = ValidateMxfp4(src); !s.ok()) return s;
    if (auto s = ValidateOut(dst.data, "MXFP4 dequant"); !s.ok()) return s;
    const Mxfp4Tensor view = Reshaped(src, kMxfp4BlockSize);
    const int64_t bad = RunRows(view.rows, view.cols, [&](int, int64_t begin, int64_t end) {
      return kernels_->mxfp4_dequant(view, dst, begin, end);
    });
    if (bad >= 0) return BadElement("NaN E8M0 scale", bad, src.cols);
    return absl::OkStatus();
  }

  absl::StatusOr<float> AbsMax(const DenseTensor& src) override {
    if (auto s = ValidateDense(src, 1); !s.ok()) return s;
    const DenseTensor view = Reshaped(src, 1);
    std::vector<float> amax(threads_, 0.0f);  // per worker
    const int64_t bad = RunRows(view.rows, view.cols, [&](int w, int64_t begin, int64_t end) {
      return kernels_->abs_max(view, begin, end, &amax[w]);
    });
    if (bad >= 0) return BadElement("non-finite value", bad, src.cols);
    return *std::max_element(amax.begin(), amax.end());
  }

  absl::Status BlockAbsMax16(const DenseTensor& src, float* out) override {
    if (auto s = ValidateDense(src, kNvfp4BlockSize); !s.ok()) return s;
    if (auto s = ValidateOut(out, "block abs-max"); !s.ok()) return s;
    const DenseTensor view = Reshaped(src, kNvfp4BlockSize);
    const int64_t bad = RunRows(view.rows, view.cols, [&](int, int64_t begin, int64_t end) {
      return kernels_->block_abs_max16(view, out, begin, end);
    });
    if (bad >= 0) return BadElement("non-finite value", bad, src.cols);
    return absl::OkStatus();
  }

  absl::Status Nvfp4QuantizeWithScale(const DenseTensor& src, float scale_2,
                                      const Nvfp4Out& dst) override {
    const DenseTensor view = Reshaped(src, kNvfp4BlockSize);
    const int64_t bad = RunRows(view.rows, view.cols, [&](int, int64_t begin, int64_t end) {
      return kernels_->nvfp4_quantize(view, scale_2, dst, begin, end);
    });
    if (bad >= 0) return BadElement("non-finite value", bad, src.cols);
    return absl::OkStatus();
  }

  absl::Status Nvfp4Dequant(const Nvfp4Tensor& src, const DenseOut& dst) override {
    if (auto s = ValidateNvfp4(src); !s.ok()) return s;
    if (auto s = ValidateOut(dst.data, "NVFP4 dequant"); !s.ok()) return s;
    const Nvfp4Tensor view = Reshaped(src, kNvfp4BlockSize);
    const int64_t blocks_per_row = view.cols / kNvfp4BlockSize;
    const int64_t bad = RunRows(view.rows, view.cols, [&](int, int64_t begin, int64_t end) {
      // The reference decodes NaN scales to NaN; the Backend contract rejects them instead.
      for (int64_t b = begin * blocks_per_row; b < end * blocks_per_row; ++b) {
        if (formats::E4m3IsNan(src.scales[b])) return b * kNvfp4BlockSize;
      }
      kernels_->nvfp4_dequant(view, dst, begin, end);
      return int64_t{-1};
    });
    if (bad >= 0) return BadElement("NaN E4M3 scale", bad, src.cols);
    return absl::OkStatus();
  }

  absl::StatusOr<int> Mxfp4MaxExponent(const Mxfp4Tensor& src) override {
    if (auto s = ValidateMxfp4(src); !s.ok()) return s;
    const Mxfp4Tensor view = Reshaped(src, kMxfp4BlockSize);
    std::vector<uint8_t> max_byte(threads_, 0);  // per worker
    const int64_t bad = RunRows(view.rows, view.cols, [&](int w, int64_t begin, int64_t end) {
      return kernels_->mxfp4_max_scale(view, begin, end, &max_byte[w]);
    });
    if (bad >= 0) return BadElement("NaN E8M0 scale", bad, src.cols);
    return static_cast<int>(*std::max_element(max_byte.begin(), max_byte.end())) - 127;
  }

  absl::StatusOr<int64_t> Mxfp4ToNvfp4WithKmax(const Mxfp4Tensor& src, int kmax,
                                               const Nvfp4Out& dst) override {
    const Mxfp4Tensor view = Reshaped(src, kMxfp4BlockSize);
    std::vector<int64_t> requantized(threads_, 0);  // per worker
    const int64_t bad = RunRows(view.rows, view.cols, [&](int w, int64_t begin, int64_t end) {
      return kernels_->mxfp4_to_nvfp4(view, kmax, dst, begin, end, &requantized[w]);
    });
    if (bad >= 0) return BadElement("NaN E8M0 scale", bad, src.cols);
    int64_t total = 0;
    for (int64_t n : requantized) total += n;
    return total;
  }

 private:
  using RowFn = std::function<int64_t(int worker, int64_t row_begin, int64_t row_end)>;

  static absl::Status Copy(void* dst, const void* src, size_t bytes) {
    if (bytes == 0) return absl::OkStatus();
    if (dst == nullptr || src == nullptr) {
      return absl::InvalidArgumentError("CPU copy: source or destination is null");
    }
    memcpy(dst, src, bytes);
    return absl::OkStatus();
  }

  // Runs fn on contiguous row ranges of [0, rows) on up to threads_ workers; returns the smallest
  // bad index any range reported (the first bad element of the tensor), or -1.
  int64_t RunRows(int64_t rows, int64_t cols, const RowFn& fn) const {
    const int workers = static_cast<int>(std::min<int64_t>(
        {threads_, rows, std::max<int64_t>(1, rows * cols / kMinElementsPerWorker)}));
    std::vector<int64_t> bad(workers, -1);
    const auto range = [&](int w, int64_t begin, int64_t end) {
      DefaultFloatModes modes;
      bad[w] = fn(w, begin, end);
    };
    if (pool_ != nullptr) {
      pool_->Run(workers, rows, range);
    } else {
      range(0, 0, rows);
    }
    int64_t first = -1;
    for (int64_t i : bad) {
      if (i >= 0 && (first < 0 || i < first)) first = i;
    }
    return first;
  }

  // The row length to split row-independent work by. A tensor with enough rows keeps its own;
  // one with few rows is viewed as [rows * cols / c, c] for a divisor c of cols that is a
  // multiple of `block`: flat element indices, block boundaries and the flat position of each
  // block's scale are the same in both views.
  int64_t ViewCols(int64_t rows, int64_t cols, int64_t block) const {
    const int64_t target = threads_ * kRangesPerWorker;
    if (threads_ == 1 || rows >= target) return cols;
    const int64_t blocks = cols / block;
    int64_t best = 1;
    for (int64_t k = 2; k <= blocks && cols / k >= kMinViewCols; ++k) {
      if (blocks % k != 0) continue;
      best = k;
      if (rows * k >= target) break;
    }
    return cols / best;
  }

  // `t` viewed with ViewCols columns (DenseTensor, Mxfp4Tensor or Nvfp4Tensor).
  template <typename Tensor>
  Tensor Reshaped(const Tensor& t, int64_t block) const {
    Tensor view = t;
    view.cols = ViewCols(t.rows, t.cols, block);
    view.rows = t.rows * t.cols / view.cols;
    return view;
  }

  const RowKernels* kernels_;  // the SIMD level's row kernels
  int threads_;                // most workers one operation uses
  // Started once and reused by every operation (starting threads per call cost more than a small
  // operation's work); nullptr for one thread. Operations from several threads take turns on it.
  std::unique_ptr<cpu::ThreadPool> pool_;
};

const char* LevelName(SimdLevel level) {
  switch (level) {
    case SimdLevel::kAuto:
      return "auto";
    case SimdLevel::kScalar:
      return "scalar";
    case SimdLevel::kAvx2:
      return "avx2";
    case SimdLevel::kAvx512:
      return "avx512";
  }
  return "unknown";
}

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> MakeCpuBackend(const CpuOptions& options) {
  if (options.threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("CPU backend: threads must be >= 0, got ", options.threads));
  }
  const int threads = options.threads > 0
                          ? options.threads
                          : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  const std::vector<SimdLevel> levels = SupportedSimdLevels();
  SimdLevel level = options.simd;
  if (level == SimdLevel::kAuto) {
    level = levels.back();
  } else if (std::find(levels.begin(), levels.end(), level) == levels.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("CPU backend: this CPU does not support SIMD level ", LevelName(level)));
  }
  const RowKernels* kernels = cpu::RowKernelsFor(level);
  if (kernels == nullptr) {
    return absl::UnimplementedError(
        absl::StrCat("CPU backend: SIMD level ", LevelName(level), " is not built on this target"));
  }
  return std::make_unique<CpuBackend>(kernels, threads);
}

}  // namespace quantd::kernels
