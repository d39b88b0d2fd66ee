#include "tests/unit/test_vectors.h"

#include <string.h>

#include <cmath>
#include <random>

#include "kernels/formats.h"

namespace quantd::test_vectors {

using kernels::FloatType;
using kernels::Fp8ScaleType;

Dense::Dense(FloatType type, int64_t rows, int64_t cols)
    : type(type), rows(rows), cols(cols), bytes(rows * cols * element_size(), 0) {}

void Dense::Set(int64_t r, int64_t c, float v) {
  const int64_t i = r * cols + c;
  if (type == FloatType::kF32) {
    memcpy(bytes.data() + 4 * i, &v, 4);
  } else {
    const uint16_t b = formats::FloatToBf16(v);
    memcpy(bytes.data() + 2 * i, &b, 2);
  }
}

float Dense::Get(int64_t r, int64_t c) const {
  const int64_t i = r * cols + c;
  if (type == FloatType::kF32) {
    float v;
    memcpy(&v, bytes.data() + 4 * i, 4);
    return v;
  }
  uint16_t b;
  memcpy(&b, bytes.data() + 2 * i, 2);
  return formats::Bf16ToFloat(b);
}

void Fp8::SetF32Scale(int64_t i, float v) { memcpy(scales.data() + 4 * i, &v, 4); }

Dense RandomWeights(FloatType type, int64_t rows, int64_t cols, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  std::vector<float> row_sigma(rows);
  for (float& s : row_sigma) s = 0.02f * std::exp(0.5f * normal(rng));
  std::vector<float> col_gain(cols, 1.0f);
  for (float& g : col_gain) {
    if (uniform(rng) < 0.01f) g = 30.0f + 70.0f * uniform(rng);
  }
  Dense t(type, rows, cols);
  const int64_t n = rows * cols;
  for (int64_t start = 0; start < n; start += 16) {
    const float kind = uniform(rng);
    for (int64_t i = start; i < start + 16 && i < n; ++i) {
      const int64_t r = i / cols;
      const int64_t c = i % cols;
      float v = normal(rng) * row_sigma[r] * col_gain[c];
      if (kind < 0.02f) {
        v = 0.0f;
      } else if (kind < 0.03f) {
        v = normal(rng) * 1e-39f;  // subnormal in F32 and BF16
      } else if (kind < 0.05f) {
        v = i == start ? 1.0f : -1e-6f * (1.0f + uniform(rng));
      } else if (uniform(rng) < 0.002f) {
        v = uniform(rng) < 0.5f ? 0.0f : -0.0f;
      }
      t.Set(r, c, v);
    }
  }
  return t;
}

float ThresholdBlockScale(int64_t block) {
  static constexpr float kScales[] = {1.0f, 2.0f,   0.5f, 1.25f,      0.25f,
                                      3.0f, 0.125f, 1.5f, 448.0f / 64};
  return kScales[block % (sizeof(kScales) / sizeof(kScales[0]))];
}

Dense ThresholdWeights(FloatType type, int64_t rows, int64_t cols) {
  static constexpr float kThresholds[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  Dense t(type, rows, cols);
  const int64_t blocks = rows * cols / kernels::kNvfp4BlockSize;
  for (int64_t b = 0; b < blocks; ++b) {
    const float s = ThresholdBlockScale(b);
    float v[16];
    v[0] = 6.0f * s;
    for (int j = 0; j < 7; ++j) {
      v[1 + j] = kThresholds[j] * s;
      v[8 + j] = -kThresholds[j] * s;
    }
    v[15] = -6.0f * s;
    if (type == FloatType::kF32 && b % 3 != 0) {
      for (int j = 1; j < 15; ++j) v[j] = std::nextafter(v[j], b % 3 == 1 ? 1e30f : 0.0f);
    }
    for (int j = 0; j < 16; ++j) {
      const int64_t i = b * kernels::kNvfp4BlockSize + j;
      t.Set(i / cols, i % cols, v[j]);
    }
  }
  t.Set(0, 0, 2688.0f);
  return t;
}

Fp8 RandomFp8(Fp8ScaleType scale_type, int64_t rows, int64_t cols, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Fp8 t;
  t.scale_type = scale_type;
  t.rows = rows;
  t.cols = cols;
  t.data.resize(rows * cols);
  // Codes 0x00-0x7E and 0x80-0xFE (0x7F and 0xFF are NaN).
  auto code = [](uint32_t k) { return static_cast<uint8_t>(k < 127 ? k : k + 1); };
  for (int64_t i = 0; i < rows * cols; ++i) {
    t.data[i] = code(i < 254 ? static_cast<uint32_t>(i) : static_cast<uint32_t>(rng() % 254));
  }
  const int64_t n = t.scale_rows() * t.scale_cols();
  if (scale_type == Fp8ScaleType::kE8M0) {
    t.scales.resize(n);
    for (int64_t i = 0; i < n; ++i) t.scales[i] = static_cast<uint8_t>(100 + rng() % 41);
    const uint8_t kEdges[] = {0, 1, 254};
    for (int64_t i = 0; i < n && i < 3; ++i) t.scales[i] = kEdges[i];
  } else {
    t.scales.resize(4 * n);
    std::uniform_real_distribution<float> exponent(-20.0f, 4.0f);
    for (int64_t i = 0; i < n; ++i) t.SetF32Scale(i, std::exp2(exponent(rng)));
    const float kEdges[] = {1e-40f, 1e30f, 0x1p-126f};
    for (int64_t i = 0; i < n && i < 3; ++i) t.SetF32Scale(i, kEdges[i]);
  }
  return t;
}

Mxfp4 RandomMxfp4(int64_t rows, int64_t cols, uint64_t seed, uint8_t min_scale, uint8_t max_scale) {
  std::mt19937_64 rng(seed);
  Mxfp4 t;
  t.rows = rows;
  t.cols = cols;
  t.data.resize(rows * cols / 2);
  for (uint8_t& b : t.data) b = static_cast<uint8_t>(rng());
  t.scales.resize(rows * cols / kernels::kMxfp4BlockSize);
  for (uint8_t& s : t.scales)
    s = static_cast<uint8_t>(min_scale + rng() % (max_scale - min_scale + 1));
  t.scales[0] = min_scale;
  if (t.scales.size() > 1) t.scales[1] = max_scale;
  return t;
}

Nvfp4 RandomNvfp4(int64_t rows, int64_t cols, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Nvfp4 t;
  t.rows = rows;
  t.cols = cols;
  t.scale_2 = 0.0137f;
  t.data.resize(rows * cols / 2);
  for (uint8_t& b : t.data) b = static_cast<uint8_t>(rng());
  t.scales.resize(rows * cols / kernels::kNvfp4BlockSize);
  for (uint8_t& s : t.scales) {
    do {
      s = static_cast<uint8_t>(rng());
    } while (formats::E4m3IsNan(s));
  }
  const uint8_t kEdges[] = {0x00, 0x01, 0x7E, 0x80};
  for (size_t i = 0; i < t.scales.size() && i < 4; ++i) t.scales[i] = kEdges[i];
  return t;
}

}  // namespace quantd::test_vectors
