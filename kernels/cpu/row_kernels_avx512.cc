// AVX-512 (F, BW, VL, DQ) row kernels, 16 float lanes at a time. Run only where
// SupportedSimdLevels() lists kAvx512.
//
// Every kernel writes the bytes kernels/reference.cc writes. Float operations that decide a
// result are the reference's, in its order; integer tricks stand in only where they are exact
// (E4M3 decoding by moving bits, abs-max on bit patterns, E4M3 / E2M1 rounding with integer adds,
// BF16 truncation where a value is known to be exact in BF16). NVFP4 quantization avoids most
// divisions: it estimates each quotient with a reciprocal and accepts the estimate's code only
// where the code is the same a few bit steps either side of it (see EncodePairFast); elsewhere it
// divides. A row with bad input goes to the reference from that row on, which finds the exact
// first bad element. Shared inline code must not be called here (see simd_common.h).
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "kernels/cpu/row_kernels.h"
#include "kernels/cpu/simd_common.h"
#include "kernels/reference.h"

namespace quantd::kernels::cpu {
namespace {

__m512i Set1(uint32_t v) { return _mm512_set1_epi32(static_cast<int>(v)); }
__m512 AsFloat(__m512i v) { return _mm512_castsi512_ps(v); }
__m512i AsInt(__m512 v) { return _mm512_castps_si512(v); }

// Lanes [0, n) of a 16-lane mask (n <= 16).
__mmask16 Mask16(int64_t n) { return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }

// E2M1 values by code, sign bit included (formats::E2m1ToFloat).
__m512 E2m1Table() {
  return _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f,
                        -2.0f, -3.0f, -4.0f, -6.0f);
}

// formats::FloatToBf16 on 16 lanes: round to nearest even, NaN -> 0x7FC0.
__m256i FloatToBf16(__m512 v) {
  const __m512i u = AsInt(v);
  const __m512i bias =
      _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), Set1(1)), Set1(0x7FFF));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  const __mmask16 nan =
      _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, Set1(0x7FFFFFFF)), Set1(0x7F800000));
  r = _mm512_mask_mov_epi32(r, nan, Set1(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// Stores the lanes of `v` selected by `mask` at flat index i of a dense output.
void StoreDense16(const DenseOut& t, int64_t i, __m512 v, __mmask16 mask) {
  if (t.type == FloatType::kF32) {
    _mm512_mask_storeu_ps(static_cast<float*>(t.data) + i, mask, v);
  } else {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(t.data) + i, mask, FloatToBf16(v));
  }
}

// |E4M3| of 16 lanes holding 7-bit magnitudes, with no subnormal float intermediates (each
// instruction that touches one costs a microcode assist): normal codes get their bits moved into
// place and the exponent rebiased by 120; subnormal codes (exponent field 0) are mant * 2^-9.
__m512 E4m3Magnitude(__m512i mag) {
  const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(mag, 20), Set1(120u << 23));
  const __m512 subnormal = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(0x1p-9f));
  return _mm512_mask_mov_ps(AsFloat(normal), _mm512_cmplt_epu32_mask(mag, Set1(8)), subnormal);
}

// formats::E4m3ToFloat on 16 lanes holding code bytes.
__m512 E4m3ToFloat(__m512i b) {
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, Set1(0x80)), 24);
  const __m512i mag = _mm512_and_si512(b, Set1(0x7F));
  const __mmask16 nan = _mm512_cmpeq_epi32_mask(mag, Set1(0x7F));
  const __m512i v = _mm512_mask_mov_epi32(AsInt(E4m3Magnitude(mag)), nan, Set1(0x7FC00000));
  return AsFloat(_mm512_or_si512(v, sign));
}

