// CUDA-specific behaviour that the backend-agnostic tests (backend_test.cc) do not reach: the
// factory without a usable device, the byte-by-byte paths the kernels take for tensors that are
// not 16-byte aligned, grid-stride loops over more work than the grid has threads, and the
// smallest bad index found across threads. Device tests skip when there is no CUDA device.
#include <stdint.h>

#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
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

TEST(CudaBackendFactory, DeviceOutOfRangeIsUnavailable) {
  for (int device : {-1, CudaDeviceCount()}) {
    const absl::Status s = MakeCudaBackend(device).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_NE(s.message().find("CUDA"), absl::string_view::npos) << s;
  }
}

TEST(CudaBackendFactory, NoDeviceMeansDeviceZeroIsUnavailable) {
  if (CudaDeviceCount() > 0) GTEST_SKIP() << "a CUDA device is present";
  EXPECT_EQ(MakeCudaBackend(0).status().code(), absl::StatusCode::kUnavailable);
}

// Backend memory holding a copy of host bytes `offset` bytes into its allocation, so that views
// built on data() are misaligned by `offset`.
struct Placed {
  Buffer buffer;
  size_t offset = 0;
  uint8_t* data() const { return buffer.as<uint8_t>() + offset; }
};

// Offsets that keep elements naturally aligned (kernels may read a float as a float) but break
// the 16-byte alignment the vector paths need: 0 (vector path) and the smallest misalignment.
constexpr size_t kByteOffsets[] = {0, 1};
constexpr size_t kBf16Offsets[] = {0, 2};
constexpr size_t kF32Offsets[] = {0, 4};

size_t ElementOffset(FloatType type, int which) {
  return type == FloatType::kF32 ? kF32Offsets[which] : kBf16Offsets[which];
}

size_t ElementSize(FloatType type) { return type == FloatType::kF32 ? 4 : 2; }

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

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    absl::StatusOr<std::unique_ptr<Backend>> b = MakeCudaBackend(0);
    ASSERT_TRUE(b.ok()) << b.status();
    backend_ = *std::move(b);
  }

  Placed Alloc(size_t size, size_t offset) {
    absl::StatusOr<Buffer> buffer = backend_->Allocate(size + offset);
    EXPECT_TRUE(buffer.ok()) << buffer.status();
    return {buffer.ok() ? *std::move(buffer) : Buffer(), offset};
  }
  Placed Place(const std::vector<uint8_t>& bytes, size_t offset) {
    Placed p = Alloc(bytes.size(), offset);
    const absl::Status s = backend_->CopyToBackend(p.data(), bytes.data(), bytes.size());
    EXPECT_TRUE(s.ok()) << s;
    return p;
  }
  std::vector<uint8_t> Fetch(const Placed& p, size_t size) {
    std::vector<uint8_t> host(size);
    const absl::Status s = backend_->CopyToHost(host.data(), p.data(), size);
    EXPECT_TRUE(s.ok()) << s;
    return host;
  }

  std::unique_ptr<Backend> backend_;
};

TEST_F(CudaBackendTest, NameAndEmptyAllocation) {
  EXPECT_EQ(backend_->name(), "cuda:0");
  absl::StatusOr<Buffer> empty = backend_->Allocate(0);
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->size(), 0u);
}

TEST_F(CudaBackendTest, CopiesRoundTripAtAnyOffset) {
  std::vector<uint8_t> bytes(1000);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 7 + 3);
  for (size_t offset : {0, 1, 3, 15}) {
    EXPECT_EQ(FirstMismatch(Fetch(Place(bytes, offset), bytes.size()), bytes), "") << offset;
  }
}

