// AVX2 (+FMA, F16C) row kernels, 8 float lanes at a time. Run only where SupportedSimdLevels()
// lists kAvx2.
//
// The same approach as row_kernels_avx512.cc (element pairs, exact integer tricks, reciprocals
// where they provably give the quotient's E2M1 code, NVFP4 decoding by table, bad rows handed to
// the reference), except that NVFP4 quantization divides a whole block wherever the shortcut is
// in doubt. AVX2 has no byte or 16-bit masked loads and stores, so partial vectors at the end of
// a row go through a zero-padded copy. Shared inline code must not be called here (see
// simd_common.h).
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "kernels/cpu/row_kernels.h"
#include "kernels/cpu/simd_common.h"
#include "kernels/reference.h"

namespace quantd::kernels::cpu {
namespace {

__m256i Set1(uint32_t v) { return _mm256_set1_epi32(static_cast<int>(v)); }
__m256 AsFloat(__m256i v) { return _mm256_castsi256_ps(v); }
__m256i AsInt(__m256 v) { return _mm256_castps_si256(v); }

// Magnitudes of the E2M1 codes 0..7 (formats::E2m1ToFloat); bit 3 of a code is its sign.
__m256 E2m1Magnitudes() { return _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f); }

// E2M1 values of 8 lanes holding codes in their low 4 bits.
__m256 E2m1ToFloat(__m256 magnitudes, __m256i codes) {
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(codes, Set1(0x8)), 28);
  return AsFloat(_mm256_or_si256(AsInt(_mm256_permutevar8x32_ps(magnitudes, codes)), sign));
}

// formats::FloatToBf16 on 8 lanes: round to nearest even, NaN -> 0x7FC0.
__m128i FloatToBf16(__m256 v) {
  const __m256i u = AsInt(v);
  const __m256i bias =
      _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), Set1(1)), Set1(0x7FFF));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, Set1(0x7FFFFFFF)), Set1(0x7F800000));
  r = _mm256_blendv_epi8(r, Set1(0x7FC0), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// Stores 8 floats at flat index i of a dense output.
void StoreDense8(const DenseOut& t, int64_t i, __m256 v) {
  if (t.type == FloatType::kF32) {
    _mm256_storeu_ps(static_cast<float*>(t.data) + i, v);
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(t.data) + i),
                     FloatToBf16(v));
  }
}

// Stores the first n (< 8) of 8 floats at flat index i of a dense output.
void StoreDensePartial(const DenseOut& t, int64_t i, __m256 v, int64_t n) {
  alignas(32) float f[8];
  if (t.type == FloatType::kF32) {
    _mm256_store_ps(f, v);
    memcpy(static_cast<float*>(t.data) + i, f, n * sizeof(float));
  } else {
    _mm_store_si128(reinterpret_cast<__m128i*>(f), FloatToBf16(v));
    memcpy(static_cast<uint16_t*>(t.data) + i, f, n * sizeof(uint16_t));
  }
}

// The low 8 bytes hold the 8 lanes' values (each <= 255).
__m128i LanesToBytes(__m256i v) {
  const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  return _mm_packus_epi16(w, w);
}

// |E4M3| of 8 lanes holding 7-bit magnitudes, with no subnormal float intermediates (each
// instruction that touches one costs a microcode assist): normal codes get their bits moved into
// place and the exponent rebiased by 120; subnormal codes (exponent field 0) are mant * 2^-9.
__m256 E4m3Magnitude(__m256i mag) {
  const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(mag, 20), Set1(120u << 23));
  const __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(0x1p-9f));
  return _mm256_blendv_ps(AsFloat(normal), subnormal, AsFloat(_mm256_cmpgt_epi32(Set1(8), mag)));
}

// formats::E4m3ToFloat on 8 lanes holding code bytes.
__m256 E4m3ToFloat(__m256i b) {
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, Set1(0x80)), 24);
  const __m256i mag = _mm256_and_si256(b, Set1(0x7F));
  const __m256i nan = _mm256_cmpeq_epi32(mag, Set1(0x7F));
  const __m256i v = _mm256_blendv_epi8(AsInt(E4m3Magnitude(mag)), Set1(0x7FC00000), nan);
  return AsFloat(_mm256_or_si256(v, sign));
}