// formats::FloatToE4m3 on 16 lanes; the code bytes come back in the low byte of each lane.
__m512i FloatToE4m3(__m512 f) {
  const __m512i denorm_magic = Set1(141u << 23);
  __m512i bits = AsInt(f);
  const __m512i sign = _mm512_and_si512(bits, Set1(0x80000000u));
  bits = _mm512_xor_si512(bits, sign);
  const __mmask16 nan = _mm512_cmpge_epu32_mask(bits, Set1(1087u << 20));
  const __mmask16 subnormal = _mm512_cmplt_epu32_mask(bits, Set1(121u << 23));
  const __m512i denorm =
      _mm512_sub_epi32(AsInt(_mm512_add_ps(AsFloat(bits), AsFloat(denorm_magic))), denorm_magic);
  const __m512i mant_odd = _mm512_and_si512(_mm512_srli_epi32(bits, 20), Set1(1));
  __m512i normal = _mm512_add_epi32(bits, Set1((static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu));
  normal = _mm512_srli_epi32(_mm512_add_epi32(normal, mant_odd), 20);
  __m512i r = _mm512_mask_mov_epi32(normal, subnormal, denorm);
  r = _mm512_mask_mov_epi32(r, nan, Set1(0x7F));
  return _mm512_or_si512(_mm512_and_si512(r, Set1(0xFF)), _mm512_srli_epi32(sign, 24));
}

// formats::FloatToE2m1 on 16 lanes holding non-NaN values, without a compare per threshold:
// m >= 1 rounds to one mantissa bit with an integer add (as FloatToE4m3 does to three) and
// saturates at code 7; m < 1 rounds on E2M1's subnormal grid of 0.5 by adding 2^22, whose ulp is
// 0.5. Both round half to even, which is ModelOpt's tie rule; -0 and +0 give code 0.
__m512i FloatToE2m1(__m512 x) {
  const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512i bits = _mm512_and_si512(AsInt(x), Set1(0x7FFFFFFF));
  const __m512i mant_odd = _mm512_and_si512(_mm512_srli_epi32(bits, 22), Set1(1));
  __m512i normal = _mm512_add_epi32(bits, Set1((static_cast<uint32_t>(1 - 127) << 23) + 0x1FFFFFu));
  normal = _mm512_srli_epi32(_mm512_add_epi32(normal, mant_odd), 22);
  normal = _mm512_min_epu32(normal, Set1(7));
  const __m512i subnormal = _mm512_sub_epi32(
      AsInt(_mm512_add_ps(AsFloat(bits), _mm512_set1_ps(0x1p22f))), Set1(0x4A800000));
  const __m512i ord =
      _mm512_mask_mov_epi32(normal, _mm512_cmplt_epu32_mask(bits, Set1(0x3F800000)), subnormal);
  return _mm512_mask_or_epi32(ord, negative, ord, Set1(0x8));
}

// The 16 E2M1 codes of 8 packed bytes as 16 bytes in element order (code in the low 4 bits).
__m128i UnpackNibbles8(const uint8_t* p) {
  const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm_or_si128(w, _mm_slli_epi16(w, 4));
}

// ---- element pairs ---------------------------------------------------------------------------
//
// The hot kernels work on 32 consecutive elements as two vectors, `even` (elements 0, 2, .. 30)
// and `odd` (1, 3, .. 31): then lane j of both covers the byte pair / BF16 pair j of the
// output, and results need no cross-lane packing. For two 16-element blocks, lanes 0-7 hold the
// first block and lanes 8-15 the second.

// Elements 2j and 2j+1 of 32 BF16 or F32 values at flat index i, as floats.
void LoadPair(const DenseTensor& t, int64_t i, __m512* even, __m512* odd) {
  if (t.type == FloatType::kBF16) {
    const __m512i w = _mm512_loadu_si512(static_cast<const uint16_t*>(t.data) + i);
    *even = AsFloat(_mm512_slli_epi32(w, 16));
    *odd = AsFloat(_mm512_and_si512(w, Set1(0xFFFF0000u)));
    return;
  }
  const float* p = static_cast<const float*>(t.data) + i;
  const __m512 a = _mm512_loadu_ps(p);
  const __m512 b = _mm512_loadu_ps(p + 16);
  const __m512i two_j =
      _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  *even = _mm512_permutex2var_ps(a, two_j, b);
  *odd = _mm512_permutex2var_ps(a, _mm512_add_epi32(two_j, Set1(1)), b);
}

// u + 0x7FFF + (bit 16 of u): BF16 round-to-nearest-even of a non-NaN float, in the high half.
__m512i RoundForBf16(__m512 v) {
  const __m512i u = AsInt(v);
  return _mm512_add_epi32(
      u, _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), Set1(1)), Set1(0x7FFF)));
}

// Stores 32 BF16 values in element order from their even and odd lanes, rounded to nearest even
// (formats::FloatToBf16 for non-NaN values: dequantized values never are NaN), or truncated
// where the caller knows every value is exact in BF16 (then both are the same).
void StoreBf16Pair(uint16_t* p, __m512 even, __m512 odd, bool exact) {
  const __m512i e = exact ? AsInt(even) : RoundForBf16(even);
  const __m512i o = exact ? AsInt(odd) : RoundForBf16(odd);
  _mm512_storeu_si512(p, _mm512_mask_blend_epi16(0xAAAAAAAA, _mm512_srli_epi32(e, 16), o));
}

// |E4M3| * scale with the code's sign (bit 31 of `sign_bits`) put back: scale > 0, so this is
// formats::E4m3ToFloat(code) * scale.
__m512 Fp8Value(__m512i mag, __m512i sign_bits, __m512 scale) {
  const __m512 v = _mm512_mul_ps(E4m3Magnitude(mag), scale);
  return AsFloat(_mm512_ternarylogic_epi32(AsInt(v), sign_bits, Set1(0x80000000u), 0xF8));
}

