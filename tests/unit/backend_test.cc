// Every Backend (each CPU SIMD level on 1, 2 and 3 threads, and CUDA device 0 when present)
// against the scalar reference (kernels/reference.h) run single-threaded on the same host
// tensors: output bytes must be identical, and bad input must be rejected naming the first bad
// element. All backend memory is reached through Allocate / CopyToBackend / CopyToHost, so the
// same tests drive device memory.
#include <gtest/gtest.h>
#include <stdint.h>
#include <string.h>

#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/backends.h"
#include "kernels/formats.h"
#include "kernels/reference.h"
#include "tests/unit/test_vectors.h"

namespace quantd::kernels {
namespace {

using test_vectors::Dense;
using test_vectors::Fp8;
using test_vectors::Mxfp4;
using test_vectors::Nvfp4;

struct BackendParam {
  std::string label;  // test-name suffix
  SimdLevel simd = SimdLevel::kScalar;
  int threads = 1;
  bool cuda = false;
};

void PrintTo(const BackendParam& p, std::ostream* os) { *os << p.label; }

std::vector<BackendParam> AllBackends() {
  std::vector<BackendParam> params;
  for (SimdLevel level : SupportedSimdLevels()) {
    const char* name = level == SimdLevel::kScalar ? "scalar"
                       : level == SimdLevel::kAvx2 ? "avx2"
                                                   : "avx512";
    for (int threads : {1, 2, 3}) {
      params.push_back({absl::StrCat("cpu_", name, "_t", threads), level, threads, false});
    }
  }
  params.push_back({"cuda0", SimdLevel::kAuto, 0, true});
  return params;
}

// Bytes of a dense [rows, cols] output.
size_t OutSize(int64_t rows, int64_t cols, FloatType type) {
  return rows * cols * (type == FloatType::kF32 ? 4 : 2);
}

// "" when equal, else the first differing byte.
std::string FirstMismatch(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
  if (got.size() != want.size()) return absl::StrCat("size ", got.size(), " != ", want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      return absl::StrCat("byte ", i, ": got 0x", absl::Hex(got[i]), ", want 0x",
                          absl::Hex(want[i]));
    }
  }
  return "";
}

class BackendTest : public ::testing::TestWithParam<BackendParam> {
 protected:
  void SetUp() override {
    const BackendParam& p = GetParam();
    if (p.cuda && CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    absl::StatusOr<std::unique_ptr<Backend>> b =
        p.cuda ? MakeCudaBackend(0) : MakeCpuBackend({p.threads, p.simd});
    ASSERT_TRUE(b.ok()) << b.status();
    backend_ = *std::move(b);
  }

  // A backend buffer holding a copy of `bytes`.
  Buffer Upload(const std::vector<uint8_t>& bytes) {
    Buffer buf = Alloc(bytes.size());
    const absl::Status s = backend_->CopyToBackend(buf.data(), bytes.data(), bytes.size());
    EXPECT_TRUE(s.ok()) << s;
    return buf;
  }
  // A backend buffer of `size` uninitialized bytes.
  Buffer Alloc(size_t size) {
    absl::StatusOr<Buffer> buf = backend_->Allocate(size);
    EXPECT_TRUE(buf.ok()) << buf.status();
    return buf.ok() ? *std::move(buf) : Buffer();
  }
  // The first `size` bytes of `buf`.
  std::vector<uint8_t> Download(const Buffer& buf, size_t size) {
    std::vector<uint8_t> host(size);
    const absl::Status s = backend_->CopyToHost(host.data(), buf.data(), size);
    EXPECT_TRUE(s.ok()) << s;
    return host;
  }

  // Dequantized output bytes of each op, computed by the backend under test...
  std::vector<uint8_t> Fp8Dequant(const Fp8& t, FloatType out_type, absl::Status* status) {
    Buffer data = Upload(t.data), scales = Upload(t.scales);
    const size_t out_size = OutSize(t.rows, t.cols, out_type);
    Buffer out = Alloc(out_size);
    *status = backend_->Fp8BlockDequant(t.View(data.as<uint8_t>(), scales.data()),
                                        {out.data(), out_type});
    return Download(out, out_size);
  }
  std::vector<uint8_t> Mxfp4Dequant(const Mxfp4& t, FloatType out_type, absl::Status* status) {
    Buffer data = Upload(t.data), scales = Upload(t.scales);
    const size_t out_size = OutSize(t.rows, t.cols, out_type);
    Buffer out = Alloc(out_size);
    *status = backend_->Mxfp4Dequant(t.View(data.as<uint8_t>(), scales.as<uint8_t>()),
                                     {out.data(), out_type});
    return Download(out, out_size);
  }
  std::vector<uint8_t> Nvfp4Dequant(const Nvfp4& t, FloatType out_type, absl::Status* status) {
    Buffer data = Upload(t.data), scales = Upload(t.scales);
    const size_t out_size = OutSize(t.rows, t.cols, out_type);
    Buffer out = Alloc(out_size);
    *status = backend_->Nvfp4Dequant(t.View(data.as<uint8_t>(), scales.as<uint8_t>()),
                                     {out.data(), out_type});
    return Download(out, out_size);
  }
  absl::StatusOr<float> AbsMax(const Dense& t) {
    Buffer in = Upload(t.bytes);
    return backend_->AbsMax(t.View(in.data()));
  }
  std::vector<uint8_t> BlockAbsMax16(const Dense& t, absl::Status* status) {
    Buffer in = Upload(t.bytes);
    const size_t out_size = t.rows * t.cols / kNvfp4BlockSize * sizeof(float);
    Buffer out = Alloc(out_size);
    *status = backend_->BlockAbsMax16(t.View(in.data()), out.as<float>());
    return Download(out, out_size);
  }
  // ...and NVFP4 outputs: packed values, block scales, weight_scale_2.
  Nvfp4 Quantize(const Dense& t, GlobalAmax amax, absl::Status* status) {
    Buffer in = Upload(t.bytes);
    Nvfp4 q;
    q.rows = t.rows;
    q.cols = t.cols;
    Buffer data = Alloc(t.rows * t.cols / 2), scales = Alloc(t.rows * t.cols / kNvfp4BlockSize);
    *status = backend_->Nvfp4Quantize(t.View(in.data()), amax,
                                      {data.as<uint8_t>(), scales.as<uint8_t>(), &q.scale_2});
    q.data = Download(data, t.rows * t.cols / 2);
    q.scales = Download(scales, t.rows * t.cols / kNvfp4BlockSize);
    return q;
  }
  Nvfp4 ToNvfp4(const Mxfp4& t, int kmax, absl::StatusOr<int64_t>* requantized) {
    Buffer in_data = Upload(t.data), in_scales = Upload(t.scales);
    Nvfp4 q;
    q.rows = t.rows;
    q.cols = t.cols;
    Buffer data = Alloc(t.rows * t.cols / 2), scales = Alloc(t.rows * t.cols / kNvfp4BlockSize);
    *requantized =
        backend_->Mxfp4ToNvfp4(t.View(in_data.as<uint8_t>(), in_scales.as<uint8_t>()), kmax,
                               {data.as<uint8_t>(), scales.as<uint8_t>(), &q.scale_2});
    q.data = Download(data, t.rows * t.cols / 2);
    q.scales = Download(scales, t.rows * t.cols / kNvfp4BlockSize);
    return q;
  }
  absl::StatusOr<int> MaxExponent(const Mxfp4& t) {
    Buffer data = Upload(t.data), scales = Upload(t.scales);
    return backend_->Mxfp4MaxExponent(t.View(data.as<uint8_t>(), scales.as<uint8_t>()));
  }

  std::unique_ptr<Backend> backend_;
};

// ---- the reference, single-threaded on host memory -----------------------------------------

std::vector<uint8_t> RefFp8Dequant(const Fp8& t, FloatType out_type) {
  std::vector<uint8_t> out(OutSize(t.rows, t.cols, out_type));
  EXPECT_EQ(reference::Fp8BlockDequantRows(t.View(t.data.data(), t.scales.data()),
                                           {out.data(), out_type}, 0, t.rows),
            -1);
  return out;
}

std::vector<uint8_t> RefMxfp4Dequant(const Mxfp4& t, FloatType out_type) {
  std::vector<uint8_t> out(OutSize(t.rows, t.cols, out_type));
  EXPECT_EQ(reference::Mxfp4DequantRows(t.View(t.data.data(), t.scales.data()),
                                        {out.data(), out_type}, 0, t.rows),
            -1);
  return out;
}

std::vector<uint8_t> RefNvfp4Dequant(const Nvfp4& t, FloatType out_type) {
  std::vector<uint8_t> out(OutSize(t.rows, t.cols, out_type));
  reference::Nvfp4DequantRows(t.View(t.data.data(), t.scales.data()), {out.data(), out_type}, 0,
                              t.rows);
  return out;
}

float RefAbsMax(const Dense& t) {
  float amax = -1.0f;
  EXPECT_EQ(reference::AbsMaxRows(t.View(t.bytes.data()), 0, t.rows, &amax), -1);
  return amax;
}

std::vector<uint8_t> RefBlockAbsMax16(const Dense& t) {
  std::vector<uint8_t> out(t.rows * t.cols / kNvfp4BlockSize * sizeof(float));
  EXPECT_EQ(reference::BlockAbsMax16Rows(t.View(t.bytes.data()),
                                         reinterpret_cast<float*>(out.data()), 0, t.rows),
            -1);
  return out;
}

Nvfp4 RefQuantize(const Dense& t, GlobalAmax amax) {
  Nvfp4 q;
  q.rows = t.rows;
  q.cols = t.cols;
  q.data.resize(t.rows * t.cols / 2);
  q.scales.resize(t.rows * t.cols / kNvfp4BlockSize);
  q.scale_2 = formats::Nvfp4GlobalScale(amax.has_value() ? *amax : RefAbsMax(t));
  EXPECT_EQ(reference::Nvfp4QuantizeRows(t.View(t.bytes.data()), q.scale_2,
                                         {q.data.data(), q.scales.data(), nullptr}, 0, t.rows),
            -1);
  return q;
}

Nvfp4 RefToNvfp4(const Mxfp4& t, int kmax, int64_t* requantized) {
  Nvfp4 q;
  q.rows = t.rows;
  q.cols = t.cols;
  q.data.resize(t.rows * t.cols / 2);
  q.scales.resize(t.rows * t.cols / kNvfp4BlockSize);
  q.scale_2 = formats::Exp2Int(kmax - 8);
  *requantized = 0;
  EXPECT_EQ(reference::Mxfp4ToNvfp4Rows(t.View(t.data.data(), t.scales.data()), kmax,
                                        {q.data.data(), q.scales.data(), nullptr}, 0, t.rows,
                                        requantized),
            -1);
  return q;
}

int RefMaxExponent(const Mxfp4& t) {
  uint8_t max_byte = 0;
  EXPECT_EQ(
      reference::Mxfp4MaxScaleRows(t.View(t.data.data(), t.scales.data()), 0, t.rows, &max_byte),
      -1);
  return max_byte - 127;
}

void ExpectSameNvfp4(const Nvfp4& got, const Nvfp4& want) {
  EXPECT_EQ(FirstMismatch(got.data, want.data), "") << "packed values";
  EXPECT_EQ(FirstMismatch(got.scales, want.scales), "") << "block scales";
  EXPECT_EQ(formats::FloatBits(got.scale_2), formats::FloatBits(want.scale_2))
      << got.scale_2 << " vs " << want.scale_2;
}

struct Shape {
  int64_t rows;
  int64_t cols;
};

const FloatType kFloatTypes[] = {FloatType::kBF16, FloatType::kF32};

// ---- outputs equal the reference --------------------------------------------------------------

TEST_P(BackendTest, Fp8BlockDequantMatchesReference) {
  // 300x520: partial 128-blocks in both directions ([3, 5] scales); 1x7 and 129x130: tiny and
  // one-past-a-block edges.
  for (Shape shape : {Shape{300, 520}, Shape{129, 130}, Shape{1, 7}, Shape{64, 4096}}) {
    for (Fp8ScaleType scale_type : {Fp8ScaleType::kE8M0, Fp8ScaleType::kF32}) {
      const Fp8 t = test_vectors::RandomFp8(scale_type, shape.rows, shape.cols, 11);
      for (FloatType out_type : kFloatTypes) {
        SCOPED_TRACE(absl::StrCat(shape.rows, "x", shape.cols, " scales ",
                                  static_cast<int>(scale_type), " out ",
                                  static_cast<int>(out_type)));
        absl::Status status;
        const std::vector<uint8_t> got = Fp8Dequant(t, out_type, &status);
        ASSERT_TRUE(status.ok()) << status;
        EXPECT_EQ(FirstMismatch(got, RefFp8Dequant(t, out_type)), "");
      }
    }
  }
}

TEST_P(BackendTest, Fp8BlockDequantDeepSeekV3Shape) {
  // V3's q_a_proj-like [576, 7168] with F32 scales [5, 56]: the last block row has 64 rows.
  const Fp8 t = test_vectors::RandomFp8(Fp8ScaleType::kF32, 576, 7168, 12);
  ASSERT_EQ(t.scale_rows(), 5);
  ASSERT_EQ(t.scale_cols(), 56);
  absl::Status status;
  const std::vector<uint8_t> got = Fp8Dequant(t, FloatType::kBF16, &status);
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(FirstMismatch(got, RefFp8Dequant(t, FloatType::kBF16)), "");
}

TEST_P(BackendTest, Fp8BlockDequantEdgeValues) {
  // Hand-checked: E4M3 0x01 (2^-9) * 2^-127 = 2^-136 (subnormal float, BF16 0x0000 after RNE:
  // 2^-136 is below half of BF16's smallest subnormal 2^-133); 0x80 (-0) stays -0; 0x7E (448) *
  // 2^127 overflows to inf; 0x3F (1.875) * 1 = 1.875 (BF16 0x3FF0); 0x03 (3 * 2^-9) * 2^-125 =
  // 1.5 * 2^-133 rounds to BF16 0x0002 (ties to even), * 2^-124 is exactly BF16 0x0003.
  Fp8 t;
  t.scale_type = Fp8ScaleType::kE8M0;
  t.rows = 1;
  t.cols = 5 * 128;
  t.data.assign(t.cols, 0);
  t.data[0] = 0x01;
  t.data[1] = 0x80;
  t.data[128] = 0x7E;
  t.data[256] = 0x3F;
  t.data[257] = 0xBF;
  t.data[384] = 0x03;
  t.data[512] = 0x03;
  t.scales = {0, 254, 127, 2, 3};
  absl::Status status;
  std::vector<uint8_t> f32 = Fp8Dequant(t, FloatType::kF32, &status);
  ASSERT_TRUE(status.ok()) << status;
  auto f32_at = [&](int i) {
    uint32_t u;
    memcpy(&u, f32.data() + 4 * i, 4);
    return u;
  };
  EXPECT_EQ(f32_at(0), 1u << 13);  // 2^-136 = 2^13 * 2^-149
  EXPECT_EQ(f32_at(1), 0x80000000u);
  EXPECT_EQ(f32_at(128), 0x7F800000u);
  EXPECT_EQ(f32_at(256), formats::FloatBits(1.875f));
  EXPECT_EQ(f32_at(257), formats::FloatBits(-1.875f));
  EXPECT_EQ(f32_at(384), 3u << 15);
  EXPECT_EQ(f32_at(512), 3u << 16);
  std::vector<uint8_t> bf16 = Fp8Dequant(t, FloatType::kBF16, &status);
  ASSERT_TRUE(status.ok()) << status;
  auto bf16_at = [&](int i) { return static_cast<uint16_t>(bf16[2 * i] | (bf16[2 * i + 1] << 8)); };
  EXPECT_EQ(bf16_at(0), 0x0000);
  EXPECT_EQ(bf16_at(1), 0x8000);
  EXPECT_EQ(bf16_at(128), 0x7F80);
  EXPECT_EQ(bf16_at(256), 0x3FF0);
  EXPECT_EQ(bf16_at(257), 0xBFF0);
  EXPECT_EQ(bf16_at(384), 0x0002);
  EXPECT_EQ(bf16_at(512), 0x0003);
}

TEST_P(BackendTest, Mxfp4DequantMatchesReference) {
  // 2x65536: few rows, so CPU backends split inside rows.
  for (Shape shape : {Shape{300, 512}, Shape{7, 64}, Shape{2, 65536}, Shape{1, 32}}) {
    // Scales 0 (2^-127: subnormal results) .. 254 (results overflow to inf).
    const Mxfp4 t = test_vectors::RandomMxfp4(shape.rows, shape.cols, 21, 0, 254);
    for (FloatType out_type : kFloatTypes) {
      SCOPED_TRACE(absl::StrCat(shape.rows, "x", shape.cols, " out ", static_cast<int>(out_type)));
      absl::Status status;
      const std::vector<uint8_t> got = Mxfp4Dequant(t, out_type, &status);
      ASSERT_TRUE(status.ok()) << status;
      EXPECT_EQ(FirstMismatch(got, RefMxfp4Dequant(t, out_type)), "");
    }
  }
}

TEST_P(BackendTest, Nvfp4DequantMatchesReference) {
  for (Shape shape : {Shape{300, 512}, Shape{5, 48}, Shape{2, 65536}, Shape{1, 16}}) {
    const Nvfp4 t = test_vectors::RandomNvfp4(shape.rows, shape.cols, 31);
    for (FloatType out_type : kFloatTypes) {
      SCOPED_TRACE(absl::StrCat(shape.rows, "x", shape.cols, " out ", static_cast<int>(out_type)));
      absl::Status status;
      const std::vector<uint8_t> got = Nvfp4Dequant(t, out_type, &status);
      ASSERT_TRUE(status.ok()) << status;
      EXPECT_EQ(FirstMismatch(got, RefNvfp4Dequant(t, out_type)), "");
    }
  }
}

TEST_P(BackendTest, AbsMaxMatchesReference) {
  for (Shape shape :
       {Shape{300, 520}, Shape{1, 7}, Shape{3, 100000}, Shape{2, 33}, Shape{97, 16}}) {
    for (FloatType type : kFloatTypes) {
      SCOPED_TRACE(absl::StrCat(shape.rows, "x", shape.cols, " type ", static_cast<int>(type)));
      const Dense t = test_vectors::RandomWeights(type, shape.rows, shape.cols, 41);
      absl::StatusOr<float> amax = AbsMax(t);
      ASSERT_TRUE(amax.ok()) << amax.status();
      EXPECT_EQ(formats::FloatBits(*amax), formats::FloatBits(RefAbsMax(t)));
    }
  }
}

TEST_P(BackendTest, AbsMaxOfZeroTensorIsZero) {
  for (FloatType type : kFloatTypes) {
    Dense t(type, 130, 70);
    t.Set(129, 69, -0.0f);
    absl::StatusOr<float> amax = AbsMax(t);
    ASSERT_TRUE(amax.ok()) << amax.status();
    EXPECT_EQ(formats::FloatBits(*amax), 0u);
  }
}

TEST_P(BackendTest, AbsMaxFindsSingleLargestElement) {
  // A lone maximum in the last element of a tail (the CPU kernels' masked/padded path).
  for (FloatType type : kFloatTypes) {
    const Dense base = test_vectors::RandomWeights(type, 5, 1001, 42);
    Dense t = base;
    t.Set(4, 1000, -12345.0f);
    absl::StatusOr<float> amax = AbsMax(t);
    ASSERT_TRUE(amax.ok()) << amax.status();
    EXPECT_EQ(*amax, type == FloatType::kF32 ? 12345.0f : 12352.0f);  // BF16 rounds to 12352
  }
}

TEST_P(BackendTest, BlockAbsMax16MatchesReference) {
  for (Shape shape : {Shape{300, 512}, Shape{5, 48}, Shape{2, 65536}, Shape{1, 16}}) {
    for (FloatType type : kFloatTypes) {
      SCOPED_TRACE(absl::StrCat(shape.rows, "x", shape.cols, " type ", static_cast<int>(type)));
      const Dense t = test_vectors::RandomWeights(type, shape.rows, shape.cols, 51);
      absl::Status status;
      const std::vector<uint8_t> got = BlockAbsMax16(t, &status);
      ASSERT_TRUE(status.ok()) << status;
      EXPECT_EQ(FirstMismatch(got, RefBlockAbsMax16(t)), "");
    }
  }
}

TEST_P(BackendTest, Nvfp4QuantizeMatchesReference) {
  for (Shape shape :
       {Shape{300, 512}, Shape{5, 48}, Shape{2, 65536}, Shape{1, 16}, Shape{129, 272}}) {
    for (FloatType type : kFloatTypes) {
      const Dense t = test_vectors::RandomWeights(type, shape.rows, shape.cols, 61);
      const float own = RefAbsMax(t);
      // Own amax, and a fused partner's larger one.
      for (GlobalAmax amax : {GlobalAmax(), GlobalAmax(own * 3.5f)}) {
        SCOPED_TRACE(absl::StrCat(shape.rows, "x", shape.cols, " type ", static_cast<int>(type),
                                  " amax ", amax.has_value() ? *amax : -1.0f));
        absl::Status status;
        const Nvfp4 got = Quantize(t, amax, &status);
        ASSERT_TRUE(status.ok()) << status;
        ExpectSameNvfp4(got, RefQuantize(t, amax));
      }
    }
  }
}

TEST_P(BackendTest, Nvfp4QuantizeThresholdValues) {
  for (FloatType type : kFloatTypes) {
    SCOPED_TRACE(static_cast<int>(type));
    const Dense t = test_vectors::ThresholdWeights(type, 37, 160);
    absl::Status status;
    const Nvfp4 got = Quantize(t, GlobalAmax(), &status);
    ASSERT_TRUE(status.ok()) << status;
    ExpectSameNvfp4(got, RefQuantize(t, GlobalAmax()));
    EXPECT_EQ(got.scale_2, 1.0f);  // 2688 / 2688
    // Each block's scale is its exact s; block 9 (s = 1) by hand: {6, .25, .75, 1.25, 1.75, 2.5,
    // 3.5, 5, -.25, ..., -5, -6} -> codes 7 0 2 2 4 4 6 6 | 8 A A C C E E F (ties to even, -0.25
    // to -0).
    for (int64_t b = 1; b < 37 * 10; ++b) {
      ASSERT_EQ(got.scales[b], formats::FloatToE4m3(test_vectors::ThresholdBlockScale(b))) << b;
    }
    ASSERT_EQ(test_vectors::ThresholdBlockScale(9), 1.0f);
    if (type == FloatType::kBF16) {
      const std::vector<uint8_t> block9(got.data.begin() + 9 * 8, got.data.begin() + 10 * 8);
      EXPECT_EQ(FirstMismatch(block9, {0x07, 0x22, 0x44, 0x66, 0xA8, 0xCA, 0xEC, 0xFE}), "");
    }
  }
}

TEST_P(BackendTest, Nvfp4QuantizeEveryBf16Value) {
  // Blocks of {6, v1..v15} with element [0, 0] = 2688: weight_scale_2 = 1 and every other block
  // scale is 1, so each v is encoded as itself. The v run through every finite BF16 value with
  // |v| <= 6 (both signs, subnormals and -0 included).
  std::vector<float> values;
  for (uint32_t b = 0; b <= 0xFFFF; ++b) {
    const float v = formats::Bf16ToFloat(static_cast<uint16_t>(b));
    if (formats::IsFinite(v) && formats::AbsF(v) <= 6.0f) values.push_back(v);
  }
  const int64_t blocks = (static_cast<int64_t>(values.size()) + 14) / 15 + 1;
  const int64_t cols = 160;
  Dense t(FloatType::kBF16, (blocks + 9) / 10, cols);
  size_t next = 0;
  for (int64_t b = 1; b < t.rows * cols / 16; ++b) {
    t.Set(b * 16 / cols, b * 16 % cols, 6.0f);
    for (int j = 1; j < 16; ++j) {
      const int64_t i = b * 16 + j;
      t.Set(i / cols, i % cols, next < values.size() ? values[next++] : 0.0f);
    }
  }
  ASSERT_EQ(next, values.size());
  t.Set(0, 0, 2688.0f);
  absl::Status status;
  const Nvfp4 got = Quantize(t, GlobalAmax(), &status);
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(got.scale_2, 1.0f);
  EXPECT_EQ(got.scales[1], 0x38);  // 1.0
  ExpectSameNvfp4(got, RefQuantize(t, GlobalAmax()));
}

TEST_P(BackendTest, Nvfp4QuantizeNearThresholdsRandomScales) {
  // F32 blocks with random block amax A and elements a few ulps around t * d, where d is the
  // block's float(scale) * weight_scale_2 (formats.h), for every E2M1 threshold t: the quotient
  // x / d lands on, just below and just above each threshold.
  std::mt19937_64 rng(103);
  std::uniform_real_distribution<float> exponent(-12.0f, 12.0f);
  const float global_amax = 1000.0f;
  const float scale_2 = formats::Nvfp4GlobalScale(global_amax);
  const float kThresholds[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  Dense t(FloatType::kF32, 211, 64);
  for (int64_t b = 0; b < t.rows * 4; ++b) {
    const float amax = std::exp2(exponent(rng));
    const float d = formats::E4m3ToFloat(formats::Nvfp4BlockScale(amax, scale_2)) * scale_2;
    const int64_t r = b / 4, c0 = b % 4 * 16;
    t.Set(r, c0, b % 2 ? amax : -amax);
    for (int j = 1; j < 16; ++j) {
      float x = kThresholds[rng() % 7] * d;
      for (int steps = static_cast<int>(rng() % 7) - 3; steps != 0; steps += steps > 0 ? -1 : 1) {
        x = std::nextafter(x, steps > 0 ? 1e30f : 0.0f);
      }
      t.Set(r, c0 + j, formats::AbsF(x) <= amax ? (rng() % 2 ? x : -x) : 0.0f);
    }
  }
  absl::Status status;
  const Nvfp4 got = Quantize(t, GlobalAmax(global_amax), &status);
  ASSERT_TRUE(status.ok()) << status;
  ExpectSameNvfp4(got, RefQuantize(t, GlobalAmax(global_amax)));
}

TEST_P(BackendTest, Nvfp4QuantizeZeroTensor) {
  // amax = 0: weight_scale_2 = 1/2688, every block scale 1.0 (E4M3 0x38), every code 0.
  for (FloatType type : kFloatTypes) {
    Dense t(type, 3, 64);
    t.Set(2, 5, -0.0f);
    absl::Status status;
    const Nvfp4 got = Quantize(t, GlobalAmax(), &status);
    ASSERT_TRUE(status.ok()) << status;
    EXPECT_EQ(got.scale_2, 1.0f / 2688.0f);
    EXPECT_EQ(FirstMismatch(got.scales, std::vector<uint8_t>(12, 0x38)), "");
    EXPECT_EQ(FirstMismatch(got.data, std::vector<uint8_t>(96, 0x00)), "");
  }
}

TEST_P(BackendTest, Nvfp4QuantizeTinyTensorScaleUnderflow) {
  // amax = 2^-140 (F32 subnormal): block scales clamp to E4M3's smallest, 2^-9 (0x01).
  Dense t(FloatType::kF32, 2, 32);
  for (int c = 0; c < 32; ++c) t.Set(1, c, c % 2 ? 0x1p-140f : -0x1p-142f);
  absl::Status status;
  const Nvfp4 got = Quantize(t, GlobalAmax(), &status);
  ASSERT_TRUE(status.ok()) << status;
  ExpectSameNvfp4(got, RefQuantize(t, GlobalAmax()));
}

TEST_P(BackendTest, Nvfp4QuantizeSuppliedAmaxSmallerThanOwnSaturates) {
  // A too-small shared amax is not an error: block scales clamp at 448 and codes at +-6.
  const Dense t = test_vectors::RandomWeights(FloatType::kBF16, 64, 256, 62);
  absl::Status status;
  const Nvfp4 got = Quantize(t, GlobalAmax(RefAbsMax(t) / 100.0f), &status);
  ASSERT_TRUE(status.ok()) << status;
  ExpectSameNvfp4(got, RefQuantize(t, GlobalAmax(RefAbsMax(t) / 100.0f)));
}

TEST_P(BackendTest, Mxfp4MaxExponentMatchesReference) {
  for (Shape shape : {Shape{300, 512}, Shape{2, 65536}, Shape{1, 64}}) {
    const Mxfp4 t = test_vectors::RandomMxfp4(shape.rows, shape.cols, 71, 90, 130);
    absl::StatusOr<int> e = MaxExponent(t);
    ASSERT_TRUE(e.ok()) << e.status();
    EXPECT_EQ(*e, 3);
    EXPECT_EQ(*e, RefMaxExponent(t));
  }
  Mxfp4 t = test_vectors::RandomMxfp4(40, 256, 72, 0, 0);
  EXPECT_EQ(MaxExponent(t).value_or(999), -127);
  t.scales[t.scales.size() - 1] = 254;
  EXPECT_EQ(MaxExponent(t).value_or(999), 127);
}

TEST_P(BackendTest, Mxfp4ToNvfp4MatchesReference) {
  for (Shape shape : {Shape{300, 512}, Shape{2, 65536}, Shape{33, 96}}) {
    // Scale bytes 95..130 (exponents -32..3): blocks below kmax - 17 are requantized.
    const Mxfp4 t = test_vectors::RandomMxfp4(shape.rows, shape.cols, 81, 95, 130);
    for (int kmax : {3, 5, 127}) {
      SCOPED_TRACE(absl::StrCat(shape.rows, "x", shape.cols, " kmax ", kmax));
      absl::StatusOr<int64_t> count;
      const Nvfp4 got = ToNvfp4(t, kmax, &count);
      ASSERT_TRUE(count.ok()) << count.status();
      int64_t want_count = 0;
      ExpectSameNvfp4(got, RefToNvfp4(t, kmax, &want_count));
      EXPECT_EQ(*count, want_count);
      EXPECT_GT(*count, 0);
    }
  }
}

TEST_P(BackendTest, Mxfp4ToNvfp4LosslessWindow) {
  // Exponents within [kmax - 17, kmax]: nothing is requantized and every nibble is kept.
  const Mxfp4 t = test_vectors::RandomMxfp4(200, 1024, 82, 110, 127);  // kmax 0: window -17..0
  absl::StatusOr<int64_t> count;
  const Nvfp4 got = ToNvfp4(t, 0, &count);
  ASSERT_TRUE(count.ok()) << count.status();
  EXPECT_EQ(*count, 0);
  EXPECT_EQ(FirstMismatch(got.data, t.data), "");
  EXPECT_EQ(got.scale_2, 1.0f / 256.0f);
  // Block scale 2^(k + 8): byte 110 (k = -17) -> 2^-9 = E4M3 0x01; byte 127 -> 2^8 = 0x78.
  EXPECT_EQ(got.scales[0], 0x01);
  EXPECT_EQ(got.scales[1], 0x01);
  EXPECT_EQ(got.scales[2], 0x78);
  EXPECT_EQ(got.scales[3], 0x78);
  int64_t want_count = 0;
  ExpectSameNvfp4(got, RefToNvfp4(t, 0, &want_count));
}

#if defined(__x86_64__)
TEST_P(BackendTest, IgnoresCallersFlushToZeroMode) {
  // With FTZ and DAZ set in the calling thread, subnormal inputs and results (E8M0 scale byte 0,
  // subnormal BF16 weights) still come out as the reference computes them in IEEE mode.
  const Fp8 fp8 = test_vectors::RandomFp8(Fp8ScaleType::kE8M0, 300, 520, 104);
  const Dense dense = test_vectors::RandomWeights(FloatType::kBF16, 300, 512, 105);
  const std::vector<uint8_t> want_fp8 = RefFp8Dequant(fp8, FloatType::kF32);
  const Nvfp4 want_nvfp4 = RefQuantize(dense, GlobalAmax());
  const unsigned saved = _mm_getcsr();
  _mm_setcsr(saved | 0x8040);  // FTZ | DAZ
  absl::Status fp8_status, nvfp4_status;
  const std::vector<uint8_t> got_fp8 = Fp8Dequant(fp8, FloatType::kF32, &fp8_status);
  const Nvfp4 got_nvfp4 = Quantize(dense, GlobalAmax(), &nvfp4_status);
  _mm_setcsr(saved);
  ASSERT_TRUE(fp8_status.ok()) << fp8_status;
  ASSERT_TRUE(nvfp4_status.ok()) << nvfp4_status;
  EXPECT_EQ(FirstMismatch(got_fp8, want_fp8), "");
  ExpectSameNvfp4(got_nvfp4, want_nvfp4);
}
#endif

// ---- bad input ---------------------------------------------------------------------------------

// A 256x512 tensor whose first non-finite element is [100, 500]; the others lie in later rows,
// which multi-threaded backends hand to other workers.
Dense WithNonFinite(FloatType type) {
  Dense t = test_vectors::RandomWeights(type, 256, 512, 91);
  t.Set(200, 37, std::numeric_limits<float>::quiet_NaN());
  t.Set(100, 500, -std::numeric_limits<float>::infinity());
  t.Set(250, 3, std::numeric_limits<float>::infinity());
  return t;
}

TEST_P(BackendTest, NonFiniteInputNamesFirstElement) {
  for (FloatType type : kFloatTypes) {
    SCOPED_TRACE(static_cast<int>(type));
    const Dense t = WithNonFinite(type);
    EXPECT_EQ(AbsMax(t).status(), absl::InvalidArgumentError("non-finite value at [100, 500]"));
    absl::Status status;
    BlockAbsMax16(t, &status);
    EXPECT_EQ(status, absl::InvalidArgumentError("non-finite value at [100, 500]"));
    Quantize(t, GlobalAmax(), &status);
    EXPECT_EQ(status, absl::InvalidArgumentError("non-finite value at [100, 500]"));
    Quantize(t, GlobalAmax(1.0f), &status);
    EXPECT_EQ(status, absl::InvalidArgumentError("non-finite value at [100, 500]"));
  }
}

TEST_P(BackendTest, NanInOnlyWorkerRangeIsFound) {
  // NaN in the very last element (the last worker's range, in a tail).
  Dense t = test_vectors::RandomWeights(FloatType::kBF16, 301, 48, 92);
  t.Set(300, 47, std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(AbsMax(t).status(), absl::InvalidArgumentError("non-finite value at [300, 47]"));
  absl::Status status;
  Quantize(t, GlobalAmax(2.0f), &status);
  EXPECT_EQ(status, absl::InvalidArgumentError("non-finite value at [300, 47]"));
}

TEST_P(BackendTest, Fp8BadCodesAndScales) {
  const Fp8 good = test_vectors::RandomFp8(Fp8ScaleType::kE8M0, 300, 520, 93);
  absl::Status status;
  {
    Fp8 t = good;
    t.data[150 * 520 + 300] = 0x7F;
    t.data[200 * 520 + 1] = 0xFF;
    Fp8Dequant(t, FloatType::kBF16, &status);
    EXPECT_EQ(status, absl::InvalidArgumentError("NaN E4M3 code at [150, 300]"));
  }
  {
    // Scale block (1, 2) covers rows 128.. and columns 256..; it comes before the code at
    // [130, 10] in flat order.
    Fp8 t = good;
    t.data[130 * 520 + 10] = 0xFF;
    t.scales[1 * t.scale_cols() + 2] = 0xFF;
    Fp8Dequant(t, FloatType::kF32, &status);
    EXPECT_EQ(status, absl::InvalidArgumentError("NaN E8M0 scale at [128, 256]"));
  }
  for (float bad_scale : {-1.0f, 0.0f, std::numeric_limits<float>::quiet_NaN(),
                          std::numeric_limits<float>::infinity()}) {
    Fp8 t = test_vectors::RandomFp8(Fp8ScaleType::kF32, 300, 520, 94);
    t.SetF32Scale(2 * t.scale_cols() + 4, bad_scale);
    Fp8Dequant(t, FloatType::kBF16, &status);
    EXPECT_EQ(status,
              absl::InvalidArgumentError("non-finite or non-positive F32 scale at [256, 512]"))
        << bad_scale;
  }
}

TEST_P(BackendTest, Mxfp4NanScale) {
  Mxfp4 t = test_vectors::RandomMxfp4(300, 512, 95, 100, 130);
  t.scales[170 * 16 + 5] = 0xFF;  // row 170, columns 160..191
  t.scales[250 * 16 + 0] = 0xFF;
  const absl::Status want = absl::InvalidArgumentError("NaN E8M0 scale at [170, 160]");
  absl::Status status;
  Mxfp4Dequant(t, FloatType::kBF16, &status);
  EXPECT_EQ(status, want);
  EXPECT_EQ(MaxExponent(t).status(), want);
  absl::StatusOr<int64_t> count;
  ToNvfp4(t, 3, &count);
  EXPECT_EQ(count.status(), want);
}

TEST_P(BackendTest, Nvfp4NanScale) {
  Nvfp4 t = test_vectors::RandomNvfp4(300, 512, 96);
  t.scales[120 * 32 + 7] = 0xFF;  // row 120, columns 112..127
  t.scales[121 * 32 + 0] = 0x7F;
  absl::Status status;
  Nvfp4Dequant(t, FloatType::kF32, &status);
  EXPECT_EQ(status, absl::InvalidArgumentError("NaN E4M3 scale at [120, 112]"));
}

TEST_P(BackendTest, BadShapes) {
  absl::Status status;
  Quantize(Dense(FloatType::kBF16, 4, 40), GlobalAmax(), &status);
  EXPECT_EQ(status, absl::InvalidArgumentError("dense tensor: 40 columns is not a multiple of 16"));
  BlockAbsMax16(Dense(FloatType::kF32, 4, 24), &status);
  EXPECT_EQ(status, absl::InvalidArgumentError("dense tensor: 24 columns is not a multiple of 16"));
  Mxfp4 mx = test_vectors::RandomMxfp4(4, 64, 97, 120, 127);
  mx.cols = 48;
  Mxfp4Dequant(mx, FloatType::kBF16, &status);
  EXPECT_EQ(status, absl::InvalidArgumentError("MXFP4 tensor: 48 columns is not a multiple of 32"));
  EXPECT_EQ(MaxExponent(mx).status(), status);
  Nvfp4 nv = test_vectors::RandomNvfp4(4, 64, 98);
  nv.cols = 24;
  Nvfp4Dequant(nv, FloatType::kBF16, &status);
  EXPECT_EQ(status, absl::InvalidArgumentError("NVFP4 tensor: 24 columns is not a multiple of 16"));
  Dense empty(FloatType::kBF16, 1, 16);
  empty.rows = 0;
  EXPECT_EQ(backend_->AbsMax(empty.View(empty.bytes.data())).status(),
            absl::InvalidArgumentError("dense tensor: shape [0, 16] must be positive"));
  Fp8 fp8 = test_vectors::RandomFp8(Fp8ScaleType::kE8M0, 2, 2, 99);
  Buffer data = Upload(fp8.data), scales = Upload(fp8.scales), out = Alloc(8);
  fp8.cols = -2;
  EXPECT_EQ(backend_->Fp8BlockDequant(fp8.View(data.as<uint8_t>(), scales.data()),
                                      {out.data(), FloatType::kBF16}),
            absl::InvalidArgumentError("FP8 block tensor: shape [2, -2] must be positive"));
}

TEST_P(BackendTest, BadKmaxAndGlobalAmax) {
  const Mxfp4 t = test_vectors::RandomMxfp4(8, 64, 100, 120, 130);  // largest exponent 3
  absl::StatusOr<int64_t> count;
  ToNvfp4(t, 2, &count);
  EXPECT_EQ(count.status(),
            absl::InvalidArgumentError("kmax 2 is below the tensor's largest scale exponent 3"));
  ToNvfp4(t, 128, &count);
  EXPECT_EQ(count.status(),
            absl::InvalidArgumentError("kmax 128 is outside E8M0's exponent range [-127, 127]"));
  const Dense d = test_vectors::RandomWeights(FloatType::kBF16, 4, 64, 101);
  absl::Status status;
  Quantize(d, GlobalAmax(-1.0f), &status);
  EXPECT_EQ(status, absl::InvalidArgumentError("global amax -1 must be finite and >= 0"));
  Quantize(d, GlobalAmax(std::numeric_limits<float>::infinity()), &status);
  EXPECT_EQ(status, absl::InvalidArgumentError("global amax inf must be finite and >= 0"));
}

TEST_P(BackendTest, NullPointers) {
  const Dense d = test_vectors::RandomWeights(FloatType::kBF16, 4, 64, 102);
  Buffer in = Upload(d.bytes);
  EXPECT_EQ(backend_->BlockAbsMax16(d.View(in.data()), nullptr),
            absl::InvalidArgumentError("block abs-max: output is null"));
  EXPECT_EQ(backend_->Nvfp4Quantize(d.View(in.data()), GlobalAmax(), {}),
            absl::InvalidArgumentError("NVFP4 output: data, scales or scale_2 is null"));
  EXPECT_EQ(backend_->AbsMax(d.View(nullptr)).status(),
            absl::InvalidArgumentError("dense tensor: data is null"));
}

// ---- the CPU backend's own options and memory ------------------------------------------------

TEST(CpuBackendTest, LevelsAndNames) {
  const std::vector<SimdLevel> levels = SupportedSimdLevels();
  ASSERT_FALSE(levels.empty());
  EXPECT_EQ(levels.front(), SimdLevel::kScalar);
  for (SimdLevel level : levels) {
    absl::StatusOr<std::unique_ptr<Backend>> b = MakeCpuBackend({2, level});
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ((*b)->name(), level == SimdLevel::kScalar ? "cpu-scalar"
                            : level == SimdLevel::kAvx2 ? "cpu-avx2"
                                                        : "cpu-avx512");
  }
  absl::StatusOr<std::unique_ptr<Backend>> best = MakeCpuBackend({});
  ASSERT_TRUE(best.ok()) << best.status();
  absl::StatusOr<std::unique_ptr<Backend>> last = MakeCpuBackend({1, levels.back()});
  EXPECT_EQ((*best)->name(), (*last)->name());
  EXPECT_EQ(MakeCpuBackend({-1, SimdLevel::kAuto}).status(),
            absl::InvalidArgumentError("CPU backend: threads must be >= 0, got -1"));
}

TEST(CpuBackendTest, AllocateAndCopy) {
  absl::StatusOr<std::unique_ptr<Backend>> b = MakeCpuBackend({1, SimdLevel::kScalar});
  ASSERT_TRUE(b.ok()) << b.status();
  for (size_t size : {size_t{0}, size_t{1}, size_t{100}, size_t{4096}}) {
    absl::StatusOr<Buffer> buf = (*b)->Allocate(size);
    ASSERT_TRUE(buf.ok()) << buf.status();
    EXPECT_NE(buf->data(), nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(buf->data()) % 64, 0u) << size;
    EXPECT_EQ(buf->size(), size);
  }
  absl::StatusOr<Buffer> buf = (*b)->Allocate(3);
  ASSERT_TRUE(buf.ok());
  const uint8_t in[3] = {7, 8, 9};
  uint8_t out[3] = {};
  ASSERT_TRUE((*b)->CopyToBackend(buf->data(), in, 3).ok());
  ASSERT_TRUE((*b)->CopyToHost(out, buf->data(), 3).ok());
  EXPECT_EQ(memcmp(in, out, 3), 0);
  EXPECT_EQ((*b)->CopyToHost(nullptr, buf->data(), 3),
            absl::InvalidArgumentError("CPU copy: source or destination is null"));
  EXPECT_TRUE((*b)->CopyToHost(nullptr, nullptr, 0).ok());
}

INSTANTIATE_TEST_SUITE_P(All, BackendTest, ::testing::ValuesIn(AllBackends()),
                         [](const ::testing::TestParamInfo<BackendParam>& info) {
                           return info.param.label;
                         });

}  // namespace
}  // namespace quantd::kernels