// formats::FloatToE4m3 on 8 lanes; the code bytes come back in the low byte of each lane.
// Sign-cleared bit patterns are below 2^31, so signed compares order them correctly.
__m256i FloatToE4m3(__m256 f) {
  const __m256i denorm_magic = Set1(141u << 23);
  __m256i bits = AsInt(f);
  const __m256i sign = _mm256_and_si256(bits, Set1(0x80000000u));
  bits = _mm256_xor_si256(bits, sign);
  const __m256i nan = _mm256_cmpgt_epi32(bits, Set1((1087u << 20) - 1));
  const __m256i subnormal = _mm256_cmpgt_epi32(Set1(121u << 23), bits);
  const __m256i denorm =
      _mm256_sub_epi32(AsInt(_mm256_add_ps(AsFloat(bits), AsFloat(denorm_magic))), denorm_magic);
  const __m256i mant_odd = _mm256_and_si256(_mm256_srli_epi32(bits, 20), Set1(1));
  __m256i normal = _mm256_add_epi32(bits, Set1((static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu));
  normal = _mm256_srli_epi32(_mm256_add_epi32(normal, mant_odd), 20);
  __m256i r = _mm256_blendv_epi8(normal, denorm, subnormal);
  r = _mm256_blendv_epi8(r, Set1(0x7F), nan);
  return _mm256_or_si256(_mm256_and_si256(r, Set1(0xFF)), _mm256_srli_epi32(sign, 24));
}

// formats::FloatToE2m1 on 8 lanes: (m > t) + (m == t) for the ties-up thresholds is m >= t. A
// true compare is -1 in every bit, so subtracting it counts.
__m256i FloatToE2m1(__m256 x) {
  const __m256 negative = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 m = AsFloat(_mm256_and_si256(AsInt(x), Set1(0x7FFFFFFF)));
  __m256i ord = _mm256_setzero_si256();
  ord = _mm256_sub_epi32(ord, AsInt(_mm256_cmp_ps(m, _mm256_set1_ps(0.25f), _CMP_GT_OQ)));
  ord = _mm256_sub_epi32(ord, AsInt(_mm256_cmp_ps(m, _mm256_set1_ps(0.75f), _CMP_GE_OQ)));
  ord = _mm256_sub_epi32(ord, AsInt(_mm256_cmp_ps(m, _mm256_set1_ps(1.25f), _CMP_GT_OQ)));
  ord = _mm256_sub_epi32(ord, AsInt(_mm256_cmp_ps(m, _mm256_set1_ps(1.75f), _CMP_GE_OQ)));
  ord = _mm256_sub_epi32(ord, AsInt(_mm256_cmp_ps(m, _mm256_set1_ps(2.5f), _CMP_GT_OQ)));
  ord = _mm256_sub_epi32(ord, AsInt(_mm256_cmp_ps(m, _mm256_set1_ps(3.5f), _CMP_GE_OQ)));
  ord = _mm256_sub_epi32(ord, AsInt(_mm256_cmp_ps(m, _mm256_set1_ps(5.0f), _CMP_GT_OQ)));
  return _mm256_or_si256(ord, _mm256_and_si256(AsInt(negative), Set1(0x8)));
}

// The largest of 8 lanes, all below 2^31.
uint32_t HorizontalMax(__m256i v) {
  __m128i m = _mm_max_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_max_epi32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(1, 0, 3, 2)));
  m = _mm_max_epi32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(2, 3, 0, 1)));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(m));
}

// Largest byte of a 32-byte vector.
uint8_t HorizontalMaxU8(__m256i v) {
  __m128i m = _mm_max_epu8(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_max_epu8(m, _mm_srli_si128(m, 8));
  m = _mm_max_epu8(m, _mm_srli_si128(m, 4));
  m = _mm_max_epu8(m, _mm_srli_si128(m, 2));
  m = _mm_max_epu8(m, _mm_srli_si128(m, 1));
  return static_cast<uint8_t>(_mm_cvtsi128_si32(m));
}

// 32 bytes from p, of which the first n are real; the rest read as `fill`.
__m256i LoadBytes32(const uint8_t* p, int64_t n, uint8_t fill) {
  if (n >= 32) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  alignas(32) uint8_t tmp[32];
  memset(tmp, fill, sizeof(tmp));
  memcpy(tmp, p, n);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(tmp));
}

// 8 bytes from p into the low half, of which the first n are real; the rest read as 0.
__m128i LoadBytes8(const uint8_t* p, int64_t n) {
  if (n >= 8) return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  uint64_t word = 0;
  memcpy(&word, p, n);
  return _mm_cvtsi64_si128(static_cast<long long>(word));
}

// ---- element pairs (see row_kernels_avx512.cc) ----------------------------------------------
//
// One 16-element block as two vectors: `even` (elements 0, 2, .. 14) and `odd` (1, 3, .. 15), so
// that lane j of both covers output byte j / BF16 pair j.

// The even and odd elements of the block at flat index i, as floats.
void LoadBlock(const DenseTensor& t, int64_t i, __m256* even, __m256* odd) {
  if (t.type == FloatType::kBF16) {
    const __m256i w = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(t.data) + i));
    *even = AsFloat(_mm256_slli_epi32(w, 16));
    *odd = AsFloat(_mm256_and_si256(w, Set1(0xFFFF0000u)));
    return;
  }
  const float* p = static_cast<const float*>(t.data) + i;
  const __m256 a = _mm256_loadu_ps(p);
  const __m256 b = _mm256_loadu_ps(p + 8);
  // shuffle_ps gives [0 2 8 10 | 4 6 12 14]; the 64-bit permute puts them in order.
  *even = AsFloat(_mm256_permute4x64_epi64(AsInt(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0))),
                                           _MM_SHUFFLE(3, 1, 2, 0)));
  *odd = AsFloat(_mm256_permute4x64_epi64(AsInt(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1))),
                                          _MM_SHUFFLE(3, 1, 2, 0)));
}