int64_t Fp8BlockDequantRows(const Fp8BlockTensor& src, const DenseOut& dst, int64_t row_begin,
                            int64_t row_end) {
  const int64_t cols = src.cols;
  const int64_t scale_cols = (cols + kFp8BlockSize - 1) / kFp8BlockSize;
  const bool bf16 = dst.type == FloatType::kBF16;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint8_t* codes = src.data + r * cols;
    __m256i max_mag = _mm256_setzero_si256();  // per byte; 0x7F is a NaN code
    __mmask16 nan = 0;                         // NaN codes in the 16-lane path
    for (int64_t sb = 0; sb < scale_cols; ++sb) {
      float scale;
      if (!Fp8Scale(src, (r / kFp8BlockSize) * scale_cols + sb, &scale)) {
        return reference::Fp8BlockDequantRows(src, dst, r, row_end);
      }
      // An E4M3 value (<= 4 significant bits, >= 2^-9) times 2^k with k >= -124 is a multiple
      // of 2^-133 with <= 4 significant bits (or inf): exact in BF16, so RNE is truncation.
      const bool exact = src.scale_type == Fp8ScaleType::kE8M0 && scale >= 0x1p-124f;
      const __m512 vscale = _mm512_set1_ps(scale);
      const int64_t end = MinI64(cols, (sb + 1) * kFp8BlockSize);
      int64_t c = sb * kFp8BlockSize;
      for (; bf16 && c + 32 <= end; c += 32) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + c));
        max_mag = _mm256_max_epu8(max_mag, _mm256_and_si256(raw, _mm256_set1_epi8(0x7F)));
        const __m512i x = _mm512_cvtepu16_epi32(raw);  // dword j: code 2j | code 2j+1 << 8
        const __m512 even =
            Fp8Value(_mm512_and_si512(x, Set1(0x7F)), _mm512_slli_epi32(x, 24), vscale);
        const __m512 odd = Fp8Value(_mm512_and_si512(_mm512_srli_epi32(x, 8), Set1(0x7F)),
                                    _mm512_slli_epi32(x, 16), vscale);
        StoreBf16Pair(static_cast<uint16_t*>(dst.data) + r * cols + c, even, odd, exact);
      }
      for (; c < end; c += 16) {
        const __mmask16 mask = Mask16(end - c);
        const __m512i b = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, codes + c));
        const __m512i mag = _mm512_and_si512(b, Set1(0x7F));
        nan |= _mm512_cmpeq_epi32_mask(mag, Set1(0x7F));
        StoreDense16(dst, r * cols + c, Fp8Value(mag, _mm512_slli_epi32(b, 24), vscale), mask);
      }
    }
    if (nan != 0 || _mm256_cmpeq_epi8_mask(max_mag, _mm256_set1_epi8(0x7F)) != 0) {
      return reference::Fp8BlockDequantRows(src, dst, r, row_end);
    }
  }
  return -1;
}

int64_t Mxfp4DequantRows(const Mxfp4Tensor& src, const DenseOut& dst, int64_t row_begin,
                         int64_t row_end) {
  const int64_t scale_cols = src.cols / kMxfp4BlockSize;
  const __m512 table = E2m1Table();
  for (int64_t si = row_begin * scale_cols; si < row_end * scale_cols; ++si) {
    const uint8_t b = src.scales[si];
    if (b == 0xFF) return reference::Mxfp4DequantRows(src, dst, si / scale_cols, row_end);
    // E2M1 * 2^k: <= 2 significant bits, >= 2^-128 (or inf), so exact in float and BF16.
    const __m512 values = _mm512_mul_ps(table, _mm512_set1_ps(E8m0Value(b)));
    const __m512i x = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(src.data + si * kMxfp4BlockSize / 2)));
    const int64_t i = si * kMxfp4BlockSize;
    if (dst.type == FloatType::kBF16) {
      // BF16 of each code, twice (index bit 4 is ignored); word 2j of the index is packed byte
      // j (low nibble in bits 0-3), word 2j+1 its high nibble.
      const __m512i bf16_table =
          _mm512_broadcast_i64x4(_mm512_cvtepi32_epi16(_mm512_srli_epi32(AsInt(values), 16)));
      const __m512i index = _mm512_or_si512(x, _mm512_slli_epi32(x, 12));
      _mm512_storeu_si512(static_cast<uint16_t*>(dst.data) + i,
                          _mm512_permutexvar_epi16(index, bf16_table));
    } else {
      // Each packed byte j becomes the byte pair (low nibble, high nibble) in element order.
      const __m256i w = _mm512_cvtepi32_epi16(x);
      const __m256i codes = _mm256_or_si256(w, _mm256_slli_epi16(w, 4));
      float* out = static_cast<float*>(dst.data) + i;
      _mm512_storeu_ps(
          out, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(codes)), values));
      _mm512_storeu_ps(
          out + 16,
          _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(codes, 1)), values));
    }
  }
  return -1;
}