TEST_F(CudaBackendTest, Fp8BlockDequantUnaligned) {
  // 129x131: rows and columns one past (and partly into) a 128-block; 16899 elements, so chunks
  // straddle rows and the last one is partial.
  for (Fp8ScaleType scale_type : {Fp8ScaleType::kE8M0, Fp8ScaleType::kF32}) {
    const Fp8 t = test_vectors::RandomFp8(scale_type, 129, 131, 201);
    for (FloatType out_type : {FloatType::kBF16, FloatType::kF32}) {
      const size_t out_size = t.rows * t.cols * ElementSize(out_type);
      std::vector<uint8_t> want(out_size);
      ASSERT_EQ(reference::Fp8BlockDequantRows(t.View(t.data.data(), t.scales.data()),
                                               {want.data(), out_type}, 0, t.rows),
                -1);
      for (int which = 0; which < 2; ++which) {
        SCOPED_TRACE(absl::StrCat("scales ", static_cast<int>(scale_type), " out ",
                                  static_cast<int>(out_type), " misaligned ", which));
        const Placed data = Place(t.data, kByteOffsets[which]);
        const Placed scales = Place(t.scales, scale_type == Fp8ScaleType::kF32
                                                  ? kF32Offsets[which]
                                                  : kByteOffsets[which]);
        const Placed out = Alloc(out_size, ElementOffset(out_type, which));
        ASSERT_TRUE(backend_
                        ->Fp8BlockDequant(t.View(data.data(), scales.data()),
                                          {out.data(), out_type})
                        .ok());
        EXPECT_EQ(FirstMismatch(Fetch(out, out_size), want), "");
      }
    }
  }
}

TEST_F(CudaBackendTest, Mxfp4AndNvfp4DequantUnaligned) {
  const Mxfp4 mx = test_vectors::RandomMxfp4(37, 96, 202, 0, 254);
  const Nvfp4 nv = test_vectors::RandomNvfp4(37, 48, 203);
  for (FloatType out_type : {FloatType::kBF16, FloatType::kF32}) {
    const size_t mx_size = mx.rows * mx.cols * ElementSize(out_type);
    const size_t nv_size = nv.rows * nv.cols * ElementSize(out_type);
    std::vector<uint8_t> mx_want(mx_size), nv_want(nv_size);
    ASSERT_EQ(reference::Mxfp4DequantRows(mx.View(mx.data.data(), mx.scales.data()),
                                          {mx_want.data(), out_type}, 0, mx.rows),
              -1);
    reference::Nvfp4DequantRows(nv.View(nv.data.data(), nv.scales.data()),
                                {nv_want.data(), out_type}, 0, nv.rows);
    for (int which = 0; which < 2; ++which) {
      SCOPED_TRACE(absl::StrCat("out ", static_cast<int>(out_type), " misaligned ", which));
      const Placed mx_data = Place(mx.data, kByteOffsets[which]);
      const Placed mx_scales = Place(mx.scales, kByteOffsets[which]);
      const Placed mx_out = Alloc(mx_size, ElementOffset(out_type, which));
      ASSERT_TRUE(backend_
                      ->Mxfp4Dequant(mx.View(mx_data.data(), mx_scales.data()),
                                     {mx_out.data(), out_type})
                      .ok());
      EXPECT_EQ(FirstMismatch(Fetch(mx_out, mx_size), mx_want), "");
      const Placed nv_data = Place(nv.data, kByteOffsets[which]);
      const Placed nv_scales = Place(nv.scales, kByteOffsets[which]);
      const Placed nv_out = Alloc(nv_size, ElementOffset(out_type, which));
      ASSERT_TRUE(backend_
                      ->Nvfp4Dequant(nv.View(nv_data.data(), nv_scales.data()),
                                     {nv_out.data(), out_type})
                      .ok());
      EXPECT_EQ(FirstMismatch(Fetch(nv_out, nv_size), nv_want), "");
    }
  }
}