// u + 0x7FFF + (bit 16 of u): BF16 round-to-nearest-even of a non-NaN float, in the high half.
__m256i RoundForBf16(__m256 v) {
  const __m256i u = AsInt(v);
  return _mm256_add_epi32(
      u, _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), Set1(1)), Set1(0x7FFF)));
}

// Stores 16 BF16 values in element order from their even and odd lanes, rounded to nearest even
// (formats::FloatToBf16 for non-NaN values: dequantized values never are NaN), or truncated
// where the caller knows every value is exact in BF16 (then both are the same).
void StoreBf16Pair(uint16_t* p, __m256 even, __m256 odd, bool exact) {
  const __m256i e = exact ? AsInt(even) : RoundForBf16(even);
  const __m256i o = exact ? AsInt(odd) : RoundForBf16(odd);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm256_blend_epi16(_mm256_srli_epi32(e, 16), o, 0xAA));
}

// |E4M3| * scale with the code's sign (bit 31 of `sign_bits`) put back: scale > 0, so this is
// formats::E4m3ToFloat(code) * scale.
__m256 Fp8Value(__m256i mag, __m256i sign_bits, __m256 scale) {
  const __m256 v = _mm256_mul_ps(E4m3Magnitude(mag), scale);
  return AsFloat(_mm256_or_si256(AsInt(v), _mm256_and_si256(sign_bits, Set1(0x80000000u))));
}

// The max |x| of 8 blocks (one per vector, as float bits), block b in lane b.
__m256i BlockMaxima(const __m256i m[8]) {
  __m256i t[4];  // t[i]: per 128-bit lane, two partials each of blocks 2i and 2i+1
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm256_max_epu32(_mm256_unpacklo_epi32(m[2 * i], m[2 * i + 1]),
                            _mm256_unpackhi_epi32(m[2 * i], m[2 * i + 1]));
  }
  // u0 / u1: per 128-bit lane, one partial of blocks 0-3 / 4-7.
  const __m256i u0 =
      _mm256_max_epu32(_mm256_unpacklo_epi64(t[0], t[1]), _mm256_unpackhi_epi64(t[0], t[1]));
  const __m256i u1 =
      _mm256_max_epu32(_mm256_unpacklo_epi64(t[2], t[3]), _mm256_unpackhi_epi64(t[2], t[3]));
  return _mm256_max_epu32(_mm256_permute2x128_si256(u0, u1, 0x20),
                          _mm256_permute2x128_si256(u0, u1, 0x31));
}

// Loads the 8 blocks from flat index `first` (LoadBlock) and returns their max |x| as float bits,
// block b in lane b.
__m256i LoadGroup(const DenseTensor& t, int64_t first, __m256 even[8], __m256 odd[8]) {
  const __m256i abs = Set1(0x7FFFFFFF);
  __m256i m[8];
  for (int b = 0; b < 8; ++b) {
    LoadBlock(t, first + 16 * b, &even[b], &odd[b]);
    m[b] = _mm256_max_epu32(_mm256_and_si256(AsInt(even[b]), abs),
                            _mm256_and_si256(AsInt(odd[b]), abs));
  }
  return BlockMaxima(m);
}

constexpr int kGroupBlocks = 8;
constexpr int64_t kGroupElements = kGroupBlocks * kNvfp4BlockSize;

// Runs fn(view, first, n, out_block) over the blocks of flat range [begin, end) (a multiple of
// 16 elements) in groups of 8 blocks. A last group of n < 8 blocks is copied into a zeroed
// 8-block buffer first, so `view` then is that buffer and `first` 0; out_block is always the
// group's first block in the tensor. Stops at the first fn that returns false and returns the
// flat index of that group's first element, or -1.
template <typename Fn>
int64_t ForEachGroup(const DenseTensor& t, int64_t begin, int64_t end, Fn fn) {
  int64_t g = begin;
  for (; g + kGroupElements <= end; g += kGroupElements) {
    if (!fn(t, g, kGroupBlocks, g / kNvfp4BlockSize)) return g;
  }
  if (g < end) {
    alignas(32) uint8_t tail[kGroupElements * sizeof(float)] = {};
    const size_t element_size = t.type == FloatType::kF32 ? 4 : 2;
    memcpy(tail, static_cast<const uint8_t*>(t.data) + g * element_size, (end - g) * element_size);
    const DenseTensor view = {tail, t.type, 1, kGroupElements};
    if (!fn(view, 0, static_cast<int>((end - g) / kNvfp4BlockSize), g / kNvfp4BlockSize)) return g;
  }
  return -1;
}