int64_t AbsMaxRows(const DenseTensor& src, int64_t row_begin, int64_t row_end, float* amax) {
  const int64_t cols = src.cols;
  if (src.type == FloatType::kF32) {
    const float* p = static_cast<const float*>(src.data);
    __m512i m = _mm512_setzero_si512();
    for (int64_t r = row_begin; r < row_end; ++r) {
      for (int64_t c = 0; c < cols; c += 16) {
        const __m512i v = _mm512_maskz_loadu_epi32(Mask16(cols - c), p + r * cols + c);
        m = _mm512_max_epu32(m, _mm512_and_si512(v, Set1(0x7FFFFFFF)));
      }
      if (_mm512_cmpge_epu32_mask(m, Set1(0x7F800000)) != 0) {
        return reference::AbsMaxRows(src, r, row_end, amax);
      }
    }
    *amax = BitsAsFloat(_mm512_reduce_max_epu32(m));
    return -1;
  }
  const uint16_t* p = static_cast<const uint16_t*>(src.data);
  __m512i m = _mm512_setzero_si512();
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint16_t* row = p + r * cols;
    int64_t c = 0;
    for (; c + 32 <= cols; c += 32) {
      m = _mm512_max_epu16(m, _mm512_and_si512(_mm512_loadu_si512(row + c), Set1(0x7FFF7FFF)));
    }
    if (c < cols) {
      const __mmask32 tail = (1u << (cols - c)) - 1;
      m = _mm512_max_epu16(
          m, _mm512_and_si512(_mm512_maskz_loadu_epi16(tail, row + c), Set1(0x7FFF7FFF)));
    }
    if (_mm512_cmpge_epu16_mask(m, _mm512_set1_epi16(0x7F80)) != 0) {
      return reference::AbsMaxRows(src, r, row_end, amax);
    }
  }
  const __m512i wide =
      _mm512_max_epu32(_mm512_and_si512(m, Set1(0xFFFF)), _mm512_srli_epi32(m, 16));
  *amax = BitsAsFloat(_mm512_reduce_max_epu32(wide) << 16);
  return -1;
}

// ---- groups of 16 NVFP4 blocks -----------------------------------------------------------------

constexpr int kGroupBlocks = 16;
constexpr int64_t kGroupElements = kGroupBlocks * kNvfp4BlockSize;

// Two vectors whose 128-bit lanes hold partial maxima of blocks: returns, per 128-bit lane,
// [a's lanes 0+1 | a's 2+3 | b's 0+1 | b's 2+3] for kLanes, or per dword pair within each 128-bit
// lane for kDwords. Each step halves the partials per block and doubles the blocks per vector.
__m512i MaxLanePairs(__m512i a, __m512i b) {
  return _mm512_max_epu32(_mm512_shuffle_i32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_i32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}
__m512i MaxDwordPairs(__m512i a, __m512i b) {
  return _mm512_max_epu32(
      AsInt(_mm512_shuffle_ps(AsFloat(a), AsFloat(b), _MM_SHUFFLE(2, 0, 2, 0))),
      AsInt(_mm512_shuffle_ps(AsFloat(a), AsFloat(b), _MM_SHUFFLE(3, 1, 3, 1))));
}

// The 256 elements of 16 blocks from flat index `first`, as pairs of blocks (LoadPair) in
// even[k] / odd[k] for blocks 2k and 2k+1, and each block's max |x| as float bits, lane j for
// block j.
__m512i LoadGroup(const DenseTensor& t, int64_t first, __m512 even[8], __m512 odd[8]) {
  const __m512i abs = Set1(0x7FFFFFFF);
  __m512i m[8];  // pair k: lanes 0-7 hold block 2k's elements, 8-15 block 2k+1's
  for (int k = 0; k < 8; ++k) {
    LoadPair(t, first + 32 * k, &even[k], &odd[k]);
    m[k] = _mm512_max_epu32(_mm512_and_si512(AsInt(even[k]), abs),
                            _mm512_and_si512(AsInt(odd[k]), abs));
  }
  // 128-bit lane L of t[i] holds 4 partials of block 4i + L; of u[j], dword pair p of block
  // 8j + 4p + L; of v, dword p is block 4p + L.
  __m512i t4[4];
  for (int i = 0; i < 4; ++i) t4[i] = MaxLanePairs(m[2 * i], m[2 * i + 1]);
  const __m512i u0 = MaxDwordPairs(t4[0], t4[1]);
  const __m512i u1 = MaxDwordPairs(t4[2], t4[3]);
  const __m512i v = MaxDwordPairs(u0, u1);
  return _mm512_permutexvar_epi32(
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), v);
}

// One group of up to 16 blocks of a flat range [begin, end) (a multiple of 16 elements): the
// tensor (or a copy) to read it from, its first element there, its block count, and its first
// block in the tensor.
struct GroupRef {
  DenseTensor view;
  int64_t first = 0;
  int n = 0;
  int64_t block = 0;
};

// Group `index` of [begin, end). A last group of fewer than 16 blocks is copied into the zeroed
// `tail` buffer (kGroupElements F32s), which then is its view, so that reads stay in bounds.
GroupRef Group(const DenseTensor& t, int64_t begin, int64_t end, int64_t index, uint8_t* tail) {
  const int64_t first = begin + index * kGroupElements;
  const int n = static_cast<int>(MinI64(kGroupBlocks, (end - first) / kNvfp4BlockSize));
  if (n == kGroupBlocks) return {t, first, n, first / kNvfp4BlockSize};
  const size_t element_size = t.type == FloatType::kF32 ? 4 : 2;
  memset(tail, 0, kGroupElements * element_size);
  memcpy(tail, static_cast<const uint8_t*>(t.data) + first * element_size,
         (end - first) * element_size);
  return {{tail, t.type, 1, kGroupElements}, 0, n, first / kNvfp4BlockSize};
}