TEST_F(CudaBackendTest, ReductionsAndQuantizeUnaligned) {
  for (FloatType type : {FloatType::kBF16, FloatType::kF32}) {
    // 23x48 = 1104 elements = 69 chunks of 16; AbsMax also gets a 1x7 tensor (one partial chunk).
    const Dense t = test_vectors::RandomWeights(type, 23, 48, 204);
    const Dense tiny = test_vectors::RandomWeights(type, 1, 7, 205);
    float want_amax = 0.0f, want_tiny = 0.0f;
    ASSERT_EQ(reference::AbsMaxRows(t.View(t.bytes.data()), 0, t.rows, &want_amax), -1);
    ASSERT_EQ(reference::AbsMaxRows(tiny.View(tiny.bytes.data()), 0, 1, &want_tiny), -1);
    const int64_t blocks = t.rows * t.cols / kNvfp4BlockSize;
    std::vector<uint8_t> want_blocks(blocks * sizeof(float));
    ASSERT_EQ(reference::BlockAbsMax16Rows(t.View(t.bytes.data()),
                                           reinterpret_cast<float*>(want_blocks.data()), 0,
                                           t.rows),
              -1);
    const float scale_2 = formats::Nvfp4GlobalScale(want_amax);
    std::vector<uint8_t> want_data(blocks * 8), want_scales(blocks);
    ASSERT_EQ(reference::Nvfp4QuantizeRows(t.View(t.bytes.data()), scale_2,
                                           {want_data.data(), want_scales.data(), nullptr}, 0,
                                           t.rows),
              -1);
    for (int which = 0; which < 2; ++which) {
      SCOPED_TRACE(absl::StrCat("type ", static_cast<int>(type), " misaligned ", which));
      const Placed in = Place(t.bytes, ElementOffset(type, which));
      const Placed tiny_in = Place(tiny.bytes, ElementOffset(type, which));
      absl::StatusOr<float> amax = backend_->AbsMax(t.View(in.data()));
      ASSERT_TRUE(amax.ok()) << amax.status();
      EXPECT_EQ(formats::FloatBits(*amax), formats::FloatBits(want_amax));
      amax = backend_->AbsMax(tiny.View(tiny_in.data()));
      ASSERT_TRUE(amax.ok()) << amax.status();
      EXPECT_EQ(formats::FloatBits(*amax), formats::FloatBits(want_tiny));

      const Placed block_out = Alloc(want_blocks.size(), kF32Offsets[which]);
      ASSERT_TRUE(backend_->BlockAbsMax16(t.View(in.data()),
                                          reinterpret_cast<float*>(block_out.data())).ok());
      EXPECT_EQ(FirstMismatch(Fetch(block_out, want_blocks.size()), want_blocks), "");

      const Placed data = Alloc(want_data.size(), kByteOffsets[which]);
      const Placed scales = Alloc(want_scales.size(), kByteOffsets[which]);
      float got_scale_2 = 0.0f;
      ASSERT_TRUE(backend_->Nvfp4Quantize(t.View(in.data()), GlobalAmax(),
                                          {data.data(), scales.data(), &got_scale_2}).ok());
      EXPECT_EQ(formats::FloatBits(got_scale_2), formats::FloatBits(scale_2));
      EXPECT_EQ(FirstMismatch(Fetch(data, want_data.size()), want_data), "");
      EXPECT_EQ(FirstMismatch(Fetch(scales, want_scales.size()), want_scales), "");
    }
  }
}

TEST_F(CudaBackendTest, Mxfp4MaxExponentAndCastUnaligned) {
  // 9x160: 45 scale bytes (two whole 16-byte chunks and a partial one); bytes 95..130 put some
  // blocks below kmax - 17, so both the copy and the requantize paths run.
  const Mxfp4 t = test_vectors::RandomMxfp4(9, 160, 206, 95, 130);
  uint8_t max_byte = 0;
  ASSERT_EQ(reference::Mxfp4MaxScaleRows(t.View(t.data.data(), t.scales.data()), 0, t.rows,
                                         &max_byte),
            -1);
  const int kmax = 5;
  const int64_t blocks = t.rows * t.cols / kNvfp4BlockSize;
  std::vector<uint8_t> want_data(blocks * 8), want_scales(blocks);
  int64_t want_count = 0;
  ASSERT_EQ(reference::Mxfp4ToNvfp4Rows(t.View(t.data.data(), t.scales.data()), kmax,
                                        {want_data.data(), want_scales.data(), nullptr}, 0,
                                        t.rows, &want_count),
            -1);
  ASSERT_GT(want_count, 0);
  for (int which = 0; which < 2; ++which) {
    SCOPED_TRACE(absl::StrCat("misaligned ", which));
    const Placed in_data = Place(t.data, kByteOffsets[which]);
    const Placed in_scales = Place(t.scales, kByteOffsets[which]);
    const Mxfp4Tensor view = t.View(in_data.data(), in_scales.data());
    absl::StatusOr<int> e = backend_->Mxfp4MaxExponent(view);
    ASSERT_TRUE(e.ok()) << e.status();
    EXPECT_EQ(*e, max_byte - 127);
    const Placed data = Alloc(want_data.size(), kByteOffsets[which]);
    const Placed scales = Alloc(want_scales.size(), kByteOffsets[which]);
    float scale_2 = 0.0f;
    absl::StatusOr<int64_t> count =
        backend_->Mxfp4ToNvfp4(view, kmax, {data.data(), scales.data(), &scale_2});
    ASSERT_TRUE(count.ok()) << count.status();
    EXPECT_EQ(*count, want_count);
    EXPECT_EQ(scale_2, 0.125f);  // 2^(kmax - 8)
    EXPECT_EQ(FirstMismatch(Fetch(data, want_data.size()), want_data), "");
    EXPECT_EQ(FirstMismatch(Fetch(scales, want_scales.size()), want_scales), "");
  }
}