int64_t Fp8BlockDequantRows(const Fp8BlockTensor& src, const DenseOut& dst, int64_t row_begin,
                            int64_t row_end) {
  const int64_t cols = src.cols;
  const int64_t scale_cols = (cols + kFp8BlockSize - 1) / kFp8BlockSize;
  const bool bf16 = dst.type == FloatType::kBF16;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint8_t* codes = src.data + r * cols;
    __m128i max_mag = _mm_setzero_si128();      // per byte; 0x7F is a NaN code
    __m256i max_mag8 = _mm256_setzero_si256();  // the same for the 8-lane path
    for (int64_t sb = 0; sb < scale_cols; ++sb) {
      float scale;
      if (!Fp8Scale(src, (r / kFp8BlockSize) * scale_cols + sb, &scale)) {
        return reference::Fp8BlockDequantRows(src, dst, r, row_end);
      }
      // An E4M3 value (<= 4 significant bits, >= 2^-9) times 2^k with k >= -124 is a multiple
      // of 2^-133 with <= 4 significant bits (or inf): exact in BF16, so RNE is truncation.
      const bool exact = src.scale_type == Fp8ScaleType::kE8M0 && scale >= 0x1p-124f;
      const __m256 vscale = _mm256_set1_ps(scale);
      const int64_t end = MinI64(cols, (sb + 1) * kFp8BlockSize);
      int64_t c = sb * kFp8BlockSize;
      for (; bf16 && c + 16 <= end; c += 16) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + c));
        max_mag = _mm_max_epu8(max_mag, _mm_and_si128(raw, _mm_set1_epi8(0x7F)));
        const __m256i x = _mm256_cvtepu16_epi32(raw);  // dword j: code 2j | code 2j+1 << 8
        const __m256 even =
            Fp8Value(_mm256_and_si256(x, Set1(0x7F)), _mm256_slli_epi32(x, 24), vscale);
        const __m256 odd = Fp8Value(_mm256_and_si256(_mm256_srli_epi32(x, 8), Set1(0x7F)),
                                    _mm256_slli_epi32(x, 16), vscale);
        StoreBf16Pair(static_cast<uint16_t*>(dst.data) + r * cols + c, even, odd, exact);
      }
      for (; c < end; c += 8) {
        const int64_t n = MinI64(8, end - c);
        const __m256i b = _mm256_cvtepu8_epi32(LoadBytes8(codes + c, n));
        const __m256i mag = _mm256_and_si256(b, Set1(0x7F));
        max_mag8 = _mm256_max_epi32(max_mag8, mag);
        const __m256 out = Fp8Value(mag, _mm256_slli_epi32(b, 24), vscale);
        if (n == 8) {
          StoreDense8(dst, r * cols + c, out);
        } else {
          StoreDensePartial(dst, r * cols + c, out, n);
        }
      }
    }
    const __m256i nan8 = _mm256_cmpeq_epi32(max_mag8, Set1(0x7F));
    if (_mm_movemask_epi8(_mm_cmpeq_epi8(max_mag, _mm_set1_epi8(0x7F))) != 0 ||
        !_mm256_testz_si256(nan8, nan8)) {
      return reference::Fp8BlockDequantRows(src, dst, r, row_end);
    }
  }
  return -1;
}

int64_t Mxfp4DequantRows(const Mxfp4Tensor& src, const DenseOut& dst, int64_t row_begin,
                         int64_t row_end) {
  const int64_t scale_cols = src.cols / kMxfp4BlockSize;
  const __m256 magnitudes = E2m1Magnitudes();
  for (int64_t si = row_begin * scale_cols; si < row_end * scale_cols; ++si) {
    const uint8_t b = src.scales[si];
    if (b == 0xFF) return reference::Mxfp4DequantRows(src, dst, si / scale_cols, row_end);
    // |E2M1| * 2^k: <= 2 significant bits, >= 2^-128 (or inf), so exact in float and BF16.
    const __m256 values = _mm256_mul_ps(magnitudes, _mm256_set1_ps(E8m0Value(b)));
    const uint8_t* packed = src.data + si * kMxfp4BlockSize / 2;
    const int64_t i = si * kMxfp4BlockSize;
    if (dst.type == FloatType::kBF16) {
      for (int h = 0; h < 2; ++h) {
        const __m256i x = _mm256_cvtepu8_epi32(LoadBytes8(packed + 8 * h, 8));  // byte j per lane
        StoreBf16Pair(static_cast<uint16_t*>(dst.data) + i + 16 * h, E2m1ToFloat(values, x),
                      E2m1ToFloat(values, _mm256_srli_epi32(x, 4)), true);
      }
    } else {
      // Each packed byte j becomes the byte pair (low nibble, high nibble) in element order.
      const __m256i w =
          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(packed)));
      const __m256i codes = _mm256_or_si256(w, _mm256_slli_epi16(w, 4));
      const __m128i first = _mm256_castsi256_si128(codes);
      const __m128i second = _mm256_extracti128_si256(codes, 1);
      const __m128i parts[4] = {first, _mm_srli_si128(first, 8), second, _mm_srli_si128(second, 8)};
      for (int k = 0; k < 4; ++k) {
        StoreDense8(dst, i + 8 * k, E2m1ToFloat(values, _mm256_cvtepu8_epi32(parts[k])));
      }
    }
  }
  return -1;
}