int64_t GroupCount(int64_t begin, int64_t end) {
  return (end - begin + kGroupElements - 1) / kGroupElements;
}

// E2M1 magnitude code by bucket: index (|q| bits >> 21) - 499, clamped to [0, 19], i.e. by the
// exponent and two mantissa bits from 0.1875 up. Every threshold (0.25, 0.75, ... 5) starts a
// bucket, so this is formats::FloatToE2m1's magnitude for every |q| that is not a threshold.
alignas(64) const uint16_t kE2m1ByBucket[32] = {0, 1, 1, 1, 1, 1, 1, 2, 2, 2, 3, 3, 4, 4, 5, 5,
                                                6, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7};

// kE2m1ByBucket of 32 words holding the top halves of |q| bit patterns (or anything >= 0x8000).
__m512i BucketCodes(__m512i abs_words) {
  const __m512i bucket =
      _mm512_min_epu16(_mm512_subs_epu16(_mm512_srli_epi16(abs_words, 5), _mm512_set1_epi16(499)),
                       _mm512_set1_epi16(19));
  return _mm512_permutexvar_epi16(bucket, _mm512_load_si512(kE2m1ByBucket));
}

// Top halves of the dwords of a pair of vectors as words in element order: word 2j from
// even's lane j, word 2j+1 from odd's.
__m512i TopWords(__m512i even, __m512i odd) {
  return _mm512_mask_blend_epi16(0xAAAAAAAA, _mm512_srli_epi32(even, 16), odd);
}

// formats::Nvfp4Encode of a pair of blocks (LoadPair lanes) without a division, given
// recip = RN(1/d) per lane. q' = RN(x * recip) is within 1.5 * 2^-23 relative of x / d, so the
// reference's q = RN(x / d) lies within 6 bit steps of q' (3 within a binade; within 2 for
// subnormal q'). Where no bucket boundary (multiple of 2^21) lies within 8 steps of |q'|, q is in
// q''s bucket and is no threshold, so its E2M1 magnitude is the bucket's code; its sign is q''s
// (q' is then at least 8 steps from 0, so q is not 0 either). Near a boundary the code is still
// q''s if it is the same 8 steps below and above (the boundary is no threshold: a power of two
// or an E2M1 value). Returns false, leaving *bytes alone, when some lane of the pair fails this.
// Blocks known to be all zero (`zero_blocks`: bit 0 the first, bit 1 the second) are exempt
// and get code 0 (x = +-0 gives q = +-0, which encodes as 0).
bool EncodePairFast(__m512 even, __m512 odd, __m512 recip, unsigned zero_blocks, __m512i* bytes) {
  static constexpr __mmask16 kZeroLanes[4] = {0, 0x00FF, 0xFF00, 0xFFFF};
  static constexpr __mmask32 kZeroWords[4] = {0, 0x0000FFFF, 0xFFFF0000, 0xFFFFFFFF};
  const __m512i qe = AsInt(_mm512_mul_ps(even, recip));
  const __m512i qo = AsInt(_mm512_mul_ps(odd, recip));
  const __m512i steps = Set1(8);
  // Bits 4-20 of q' + 8 all zero: a multiple of 2^21 lies in (|q'| - 8, |q'| + 8].
  const __m512i low21 = Set1(0x1FFFF0);
  const __mmask16 near = _mm512_testn_epi32_mask(_mm512_add_epi32(qe, steps), low21) |
                         _mm512_testn_epi32_mask(_mm512_add_epi32(qo, steps), low21);
  if ((near & ~kZeroLanes[zero_blocks]) != 0) {
    const __m512i abs_e = _mm512_and_si512(qe, Set1(0x7FFFFFFF));
    const __m512i abs_o = _mm512_and_si512(qo, Set1(0x7FFFFFFF));
    const __m512i below =
        BucketCodes(TopWords(_mm512_sub_epi32(abs_e, steps), _mm512_sub_epi32(abs_o, steps)));
    const __m512i above =
        BucketCodes(TopWords(_mm512_add_epi32(abs_e, steps), _mm512_add_epi32(abs_o, steps)));
    if ((_mm512_cmpneq_epi16_mask(below, above) & ~kZeroWords[zero_blocks]) != 0) return false;
  }
  const __m512i words = TopWords(qe, qo);
  const __m512i magnitude = BucketCodes(_mm512_and_si512(words, Set1(0x7FFF7FFF)));
  // magnitude | (sign bit >> 12 & 8)
  const __m512i codes = _mm512_ternarylogic_epi32(magnitude, _mm512_srli_epi16(words, 12),
                                                  _mm512_set1_epi16(8), 0xF8);
  // Low byte of lane j: lo | hi << 4.
  *bytes = _mm512_maskz_mov_epi32(static_cast<__mmask16>(~kZeroLanes[zero_blocks]),
                                  _mm512_or_si512(codes, _mm512_srli_epi32(codes, 12)));
  return true;
}