TEST_F(CudaBackendTest, GridStrideCoversLargeTensors) {
  // 2048x8192 = 16.8M elements = 1M chunks of 16, several times the threads of one grid (at most
  // 8 blocks of 256 per SM), so every thread runs its loop more than once.
  const Dense t = test_vectors::RandomWeights(FloatType::kBF16, 2048, 8192, 207);
  const Placed in = Place(t.bytes, 0);
  float want_amax = 0.0f;
  ASSERT_EQ(reference::AbsMaxRows(t.View(t.bytes.data()), 0, t.rows, &want_amax), -1);
  absl::StatusOr<float> amax = backend_->AbsMax(t.View(in.data()));
  ASSERT_TRUE(amax.ok()) << amax.status();
  EXPECT_EQ(formats::FloatBits(*amax), formats::FloatBits(want_amax));

  const int64_t blocks = t.rows * t.cols / kNvfp4BlockSize;
  const float scale_2 = formats::Nvfp4GlobalScale(want_amax);
  std::vector<uint8_t> want_data(blocks * 8), want_scales(blocks);
  ASSERT_EQ(reference::Nvfp4QuantizeRows(t.View(t.bytes.data()), scale_2,
                                         {want_data.data(), want_scales.data(), nullptr}, 0,
                                         t.rows),
            -1);
  const Placed data = Alloc(want_data.size(), 0), scales = Alloc(want_scales.size(), 0);
  float got_scale_2 = 0.0f;
  ASSERT_TRUE(backend_->Nvfp4Quantize(t.View(in.data()), GlobalAmax(),
                                      {data.data(), scales.data(), &got_scale_2}).ok());
  EXPECT_EQ(got_scale_2, scale_2);
  EXPECT_EQ(FirstMismatch(Fetch(data, want_data.size()), want_data), "");
  EXPECT_EQ(FirstMismatch(Fetch(scales, want_scales.size()), want_scales), "");

  // And back: NVFP4 -> BF16 over the same 1M blocks.
  const Nvfp4Tensor q{data.data(), scales.data(), scale_2, t.rows, t.cols};
  std::vector<uint8_t> want_bf16(t.bytes.size());
  reference::Nvfp4DequantRows({want_data.data(), want_scales.data(), scale_2, t.rows, t.cols},
                              {want_bf16.data(), FloatType::kBF16}, 0, t.rows);
  const Placed out = Alloc(want_bf16.size(), 0);
  ASSERT_TRUE(backend_->Nvfp4Dequant(q, {out.data(), FloatType::kBF16}).ok());
  EXPECT_EQ(FirstMismatch(Fetch(out, want_bf16.size()), want_bf16), "");
}

TEST_F(CudaBackendTest, FirstBadIsTheSmallestAcrossThreadsAndLoops) {
  // Bad elements far apart land on different threads and different loop iterations; the error
  // must name the smallest flat index whichever thread found it first.
  Dense t = test_vectors::RandomWeights(FloatType::kF32, 2048, 8192, 208);
  const int64_t cols = t.cols;
  const int64_t kBad[] = {15000000, 4325375, 4325379, 9000001};  // flat indices
  for (int64_t i : kBad) t.Set(i / cols, i % cols, std::numeric_limits<float>::quiet_NaN());
  const std::string want = absl::StrCat("non-finite value at [", 4325375 / cols, ", ",
                                        4325375 % cols, "]");
  const Placed in = Place(t.bytes, 0);
  EXPECT_EQ(backend_->AbsMax(t.View(in.data())).status(), absl::InvalidArgumentError(want));
  const Placed data = Alloc(t.rows * t.cols / 2, 0);
  const Placed scales = Alloc(t.rows * t.cols / kNvfp4BlockSize, 0);
  float scale_2 = -1.0f;
  EXPECT_EQ(backend_->Nvfp4Quantize(t.View(in.data()), GlobalAmax(1.0f),
                                    {data.data(), scales.data(), &scale_2}),
            absl::InvalidArgumentError(want));
  EXPECT_EQ(scale_2, -1.0f);  // not written on error
}

}  // namespace
}  // namespace quantd::kernels