int64_t AbsMaxRows(const DenseTensor& src, int64_t row_begin, int64_t row_end, float* amax) {
  const int64_t cols = src.cols;
  // Sign-cleared BF16 and F32 bit patterns compare as signed integers.
  if (src.type == FloatType::kF32) {
    const float* p = static_cast<const float*>(src.data);
    __m256i m = _mm256_setzero_si256();
    for (int64_t r = row_begin; r < row_end; ++r) {
      const float* row = p + r * cols;
      int64_t c = 0;
      for (; c + 8 <= cols; c += 8) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c));
        m = _mm256_max_epi32(m, _mm256_and_si256(v, Set1(0x7FFFFFFF)));
      }
      if (c < cols) {
        alignas(32) float tail[8] = {};
        memcpy(tail, row + c, (cols - c) * sizeof(float));
        m = _mm256_max_epi32(
            m, _mm256_and_si256(_mm256_load_si256(reinterpret_cast<const __m256i*>(tail)),
                                Set1(0x7FFFFFFF)));
      }
      if (!_mm256_testz_si256(_mm256_cmpgt_epi32(m, Set1(0x7F7FFFFF)), Set1(0xFFFFFFFFu))) {
        return reference::AbsMaxRows(src, r, row_end, amax);
      }
    }
    *amax = BitsAsFloat(HorizontalMax(m));
    return -1;
  }
  const uint16_t* p = static_cast<const uint16_t*>(src.data);
  const __m256i abs = _mm256_set1_epi16(0x7FFF);
  __m256i m = _mm256_setzero_si256();
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint16_t* row = p + r * cols;
    int64_t c = 0;
    for (; c + 16 <= cols; c += 16) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c));
      m = _mm256_max_epi16(m, _mm256_and_si256(v, abs));
    }
    if (c < cols) {
      alignas(32) uint16_t tail[16] = {};
      memcpy(tail, row + c, (cols - c) * sizeof(uint16_t));
      m = _mm256_max_epi16(
          m, _mm256_and_si256(_mm256_load_si256(reinterpret_cast<const __m256i*>(tail)), abs));
    }
    if (!_mm256_testz_si256(_mm256_cmpgt_epi16(m, _mm256_set1_epi16(0x7F7F)), Set1(0xFFFFFFFFu))) {
      return reference::AbsMaxRows(src, r, row_end, amax);
    }
  }
  const __m256i wide =
      _mm256_max_epi32(_mm256_and_si256(m, Set1(0xFFFF)), _mm256_srli_epi32(m, 16));
  *amax = BitsAsFloat(HorizontalMax(wide) << 16);
  return -1;
}

int64_t BlockAbsMax16Rows(const DenseTensor& src, float* out, int64_t row_begin, int64_t row_end) {
  const int64_t bad = ForEachGroup(
      src, row_begin * src.cols, row_end * src.cols,
      [&](const DenseTensor& t, int64_t first, int n, int64_t block) {
        __m256 even[8], odd[8];
        const __m256i amax = LoadGroup(t, first, even, odd);
        if (!_mm256_testz_si256(_mm256_cmpgt_epi32(amax, Set1(0x7F7FFFFF)), Set1(0xFFFFFFFFu))) {
          return false;
        }
        alignas(32) float bits[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(bits), amax);
        memcpy(out + block, bits, n * sizeof(float));
        return true;
      });
  if (bad < 0) return -1;
  return reference::BlockAbsMax16Rows(src, out, bad / src.cols, row_end);
}

// ---- NVFP4 quantization (see row_kernels_avx512.cc for why each step is exact) ----------------
//
// Each block's elements are divided by d through a reciprocal biased up by 2^-21, giving q" at
// most 17 bit steps above q = RN(x / d); where no multiple of 2^21 lies within 32 steps below
// |q"| (or at it), q's code is the code of |q"|'s 2^21-step bucket, with q"'s sign. A block with
// a zero or subnormal element, or with a quotient near such a boundary, is divided exactly.

// E2M1 magnitude by bucket index (|q| bits >> 21) - 499, clamped to [0, 19]: indices 0-15 and
// 16-19, as bytes for _mm256_shuffle_epi8 (in both 128-bit lanes).
__m256i BucketCodesLow() {
  return _mm256_setr_epi8(0, 1, 1, 1, 1, 1, 1, 2, 2, 2, 3, 3, 4, 4, 5, 5, 0, 1, 1, 1, 1, 1, 1, 2, 2,
                          2, 3, 3, 4, 4, 5, 5);
}
__m256i BucketCodesHigh() {
  return _mm256_setr_epi8(6, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 6, 6, 7, 7, 7, 7, 7, 7, 7,
                          7, 7, 7, 7, 7, 7, 7);
}

// formats::Nvfp4Encode of 8 lanes, exactly: a division where x is normal; for zero and subnormal
// x, code 8 exactly when x < 0 and 2k > d, k = |x| / 2^-149 (row_kernels_avx512.cc).
__m256i EncodeExact(__m256 x, __m256 d) {
  const __m256i tiny =
      _mm256_cmpeq_epi32(_mm256_and_si256(AsInt(x), Set1(0x7F800000)), _mm256_setzero_si256());
  const __m256i code =
      FloatToE2m1(_mm256_div_ps(_mm256_blendv_ps(x, _mm256_set1_ps(1.0f), AsFloat(tiny)), d));
  const __m256i k = _mm256_and_si256(AsInt(x), Set1(0x7FFFFFFF));
  const __m256i negative =
      _mm256_andnot_si256(_mm256_cmpeq_epi32(k, _mm256_setzero_si256()),
                          _mm256_cmpgt_epi32(_mm256_setzero_si256(), AsInt(x)));
  const __m256 nonzero_q = _mm256_cmp_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(k, k)), d, _CMP_GT_OQ);
  const __m256i tiny_code = _mm256_and_si256(_mm256_and_si256(negative, AsInt(nonzero_q)), Set1(8));
  return _mm256_blendv_epi8(code, tiny_code, tiny);
}