int64_t BlockAbsMax16Rows(const DenseTensor& src, float* out, int64_t row_begin, int64_t row_end) {
  const int64_t begin = row_begin * src.cols, end = row_end * src.cols;
  alignas(64) uint8_t tail[kGroupElements * sizeof(float)];
  for (int64_t i = 0; i < GroupCount(begin, end); ++i) {
    const GroupRef g = Group(src, begin, end, i, tail);
    __m512 even[8], odd[8];
    const __m512i amax = LoadGroup(g.view, g.first, even, odd);
    if (_mm512_cmpge_epu32_mask(amax, Set1(0x7F800000)) != 0) {
      return reference::BlockAbsMax16Rows(src, out, (g.block * kNvfp4BlockSize) / src.cols,
                                          row_end);
    }
    _mm512_mask_storeu_epi32(out + g.block, Mask16(g.n), amax);
  }
  return -1;
}

// Per-call constants of Nvfp4QuantizeRows.
struct QuantConstants {
  __m512 scale_div;              // 6 * scale_2, formats::Nvfp4BlockScale's divisor
  __m512 scale_div_recip;        // RN(1 / scale_div)
  alignas(64) float recip[128];  // E4M3 code c (0..127) -> RN(1 / (float(c) * scale_2))
};

void InitQuantConstants(float scale_2, QuantConstants* k) {
  k->scale_div = _mm512_set1_ps(6.0f * scale_2);
  k->scale_div_recip = _mm512_div_ps(_mm512_set1_ps(1.0f), k->scale_div);
  for (int c = 0; c < 128; c += 16) {
    const __m512i codes = _mm512_add_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), Set1(c));
    const __m512 unit = _mm512_mul_ps(E4m3ToFloat(codes), _mm512_set1_ps(scale_2));
    _mm512_store_ps(k->recip + c, _mm512_div_ps(_mm512_set1_ps(1.0f), unit));
  }
}

// formats::Nvfp4BlockScale's clamp of s (already 1 where it was 0) to [2^-9, 448], then its
// E4M3 byte.
__m512i ClampedE4m3(__m512 s) {
  const __m512 lo = _mm512_set1_ps(0x1p-9f);
  const __m512 hi = _mm512_set1_ps(448.0f);
  s = _mm512_mask_mov_ps(s, _mm512_cmp_ps_mask(s, lo, _CMP_LT_OQ), lo);
  s = _mm512_mask_mov_ps(s, _mm512_cmp_ps_mask(s, hi, _CMP_GT_OQ), hi);
  return FloatToE4m3(s);
}

// formats::Nvfp4BlockScale of 16 block maxima (float bits). The quotient m / (6 * scale_2) is
// estimated as m * RN(1 / (6 * scale_2)), within 6 bit steps of the true RN quotient (see
// EncodePairFast); the byte is monotone in the quotient, so where it is the same 8 steps below
// and above the estimate it is the reference's. Otherwise (rare: near E4M3 rounding ties, at the
// clamp's ends, for tiny maxima) the lanes are divided exactly.
__m512i BlockScales(__m512i amax, const QuantConstants& k) {
  const __m512 m = AsFloat(amax);
  const __m512 one = _mm512_set1_ps(1.0f);
  const __mmask16 zero = _mm512_cmpeq_epi32_mask(amax, _mm512_setzero_si512());
  const __m512i estimate =
      AsInt(_mm512_mask_mov_ps(_mm512_mul_ps(m, k.scale_div_recip), zero, one));
  const __m512i below = ClampedE4m3(AsFloat(_mm512_sub_epi32(estimate, Set1(8))));
  const __m512i above = ClampedE4m3(AsFloat(_mm512_add_epi32(estimate, Set1(8))));
  if (_mm512_cmpneq_epi32_mask(below, above) == 0) return above;
  const __m512 s = _mm512_div_ps(m, k.scale_div);
  return ClampedE4m3(
      _mm512_mask_mov_ps(s, _mm512_cmp_ps_mask(s, _mm512_setzero_ps(), _CMP_EQ_OQ), one));
}

// A group of blocks between its scales and its encoding (Nvfp4QuantizeRows).
struct QuantGroup {
  __m512 even[8];  // LoadGroup's pairs of blocks
  __m512 odd[8];
  __m512i scale_bytes;   // E4M3 scale of block j in lane j
  __m512 recip;          // RN(1 / (float(scale) * scale_2))
  unsigned zero_blocks;  // bit j: block j is all zero
  int n;                 // blocks in the group
  int64_t block;         // the group's first block in the tensor
};

// Loads group `g` and writes its block scales; false, writing nothing, if it holds a non-finite
// value.
bool PrepareGroup(const GroupRef& g, const QuantConstants& k, const Nvfp4Out& dst, QuantGroup* q) {
  const __m512i amax = LoadGroup(g.view, g.first, q->even, q->odd);
  if (_mm512_cmpge_epu32_mask(amax, Set1(0x7F800000)) != 0) return false;
  const __m512i scale_bytes = BlockScales(amax, k);
  _mm512_mask_cvtepi32_storeu_epi8(dst.scales + g.block, Mask16(g.n), scale_bytes);
  q->scale_bytes = scale_bytes;
  q->recip = _mm512_i32gather_ps(scale_bytes, k.recip, 4);
  q->zero_blocks = _mm512_cmpeq_epi32_mask(amax, _mm512_setzero_si512());
  q->n = g.n;
  q->block = g.block;
  return true;
}

