#include "kernels/reference.h"

#include "kernels/formats.h"

namespace quantd::kernels::reference {

using namespace quantd::formats;  // NOLINT: this file is the scalar spelling of formats.h

float LoadDense(const DenseTensor& t, int64_t i) {
  if (t.type == FloatType::kF32) return static_cast<const float*>(t.data)[i];
  return Bf16ToFloat(static_cast<const uint16_t*>(t.data)[i]);
}

void StoreDense(const DenseOut& t, int64_t i, float v) {
  if (t.type == FloatType::kF32) {
    static_cast<float*>(t.data)[i] = v;
  } else {
    static_cast<uint16_t*>(t.data)[i] = FloatToBf16(v);
  }
}

int64_t Fp8BlockDequantRows(const Fp8BlockTensor& src, const DenseOut& dst, int64_t row_begin,
                            int64_t row_end) {
  const int64_t scale_cols = (src.cols + kFp8BlockSize - 1) / kFp8BlockSize;
  for (int64_t r = row_begin; r < row_end; ++r) {
    for (int64_t c = 0; c < src.cols; ++c) {
      const int64_t i = r * src.cols + c;
      const int64_t si = (r / kFp8BlockSize) * scale_cols + c / kFp8BlockSize;
      float scale;
      if (src.scale_type == Fp8ScaleType::kE8M0) {
        const uint8_t b = static_cast<const uint8_t*>(src.scales)[si];
        if (E8m0IsNan(b)) return i;
        scale = E8m0ToFloat(b);
      } else {
        scale = static_cast<const float*>(src.scales)[si];
        if (!IsFinite(scale) || !(scale > 0.0f)) return i;
      }
      if (E4m3IsNan(src.data[i])) return i;
      StoreDense(dst, i, E4m3ToFloat(src.data[i]) * scale);
    }
  }
  return -1;
}

int64_t Mxfp4DequantRows(const Mxfp4Tensor& src, const DenseOut& dst, int64_t row_begin,
                         int64_t row_end) {
  const int64_t scale_cols = src.cols / kMxfp4BlockSize;
  for (int64_t r = row_begin; r < row_end; ++r) {
    for (int64_t c = 0; c < src.cols; ++c) {
      const int64_t i = r * src.cols + c;
      const uint8_t b = src.scales[r * scale_cols + c / kMxfp4BlockSize];
      if (E8m0IsNan(b)) return i;
      const uint8_t packed = src.data[i / 2];
      const uint8_t code = (c & 1) ? (packed >> 4) : (packed & 0xF);
      StoreDense(dst, i, E2m1ToFloat(code) * E8m0ToFloat(b));
    }
  }
  return -1;
}

int64_t AbsMaxRows(const DenseTensor& src, int64_t row_begin, int64_t row_end, float* amax) {
  float m = 0.0f;
  for (int64_t i = row_begin * src.cols; i < row_end * src.cols; ++i) {
    const float v = LoadDense(src, i);
    if (!IsFinite(v)) return i;
    const float a = AbsF(v);
    m = a > m ? a : m;
  }
  *amax = m;
  return -1;
}

int64_t BlockAbsMax16Rows(const DenseTensor& src, float* out, int64_t row_begin, int64_t row_end) {
  for (int64_t i = row_begin * src.cols; i < row_end * src.cols; i += kNvfp4BlockSize) {
    float m = 0.0f;
    for (int64_t j = 0; j < kNvfp4BlockSize; ++j) {
      const float v = LoadDense(src, i + j);
      if (!IsFinite(v)) return i + j;
      const float a = AbsF(v);
      m = a > m ? a : m;
    }
    out[i / kNvfp4BlockSize] = m;
  }
  return -1;
}

int64_t Nvfp4QuantizeRows(const DenseTensor& src, float scale_2, const Nvfp4Out& dst,
                          int64_t row_begin, int64_t row_end) {
  for (int64_t i = row_begin * src.cols; i < row_end * src.cols; i += kNvfp4BlockSize) {
    float block[kNvfp4BlockSize];
    float m = 0.0f;
    for (int64_t j = 0; j < kNvfp4BlockSize; ++j) {
      block[j] = LoadDense(src, i + j);
      if (!IsFinite(block[j])) return i + j;
      const float a = AbsF(block[j]);
      m = a > m ? a : m;
    }
    const uint8_t s = Nvfp4BlockScale(m, scale_2);
    dst.scales[i / kNvfp4BlockSize] = s;
    for (int64_t j = 0; j < kNvfp4BlockSize; j += 2) {
      const uint8_t lo = Nvfp4Encode(block[j], s, scale_2);
      const uint8_t hi = Nvfp4Encode(block[j + 1], s, scale_2);
      dst.data[(i + j) / 2] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
  return -1;
}

void Nvfp4DequantRows(const Nvfp4Tensor& src, const DenseOut& dst, int64_t row_begin,
                      int64_t row_end) {
  for (int64_t i = row_begin * src.cols; i < row_end * src.cols; ++i) {
    const uint8_t packed = src.data[i / 2];
    const uint8_t code = (i & 1) ? (packed >> 4) : (packed & 0xF);
    StoreDense(dst, i, Nvfp4Decode(code, src.scales[i / kNvfp4BlockSize], src.scale_2));
  }
}

int64_t Mxfp4MaxScaleRows(const Mxfp4Tensor& src, int64_t row_begin, int64_t row_end,
                          uint8_t* max_byte) {
  const int64_t scale_cols = src.cols / kMxfp4BlockSize;
  uint8_t m = 0;
  for (int64_t i = row_begin * scale_cols; i < row_end * scale_cols; ++i) {
    const uint8_t b = src.scales[i];
    if (E8m0IsNan(b)) return i * kMxfp4BlockSize;
    m = b > m ? b : m;
  }
  *max_byte = m;
  return -1;
}

int64_t Mxfp4ToNvfp4Rows(const Mxfp4Tensor& src, int kmax, const Nvfp4Out& dst,
                         int64_t row_begin, int64_t row_end, int64_t* requantized) {
  const float scale_2 = Exp2Int(kmax - 8);
  const int64_t scale_cols = src.cols / kMxfp4BlockSize;
  int64_t count = 0;
  for (int64_t i = row_begin * src.cols; i < row_end * src.cols; i += kNvfp4BlockSize) {
    const int64_t r = i / src.cols;
    const int64_t c = i % src.cols;
    const uint8_t b = src.scales[r * scale_cols + c / kMxfp4BlockSize];
    if (E8m0IsNan(b)) return i;
    const int k = static_cast<int>(b) - 127;
    const int e = k - kmax + 8;  // <= 8 because k <= kmax
    const uint8_t* packed = src.data + i / 2;
    uint8_t* out = dst.data + i / 2;
    if (e >= -9) {  // 2^e is exact in E4M3: copy the nibbles
      dst.scales[i / kNvfp4BlockSize] = FloatToE4m3(Exp2Int(e));
      for (int64_t j = 0; j < kNvfp4BlockSize / 2; ++j) out[j] = packed[j];
      continue;
    }
    // Below E4M3's smallest scale: requantize the block's exact values against scale_2.
    ++count;
    const float unit = Exp2Int(k);
    float block[kNvfp4BlockSize];
    float m = 0.0f;
    for (int64_t j = 0; j < kNvfp4BlockSize; ++j) {
      const uint8_t code = (j & 1) ? (packed[j / 2] >> 4) : (packed[j / 2] & 0xF);
      block[j] = E2m1ToFloat(code) * unit;
      const float a = AbsF(block[j]);
      m = a > m ? a : m;
    }
    const uint8_t s = Nvfp4BlockScale(m, scale_2);
    dst.scales[i / kNvfp4BlockSize] = s;
    for (int64_t j = 0; j < kNvfp4BlockSize; j += 2) {
      out[j / 2] = static_cast<uint8_t>(Nvfp4Encode(block[j], s, scale_2) |
                                        (Nvfp4Encode(block[j + 1], s, scale_2) << 4));
    }
  }
  *requantized += count;
  return -1;
}

}  // namespace quantd::kernels::reference