// formats::Nvfp4Encode of one block (LoadBlock lanes): lane j gives packed byte j (low 8 bits; the
// rest 0). `r` is the biased reciprocal of d per lane, `d` d itself.
__m256i EncodeBlock(__m256 even, __m256 odd, __m256 r, __m256 d) {
  const __m256i zero = _mm256_setzero_si256();
  const __m256i exponent = Set1(0x7F800000);
  const __m256i tiny = _mm256_cmpeq_epi32(_mm256_min_epu32(_mm256_and_si256(AsInt(even), exponent),
                                                           _mm256_and_si256(AsInt(odd), exponent)),
                                          zero);
  if (_mm256_testz_si256(tiny, tiny)) {
    const __m256i qe = AsInt(_mm256_mul_ps(even, r));
    const __m256i qo = AsInt(_mm256_mul_ps(odd, r));
    const __m256i low21 = Set1(0x1FFFE0);  // near: bits 5-20 all zero
    const __m256i near = _mm256_or_si256(_mm256_cmpeq_epi32(_mm256_and_si256(qe, low21), zero),
                                         _mm256_cmpeq_epi32(_mm256_and_si256(qo, low21), zero));
    if (_mm256_testz_si256(near, near)) {
      // Top halves of q" in element order, their bucket indices and codes.
      const __m256i words = _mm256_blend_epi16(_mm256_srli_epi32(qe, 16), qo, 0xAA);
      const __m256i index = _mm256_min_epu16(
          _mm256_subs_epu16(
              _mm256_srli_epi16(_mm256_and_si256(words, _mm256_set1_epi16(0x7FFF)), 5),
              _mm256_set1_epi16(499)),
          _mm256_set1_epi16(19));
      const __m256i magnitude = _mm256_blendv_epi8(_mm256_shuffle_epi8(BucketCodesLow(), index),
                                                   _mm256_shuffle_epi8(BucketCodesHigh(), index),
                                                   _mm256_slli_epi16(index, 3));
      // magnitude | (sign bit >> 12 & 8), then word 2j + 16 * word 2j+1 per lane.
      const __m256i codes = _mm256_or_si256(
          magnitude, _mm256_and_si256(_mm256_srli_epi16(words, 12), _mm256_set1_epi16(8)));
      return _mm256_madd_epi16(codes, Set1(0x00100001));
    }
  }
  return _mm256_or_si256(EncodeExact(even, d), _mm256_slli_epi32(EncodeExact(odd, d), 4));
}

int64_t Nvfp4QuantizeRows(const DenseTensor& src, float scale_2, const Nvfp4Out& dst,
                          int64_t row_begin, int64_t row_end) {
  // EncodeExact's rule for tiny x and the reciprocals need scale_2 in [2^-100, 2^100].
  if (!(scale_2 >= 0x1p-100f && scale_2 <= 0x1p100f))
    return reference::Nvfp4QuantizeRows(src, scale_2, dst, row_begin, row_end);
  const __m256 scale_div = _mm256_set1_ps(6.0f * scale_2);  // formats::Nvfp4BlockScale's divisor
  const __m256 lo = _mm256_set1_ps(0x1p-9f);
  const __m256 hi = _mm256_set1_ps(448.0f);
  const int64_t bad = ForEachGroup(
      src, row_begin * src.cols, row_end * src.cols,
      [&](const DenseTensor& t, int64_t first, int n, int64_t block) {
        __m256 even[8], odd[8];
        const __m256i amax = LoadGroup(t, first, even, odd);
        if (!_mm256_testz_si256(_mm256_cmpgt_epi32(amax, Set1(0x7F7FFFFF)), Set1(0xFFFFFFFFu))) {
          return false;
        }
        // formats::Nvfp4BlockScale for the 8 blocks at once.
        __m256 s = _mm256_div_ps(AsFloat(amax), scale_div);
        s = _mm256_blendv_ps(s, _mm256_set1_ps(1.0f),
                             _mm256_cmp_ps(s, _mm256_setzero_ps(), _CMP_EQ_OQ));
        s = _mm256_blendv_ps(s, lo, _mm256_cmp_ps(s, lo, _CMP_LT_OQ));
        s = _mm256_blendv_ps(s, hi, _mm256_cmp_ps(s, hi, _CMP_GT_OQ));
        const __m256i scale_bytes = FloatToE4m3(s);
        alignas(16) uint8_t bytes[16];
        _mm_store_si128(reinterpret_cast<__m128i*>(bytes), LanesToBytes(scale_bytes));
        memcpy(dst.scales + block, bytes, n);
        const __m256 unit = _mm256_mul_ps(E4m3ToFloat(scale_bytes), _mm256_set1_ps(scale_2));
        const __m256 recip = _mm256_mul_ps(_mm256_div_ps(_mm256_set1_ps(1.0f), unit),
                                           _mm256_set1_ps(1.0f + 0x1p-21f));
        // formats::Nvfp4Encode: lane j of a block gives packed byte j.
        for (int b = 0; b < n; ++b) {
          const __m256i lane = Set1(b);
          _mm_storel_epi64(
              reinterpret_cast<__m128i*>(dst.data + (block + b) * kNvfp4BlockSize / 2),
              LanesToBytes(EncodeBlock(even[b], odd[b], _mm256_permutevar8x32_ps(recip, lane),
                                       _mm256_permutevar8x32_ps(unit, lane))));
        }
        return true;
      });
  if (bad < 0) return -1;
  return reference::Nvfp4QuantizeRows(src, scale_2, dst, bad / src.cols, row_end);
}