// formats::Nvfp4Encode of a prepared group, a pair of blocks at a time: lane j gives packed
// byte j.
void EncodeGroup(const QuantGroup& q, float scale_2, const Nvfp4Out& dst) {
  const __m512i pair_lanes = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  uint8_t* out = dst.data + q.block * kNvfp4BlockSize / 2;
  for (int k = 0; 2 * k < q.n; ++k) {
    const __m512i lanes = _mm512_add_epi32(pair_lanes, Set1(2 * k));
    __m512i bytes;
    if (!EncodePairFast(q.even[k], q.odd[k], _mm512_permutexvar_ps(lanes, q.recip),
                        (q.zero_blocks >> (2 * k)) & 3, &bytes)) {
      const __m512 unit = _mm512_mul_ps(E4m3ToFloat(q.scale_bytes), _mm512_set1_ps(scale_2));
      const __m512 d = _mm512_permutexvar_ps(lanes, unit);
      const __m512i lo_nibble = FloatToE2m1(_mm512_div_ps(q.even[k], d));
      const __m512i hi_nibble = FloatToE2m1(_mm512_div_ps(q.odd[k], d));
      bytes = _mm512_or_si512(lo_nibble, _mm512_slli_epi32(hi_nibble, 4));
    }
    _mm512_mask_cvtepi32_storeu_epi8(out + 16 * k, Mask16(2 * k + 2 <= q.n ? 16 : 8), bytes);
  }
}

int64_t Nvfp4QuantizeRows(const DenseTensor& src, float scale_2, const Nvfp4Out& dst,
                          int64_t row_begin, int64_t row_end) {
  // With scale_2 >= 2^-100 every divisor below is >= 2^-109 and finite, so no quotient is NaN,
  // which FloatToE2m1 here relies on. Only all-but-zero tensors have a smaller scale_2.
  if (!(scale_2 >= 0x1p-100f))
    return reference::Nvfp4QuantizeRows(src, scale_2, dst, row_begin, row_end);
  QuantConstants constants;
  InitQuantConstants(scale_2, &constants);
  const int64_t begin = row_begin * src.cols, end = row_end * src.cols;
  const int64_t count = GroupCount(begin, end);
  alignas(64) uint8_t tail[kGroupElements * sizeof(float)];
  QuantGroup groups[2];
  // Group i + 1 is prepared before group i is encoded, so that the latency of its scales
  // overlaps the encoding work.
  for (int64_t i = 0; i <= count; ++i) {
    const bool ok =
        i == count || PrepareGroup(Group(src, begin, end, i, tail), constants, dst, &groups[i % 2]);
    if (i > 0) EncodeGroup(groups[(i - 1) % 2], scale_2, dst);
    if (!ok) {
      return reference::Nvfp4QuantizeRows(src, scale_2, dst,
                                          (begin + i * kGroupElements) / src.cols, row_end);
    }
  }
  return -1;
}

void Nvfp4DequantRows(const Nvfp4Tensor& src, const DenseOut& dst, int64_t row_begin,
                      int64_t row_end) {
  const int64_t blocks_per_row = src.cols / kNvfp4BlockSize;
  const int64_t end = row_end * blocks_per_row;
  const __m512 table = E2m1Table();
  const __m512 scale_2 = _mm512_set1_ps(src.scale_2);
  const __m512i pair_lanes = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  for (int64_t g = row_begin * blocks_per_row; g < end; g += kGroupBlocks) {
    const int n = static_cast<int>(MinI64(kGroupBlocks, end - g));
    const __m512 scales =
        E4m3ToFloat(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(Mask16(n), src.scales + g)));
    int b = 0;
    // formats::Nvfp4Decode: (e2m1 * float(scale)) * scale_2, a pair of BF16 blocks at a time.
    for (; dst.type == FloatType::kBF16 && b + 2 <= n; b += 2) {
      const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(src.data + (g + b) * kNvfp4BlockSize / 2)));
      const __m512 s = _mm512_permutexvar_ps(_mm512_add_epi32(pair_lanes, Set1(b)), scales);
      const __m512 even = _mm512_mul_ps(_mm512_mul_ps(_mm512_permutexvar_ps(x, table), s), scale_2);
      const __m512 odd = _mm512_mul_ps(
          _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(x, 4), table), s), scale_2);
      StoreBf16Pair(static_cast<uint16_t*>(dst.data) + (g + b) * kNvfp4BlockSize, even, odd, false);
    }
    for (; b < n; ++b) {
      const __m512i w =
          _mm512_cvtepu8_epi32(UnpackNibbles8(src.data + (g + b) * kNvfp4BlockSize / 2));
      const __m512 s = _mm512_permutexvar_ps(Set1(b), scales);
      StoreDense16(dst, (g + b) * kNvfp4BlockSize,
                   _mm512_mul_ps(_mm512_mul_ps(_mm512_permutexvar_ps(w, table), s), scale_2),
                   0xFFFF);
    }
  }
}