// formats::Nvfp4Decode(code, b, scale_2) for every scale byte b and code: for BF16 output, row b
// of `lo` and of `hi` hold the low and the high bytes of the 16 codes' BF16 values (RNE); for
// F32 output, row b of `f32` holds the 16 values.
struct DecodeTable {
  alignas(32) uint8_t lo[256][16];
  alignas(32) uint8_t hi[256][16];
  alignas(32) float f32[256][16];
};

void BuildDecodeTable(float scale_2, FloatType type, DecodeTable* t) {
  const __m256 magnitudes = E2m1Magnitudes();
  const __m256i codes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  // Low bytes of 8 words, then their high bytes.
  const __m128i split = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  alignas(32) float scales[256];
  for (int b = 0; b < 256; b += 8) {
    _mm256_store_ps(scales + b, E4m3ToFloat(_mm256_add_epi32(codes, Set1(b))));
  }
  for (int b = 0; b < 256; ++b) {
    const __m256 s = _mm256_set1_ps(scales[b]);
    const __m256 scale = _mm256_set1_ps(scale_2);
    const __m256 positive = _mm256_mul_ps(_mm256_mul_ps(E2m1ToFloat(magnitudes, codes), s), scale);
    const __m256 negative = _mm256_mul_ps(
        _mm256_mul_ps(E2m1ToFloat(magnitudes, _mm256_add_epi32(codes, Set1(8))), s), scale);
    if (type == FloatType::kF32) {
      _mm256_store_ps(t->f32[b], positive);
      _mm256_store_ps(t->f32[b] + 8, negative);
      continue;
    }
    const __m128i first = _mm_shuffle_epi8(FloatToBf16(positive), split);
    const __m128i second = _mm_shuffle_epi8(FloatToBf16(negative), split);
    _mm_store_si128(reinterpret_cast<__m128i*>(t->lo[b]), _mm_unpacklo_epi64(first, second));
    _mm_store_si128(reinterpret_cast<__m128i*>(t->hi[b]), _mm_unpackhi_epi64(first, second));
  }
}

// The E2M1 codes of packed bytes as bytes in element order: byte 2j the low nibble of packed byte
// j, byte 2j+1 its high nibble, from `words` holding one packed byte per 16-bit word.
__m256i NibbleIndex(__m256i words) {
  return _mm256_and_si256(_mm256_or_si256(words, _mm256_slli_epi16(words, 4)),
                          _mm256_set1_epi16(0x0F0F));
}

// Every output value is one of 16 per scale byte, so each is looked up in a table of them.
void Nvfp4DequantRows(const Nvfp4Tensor& src, const DenseOut& dst, int64_t row_begin,
                      int64_t row_end) {
  const int64_t blocks_per_row = src.cols / kNvfp4BlockSize;
  const int64_t end = row_end * blocks_per_row;
  const uint8_t* scales = src.scales;
  const uint8_t* data = src.data;
  DecodeTable table;
  BuildDecodeTable(src.scale_2, dst.type, &table);
  int64_t b = row_begin * blocks_per_row;
  if (dst.type == FloatType::kBF16) {
    uint16_t* out = static_cast<uint16_t*>(dst.data);
    // Two blocks at a time, one per 128-bit lane; the table rows' bytes are picked by code.
    for (; b < end; b += 2) {
      const bool pair = b + 2 <= end;
      const uint8_t second = scales[pair ? b + 1 : b];
      const __m256i index = NibbleIndex(_mm256_cvtepu8_epi16(
          pair ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(data + b * 8))
               : _mm_loadl_epi64(reinterpret_cast<const __m128i*>(data + b * 8))));
      const __m256i lo = _mm256_shuffle_epi8(
          _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(table.lo[second]),
                              reinterpret_cast<const __m128i*>(table.lo[scales[b]])),
          index);
      const __m256i hi = _mm256_shuffle_epi8(
          _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(table.hi[second]),
                              reinterpret_cast<const __m128i*>(table.hi[scales[b]])),
          index);
      const __m256i first_half = _mm256_unpacklo_epi8(lo, hi);   // elements 0-7 of each block
      const __m256i second_half = _mm256_unpackhi_epi8(lo, hi);  // elements 8-15
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * kNvfp4BlockSize),
                          _mm256_permute2x128_si256(first_half, second_half, 0x20));
      if (pair) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (b + 1) * kNvfp4BlockSize),
                            _mm256_permute2x128_si256(first_half, second_half, 0x31));
      }
    }
    return;
  }
  float* out = static_cast<float*>(dst.data);
  for (; b < end; ++b) {
    const __m128i index = _mm256_castsi256_si128(NibbleIndex(
        _mm256_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(data + b * 8)))));
    const __m256 lo = _mm256_load_ps(table.f32[scales[b]]);
    const __m256 hi = _mm256_load_ps(table.f32[scales[b]] + 8);
    for (int h = 0; h < 2; ++h) {
      // Codes 0-7 from the first 8 values, 8-15 from the rest (bit 3, moved to the sign bit).
      const __m256i codes = _mm256_cvtepu8_epi32(h == 0 ? index : _mm_srli_si128(index, 8));
      const __m256 v =
          _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, codes), _mm256_permutevar8x32_ps(hi, codes),
                           AsFloat(_mm256_slli_epi32(codes, 28)));
      _mm256_storeu_ps(out + b * kNvfp4BlockSize + 8 * h, v);
    }
  }
}

int64_t Mxfp4MaxScaleRows(const Mxfp4Tensor& src, int64_t row_begin, int64_t row_end,
                          uint8_t* max_byte) {
  const int64_t scale_cols = src.cols / kMxfp4BlockSize;
  __m256i m = _mm256_setzero_si256();
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint8_t* row = src.scales + r * scale_cols;
    for (int64_t c = 0; c < scale_cols; c += 32) {
      m = _mm256_max_epu8(m, LoadBytes32(row + c, scale_cols - c, 0));
    }
    if (_mm256_movemask_epi8(_mm256_cmpeq_epi8(m, _mm256_set1_epi8(static_cast<char>(0xFF)))) !=
        0) {
      return reference::Mxfp4MaxScaleRows(src, r, row_end, max_byte);
    }
  }
  *max_byte = HorizontalMaxU8(m);
  return -1;
}

int64_t Mxfp4ToNvfp4Rows(const Mxfp4Tensor& src, int kmax, const Nvfp4Out& dst, int64_t row_begin,
                         int64_t row_end, int64_t* requantized) {
  const int64_t scale_cols = src.cols / kMxfp4BlockSize;
  // A block keeps its nibbles when e = k - kmax + 8 >= -9, i.e. when its byte b >= kmax + 110.
  const int keep_min = kmax + 110;
  const __m256i e_plus_7 = Set1(static_cast<uint32_t>(kmax + 112));  // b - (kmax + 112) = e + 7
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint8_t* scales = src.scales + r * scale_cols;
    __m256i row_min = _mm256_set1_epi8(static_cast<char>(0xFF));
    __m256i row_max = _mm256_setzero_si256();
    for (int64_t c = 0; c < scale_cols; c += 32) {
      row_min = _mm256_min_epu8(row_min, LoadBytes32(scales + c, scale_cols - c, 0xFF));
      row_max = _mm256_max_epu8(row_max, LoadBytes32(scales + c, scale_cols - c, 0));
    }
    // The smallest byte is 255 - the largest of the complements.
    const int min_byte =
        255 - HorizontalMaxU8(_mm256_xor_si256(row_min, _mm256_set1_epi8(static_cast<char>(0xFF))));
    if (HorizontalMaxU8(row_max) == 0xFF || min_byte < keep_min) {
      // The reference requantizes (or rejects) this row.
      const int64_t bad = reference::Mxfp4ToNvfp4Rows(src, kmax, dst, r, r + 1, requantized);
      if (bad >= 0) return bad;
      continue;
    }
    memcpy(dst.data + r * src.cols / 2, src.data + r * src.cols / 2, src.cols / 2);
    // Scale 2^e, e in [-9, 8], as E4M3: (e + 7) << 3 when normal, else the subnormal 2^(e + 9).
    for (int64_t c = 0; c < scale_cols; c += 8) {
      const int64_t n = MinI64(8, scale_cols - c);
      const __m256i e7 =
          _mm256_sub_epi32(_mm256_cvtepu8_epi32(LoadBytes8(scales + c, n)), e_plus_7);
      const __m256i normal = _mm256_slli_epi32(e7, 3);
      const __m256i subnormal = _mm256_sllv_epi32(Set1(1), _mm256_add_epi32(e7, Set1(2)));
      const __m256i code =
          _mm256_blendv_epi8(subnormal, normal, _mm256_cmpgt_epi32(e7, _mm256_setzero_si256()));
      // One MXFP4 block is two NVFP4 blocks with the same scale.
      const __m256i pairs = _mm256_or_si256(code, _mm256_slli_epi32(code, 8));
      alignas(16) uint8_t bytes[16];
      _mm_store_si128(
          reinterpret_cast<__m128i*>(bytes),
          _mm_packus_epi32(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1)));
      memcpy(dst.scales + 2 * (r * scale_cols + c), bytes, 2 * n);
    }
  }
  return -1;
}

}  // namespace

extern const RowKernels kAvx2RowKernels = {
    "avx2",           Fp8BlockDequantRows, Mxfp4DequantRows,
    AbsMaxRows,       BlockAbsMax16Rows,   Nvfp4QuantizeRows,
    Nvfp4DequantRows, Mxfp4MaxScaleRows,   Mxfp4ToNvfp4Rows,
};

}  // namespace quantd::kernels::cpu