int64_t Mxfp4MaxScaleRows(const Mxfp4Tensor& src, int64_t row_begin, int64_t row_end,
                          uint8_t* max_byte) {
  const int64_t scale_cols = src.cols / kMxfp4BlockSize;
  __m512i m = _mm512_setzero_si512();
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint8_t* row = src.scales + r * scale_cols;
    for (int64_t c = 0; c < scale_cols; c += 64) {
      const int64_t n = scale_cols - c;
      const __mmask64 mask = n >= 64 ? ~__mmask64{0} : (__mmask64{1} << n) - 1;
      m = _mm512_max_epu8(m, _mm512_maskz_loadu_epi8(mask, row + c));
    }
    if (_mm512_cmpeq_epi8_mask(m, _mm512_set1_epi8(static_cast<char>(0xFF))) != 0) {
      return reference::Mxfp4MaxScaleRows(src, r, row_end, max_byte);
    }
  }
  m = _mm512_max_epu8(m, _mm512_srli_epi32(m, 8));
  m = _mm512_max_epu8(m, _mm512_srli_epi32(m, 16));
  *max_byte = static_cast<uint8_t>(_mm512_reduce_max_epu32(_mm512_and_si512(m, Set1(0xFF))));
  return -1;
}

int64_t Mxfp4ToNvfp4Rows(const Mxfp4Tensor& src, int kmax, const Nvfp4Out& dst, int64_t row_begin,
                         int64_t row_end, int64_t* requantized) {
  const int64_t scale_cols = src.cols / kMxfp4BlockSize;
  // A block keeps its nibbles when e = k - kmax + 8 >= -9, i.e. when its byte b >= kmax + 110.
  const int keep_min = kmax + 110;
  const __m512i e_plus_7 = Set1(static_cast<uint32_t>(kmax + 112));  // b - (kmax + 112) = e + 7
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint8_t* scales = src.scales + r * scale_cols;
    __m512i row_min = _mm512_set1_epi8(static_cast<char>(0xFF));
    __m512i row_max = _mm512_setzero_si512();
    for (int64_t c = 0; c < scale_cols; c += 64) {
      const int64_t n = scale_cols - c;
      const __mmask64 mask = n >= 64 ? ~__mmask64{0} : (__mmask64{1} << n) - 1;
      row_min = _mm512_min_epu8(row_min, _mm512_mask_loadu_epi8(row_min, mask, scales + c));
      row_max = _mm512_max_epu8(row_max, _mm512_maskz_loadu_epi8(mask, scales + c));
    }
    const bool nan =
        _mm512_cmpeq_epi8_mask(row_max, _mm512_set1_epi8(static_cast<char>(0xFF))) != 0;
    const bool requant =
        _mm512_cmplt_epu8_mask(
            row_min, _mm512_set1_epi8(static_cast<char>(keep_min < 0 ? 0 : keep_min))) != 0;
    if (nan || requant) {  // the reference requantizes (or rejects) this row
      const int64_t bad = reference::Mxfp4ToNvfp4Rows(src, kmax, dst, r, r + 1, requantized);
      if (bad >= 0) return bad;
      continue;
    }
    memcpy(dst.data + r * src.cols / 2, src.data + r * src.cols / 2, src.cols / 2);
    // Scale 2^e, e in [-9, 8], as E4M3: (e + 7) << 3 when normal, else the subnormal 2^(e + 9).
    for (int64_t c = 0; c < scale_cols; c += 16) {
      const __mmask16 mask = Mask16(scale_cols - c);
      const __m512i e7 =
          _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, scales + c)), e_plus_7);
      const __m512i normal = _mm512_slli_epi32(e7, 3);
      const __m512i subnormal = _mm512_sllv_epi32(Set1(1), _mm512_add_epi32(e7, Set1(2)));
      const __m512i code = _mm512_mask_mov_epi32(
          subnormal, _mm512_cmpgt_epi32_mask(e7, _mm512_setzero_si512()), normal);
      // One MXFP4 block is two NVFP4 blocks with the same scale.
      _mm256_mask_storeu_epi16(
          dst.scales + 2 * (r * scale_cols + c), mask,
          _mm512_cvtepi32_epi16(_mm512_or_si512(code, _mm512_slli_epi32(code, 8))));
    }
  }
  return -1;
}

}  // namespace

extern const RowKernels kAvx512RowKernels = {
    "avx512",          Fp8BlockDequantRows, Mxfp4DequantRows,  AbsMaxRows,       BlockAbsMax16Rows,
    Nvfp4QuantizeRows, Nvfp4DequantRows,    Mxfp4MaxScaleRows, Mxfp4ToNvfp4Rows,
};

}  // namespace quantd::kernels::cpu
