// AVX-512 (F, BW, VL, DQ) row kernels, 16 float lanes at a time. Run only where
// SupportedSimdLevels() lists kAvx512.
//
// Every kernel writes the bytes kernels/reference.cc writes. Float operations that decide a
// result are the reference's, in its order; integer tricks stand in only where they are exact
// (E4M3 decoding by moving bits, abs-max on bit patterns, E4M3 / E2M1 rounding with integer adds,
// BF16 truncation where a value is known to be exact in BF16). NVFP4 quantization avoids most
// divisions: it estimates each quotient with a reciprocal and takes the estimate's code only
// where it provably is the quotient's (see "NVFP4 quantization"); elsewhere it divides. NVFP4
// decoding looks its values up in a table. A row with bad input goes to the reference from that
// row on, which finds the exact first bad element. Shared inline code must not be called here
// (see simd_common.h).
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "kernels/cpu/row_kernels.h"
#include "kernels/cpu/simd_common.h"
#include "kernels/reference.h"

namespace quantd::kernels::cpu {
namespace {

// For small helpers of the hot loops that GCC would otherwise call out of line.
#define QUANTD_INLINE __attribute__((always_inline)) inline

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

// How far ahead of its reads AbsMaxRows prefetches (it streams whole tensors; measured).
constexpr int64_t kAbsMaxPrefetchBytes = 8192;

int64_t AbsMaxRows(const DenseTensor& src, int64_t row_begin, int64_t row_end, float* amax) {
  const int64_t cols = src.cols;
  if (src.type == FloatType::kF32) {
    const float* p = static_cast<const float*>(src.data);
    __m512i m = _mm512_setzero_si512();
    for (int64_t r = row_begin; r < row_end; ++r) {
      for (int64_t c = 0; c < cols; c += 16) {
        _mm_prefetch(reinterpret_cast<const char*>(p + r * cols + c) + kAbsMaxPrefetchBytes,
                     _MM_HINT_T0);
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
      _mm_prefetch(reinterpret_cast<const char*>(row + c) + kAbsMaxPrefetchBytes, _MM_HINT_T0);
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
//
// The hot loops are written once for BF16 and F32 input (kType) and inlined whole, so that each
// compiles to straight code with its values in registers.

constexpr int kGroupBlocks = 16;
constexpr int64_t kGroupElements = kGroupBlocks * kNvfp4BlockSize;

template <FloatType kType>
constexpr int64_t kElementSize = kType == FloatType::kF32 ? 4 : 2;

// Two vectors whose 128-bit lanes hold partial maxima of blocks: returns, per 128-bit lane,
// [a's lanes 0+1 | a's 2+3 | b's 0+1 | b's 2+3] for kLanes, or per dword pair within each 128-bit
// lane for kDwords. Each step halves the partials per block and doubles the blocks per vector.
// `max` is max_epu32 (dword partials) or max_epu16 (word partials).
template <__m512i (*max)(__m512i, __m512i)>
QUANTD_INLINE __m512i MaxLanePairs(__m512i a, __m512i b) {
  return max(_mm512_shuffle_i32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
             _mm512_shuffle_i32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}
template <__m512i (*max)(__m512i, __m512i)>
QUANTD_INLINE __m512i MaxDwordPairs(__m512i a, __m512i b) {
  return max(AsInt(_mm512_shuffle_ps(AsFloat(a), AsFloat(b), _MM_SHUFFLE(2, 0, 2, 0))),
             AsInt(_mm512_shuffle_ps(AsFloat(a), AsFloat(b), _MM_SHUFFLE(3, 1, 3, 1))));
}
// The same per qword pair.
QUANTD_INLINE __m512i MaxQwordPairsU16(__m512i a, __m512i b) {
  return _mm512_max_epu16(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
}
__m512i MaxU32(__m512i a, __m512i b) { return _mm512_max_epu32(a, b); }
__m512i MaxU16(__m512i a, __m512i b) { return _mm512_max_epu16(a, b); }

// Max |x| of each of the 16 blocks at p as float bits, lane j for block j.
template <FloatType kType>
QUANTD_INLINE __m512i GroupAbsMax(const uint8_t* p) {
  // Which block dword p of each 128-bit lane L ends up holding: 4p + L.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  __m512i t[4];
  if constexpr (kType == FloatType::kBF16) {
    // |x| as words; 128-bit lane L of t[i] holds 8 partials of block 4i + L, of u[j] 4 of blocks
    // 8j + L and 8j + 4 + L, of v 2 of blocks L, 4 + L, 8 + L and 12 + L.
    __m512i m[8];
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {
      m[k] = _mm512_and_si512(_mm512_loadu_si512(p + 64 * k), Set1(0x7FFF7FFF));
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) t[i] = MaxLanePairs<MaxU16>(m[2 * i], m[2 * i + 1]);
    const __m512i v =
        MaxDwordPairs<MaxU16>(MaxQwordPairsU16(t[0], t[1]), MaxQwordPairsU16(t[2], t[3]));
    // Each dword's larger word, in its high half: the BF16 max as float bits.
    const __m512i high =
        _mm512_and_si512(_mm512_max_epu16(v, _mm512_slli_epi32(v, 16)), Set1(0xFFFF0000u));
    return _mm512_permutexvar_epi32(order, high);
  } else {
    // |x| as dwords; lanes 0-7 of m[k] hold partials of block 2k, 8-15 of block 2k+1; 128-bit
    // lane L of t[i] holds 4 partials of block 4i + L, of u[j] 2 of blocks 8j + L and
    // 8j + 4 + L, of v one of blocks L, 4 + L, 8 + L and 12 + L.
    __m512i m[8];
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {
      const __m512i a = _mm512_and_si512(_mm512_loadu_si512(p + 128 * k), Set1(0x7FFFFFFF));
      const __m512i b = _mm512_and_si512(_mm512_loadu_si512(p + 128 * k + 64), Set1(0x7FFFFFFF));
      m[k] = _mm512_max_epu32(_mm512_shuffle_i32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_i32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) t[i] = MaxLanePairs<MaxU32>(m[2 * i], m[2 * i + 1]);
    const __m512i v =
        MaxDwordPairs<MaxU32>(MaxDwordPairs<MaxU32>(t[0], t[1]), MaxDwordPairs<MaxU32>(t[2], t[3]));
    return _mm512_permutexvar_epi32(order, v);
  }
}

// One group of up to 16 blocks of a flat range: where its elements are read, its block count,
// and its first block in the tensor.
struct GroupRef {
  const uint8_t* p;
  int n;
  int64_t block;
};

// Group `index` of the flat range [begin, end) (a multiple of 16 elements). A last group of
// fewer than 16 blocks is copied into the zeroed `tail` buffer (kGroupElements F32s) and read
// there, so that reads stay in bounds.
template <FloatType kType>
QUANTD_INLINE GroupRef Group(const void* data, int64_t begin, int64_t end, int64_t index,
                             uint8_t* tail) {
  const int64_t first = begin + index * kGroupElements;
  const uint8_t* p = static_cast<const uint8_t*>(data) + first * kElementSize<kType>;
  if (end - first >= kGroupElements) return {p, kGroupBlocks, first / kNvfp4BlockSize};
  memset(tail, 0, kGroupElements * kElementSize<kType>);
  memcpy(tail, p, (end - first) * kElementSize<kType>);
  return {tail, static_cast<int>((end - first) / kNvfp4BlockSize), first / kNvfp4BlockSize};
}

int64_t GroupCount(int64_t begin, int64_t end) {
  return (end - begin + kGroupElements - 1) / kGroupElements;
}

template <FloatType kType>
int64_t BlockAbsMax16Range(const DenseTensor& src, float* out, int64_t row_begin, int64_t row_end) {
  const int64_t begin = row_begin * src.cols, end = row_end * src.cols;
  alignas(64) uint8_t tail[kGroupElements * sizeof(float)];
  for (int64_t i = 0; i < GroupCount(begin, end); ++i) {
    const GroupRef g = Group<kType>(src.data, begin, end, i, tail);
    const __m512i amax = GroupAbsMax<kType>(g.p);
    if (_mm512_cmpge_epu32_mask(amax, Set1(0x7F800000)) != 0) {
      return reference::BlockAbsMax16Rows(src, out, (g.block * kNvfp4BlockSize) / src.cols,
                                          row_end);
    }
    _mm512_mask_storeu_epi32(out + g.block, Mask16(g.n), amax);
  }
  return -1;
}

int64_t BlockAbsMax16Rows(const DenseTensor& src, float* out, int64_t row_begin, int64_t row_end) {
  return src.type == FloatType::kBF16
             ? BlockAbsMax16Range<FloatType::kBF16>(src, out, row_begin, row_end)
             : BlockAbsMax16Range<FloatType::kF32>(src, out, row_begin, row_end);
}

// ---- NVFP4 quantization -------------------------------------------------------------------------
//
// formats::Nvfp4Encode divides x by d = float(scale) * scale_2, q = RN(x / d). Here
// q" = RN(x * r) with r = RN(RN(1 / d) * (1 + 2^-21)) stands in for it, and lies at most 17 bit
// steps above q, never below: x * r = (x / d)(1 + p) with p between 2^-21 - 3u and 2^-21 + 3u
// (u = 2^-24, three roundings), so above x / d by less than 10.01 steps of its binade (or, where
// a power of two 2^k lies between, by up to 10.01 steps of 2^k's lower binade and 5.01 of its
// upper one), and rounding both ends moves neither across the other. (Subnormal quotients: at
// most 6 steps.) E2M1 codes change only at multiples of 2^21 in the bit pattern of |q|
// ("buckets": every rounding threshold is one, and so is 0). Where none lies within 32 steps
// below |q"| (or at it), q is in |q"|'s bucket, is no threshold and is not 0: its code is the
// bucket's, with q"'s sign. Where one lies ("near") that is no threshold nor 0, q is in one of
// the two buckets it separates, whose codes are the same, and |q"| is in the upper one. Pairs of
// blocks with any other element go to EncodeExact, which divides as the reference does.
//
// Zero and subnormal elements ("tiny") are never multiplied (each instruction with a subnormal
// operand or result costs a microcode assist of about 100 cycles). With scale_2 >= 2^-100, such
// an x has |x / d| < 2^-126 / (2^-9 * scale_2) <= 2^-17: magnitude 0, and code 8 exactly when
// x < 0 and RN(|x| / d) != 0, i.e. when |x| = k * 2^-149 > d * 2^-150 (a tie rounds to 0), i.e.
// when 2k > d, where float(2k) is exact (k < 2^23). Where d < 2 that is just k != 0.
//
// Branches taken at random cost far more than the work they skip here (a mispredicted branch
// discards the next group's preparation too), so only rare cases branch.

// E2M1 magnitude code by bucket index (|q| bits >> 21) - 499, clamped to [0, 19], i.e. by the
// exponent and two mantissa bits from 0.1875 up. Every threshold (0.25, 0.75, ... 5) starts a
// bucket, so this is formats::FloatToE2m1's magnitude for every |q| that is not a threshold.
// Entries 32 + i are those for a |q"| near the start of bucket i, with bit 7 set where that start
// is a threshold or 0 (bucket 0 starts below 0.1875).
alignas(64) const uint16_t kE2m1ByBucket[64] = {
    0,    1,    1,    1, 1,    1, 1,    2,     // buckets 0-7: |q| below 0.875
    2,    2,    3,    3, 4,    4, 5,    5,     // 8-15: below 3.5
    6,    6,    7,    7, 7,    7, 7,    7,     // 16-19: from 3.5 (20-31 unused)
    7,    7,    7,    7, 7,    7, 7,    7,     //
    0x80, 0x81, 1,    1, 1,    1, 1,    0x82,  // 32 + i: near the start of bucket i
    2,    2,    0x83, 3, 0x84, 4, 0x85, 5,     //
    0x86, 6,    0x87, 7, 7,    7, 7,    7,     //
    7,    7,    7,    7, 7,    7, 7,    7};

// Per-call constants of Nvfp4QuantizeRows. The fixed ones are made opaque to the compiler: GCC
// otherwise rebuilds each with a broadcast (a shuffle-port instruction) every time it is used.
struct QuantConstants {
  __m512 scale_2;         // weight_scale_2
  __m512 scale_div;       // D = 6 * scale_2, formats::Nvfp4BlockScale's divisor
  __m512i floor_bits;     // max(2^-126, D * 2^-124): below it m / D < 2^-28, above >= 2^-124
  bool tiny_may_vanish;   // D >= 2: a block max below floor_bits may divide to 0
  __m512 one;             // 1.0f
  __m512 two;             // 2.0f
  __m512 scale_lo;        // 2^-9, the smallest block scale
  __m512 scale_hi;        // 448, the largest
  __m512 magic;           // 2^14: adding it rounds to E4M3's subnormal grid of 2^-9
  __m512i e4m3_normal;    // bits of 2^-6, E4M3's smallest normal
  __m512i low20;          // 0x7FFFF per dword
  __m512i high12;         // 0xFFF00000 per dword
  __m512 recip_up;        // 1 + 2^-21, the upward bias of EncodePair's reciprocals
  __m512i exponent;       // 0x7F800000 per dword
  __m512i bf16_exponent;  // 0x7F80 per word
  __m512i high_words;     // 0xFFFF0000 per dword
  __m512i sign_bit;       // 0x80000000 per dword
  __m512i abs_words;      // 0x7FFF per word
  __m512i low5;           // 0x001F per word
  __m512i high11_words;   // 0xFFE0 per word
  __m512i bias;           // 499 per word
  __m512i last;           // 19 per word
  __m512i near_index;     // 32 per word
  __m512i table_lo;       // kE2m1ByBucket[0, 32)
  __m512i table_hi;       // kE2m1ByBucket[32, 64)
  __m512i doubt;          // 0x80 per word
  __m512i code_bits;      // 7 per word
  __m512i nibbles;        // words 1 and 16 per dword, for madd
  __m512i tiny_quotient;  // bits of 1.125 * 2^-126
};

QuantConstants MakeQuantConstants(float scale_2) {
  const float scale_div = 6.0f * scale_2;
  const float floor = scale_div >= 0.25f ? scale_div * 0x1p-124f : 0x1p-126f;
  uint32_t floor_bits;
  memcpy(&floor_bits, &floor, sizeof(floor_bits));
  QuantConstants k = {_mm512_set1_ps(scale_2),
                      _mm512_set1_ps(scale_div),
                      Set1(floor_bits),
                      scale_div >= 2.0f,
                      _mm512_set1_ps(1.0f),
                      _mm512_set1_ps(2.0f),
                      _mm512_set1_ps(0x1p-9f),
                      _mm512_set1_ps(448.0f),
                      _mm512_set1_ps(0x1p14f),
                      Set1(121u << 23),
                      Set1(0x7FFFF),
                      Set1(0xFFF00000u),
                      _mm512_set1_ps(1.0f + 0x1p-21f),
                      Set1(0x7F800000),
                      Set1(0x7F807F80),
                      Set1(0xFFFF0000u),
                      Set1(0x80000000u),
                      Set1(0x7FFF7FFF),
                      Set1(0x001F001F),
                      Set1(0xFFE0FFE0u),
                      Set1(0x01F301F3),
                      Set1(0x00130013),
                      Set1(0x00200020),
                      _mm512_load_si512(kE2m1ByBucket),
                      _mm512_load_si512(kE2m1ByBucket + 32),
                      Set1(0x00800080),
                      Set1(0x00070007),
                      Set1(0x00100001),
                      Set1(0x00900000)};
  asm(""
      : "+v"(k.one), "+v"(k.two), "+v"(k.scale_lo), "+v"(k.scale_hi), "+v"(k.magic),
        "+v"(k.e4m3_normal), "+v"(k.low20), "+v"(k.high12), "+v"(k.recip_up), "+v"(k.exponent));
  asm(""
      : "+v"(k.bf16_exponent), "+v"(k.high_words), "+v"(k.sign_bit), "+v"(k.abs_words),
        "+v"(k.low5), "+v"(k.high11_words), "+v"(k.bias), "+v"(k.last), "+v"(k.near_index),
        "+v"(k.table_lo));
  asm(""
      : "+v"(k.table_hi), "+v"(k.doubt), "+v"(k.code_bits), "+v"(k.nibbles), "+v"(k.tiny_quotient));
  return k;
}

// Elements 2j and 2j+1 of the 32 values at p, as floats (see "element pairs"). Returns whether
// one of them is tiny (exponent field 0).
template <FloatType kType>
QUANTD_INLINE bool LoadPair(const uint8_t* p, const QuantConstants& k, __m512* even, __m512* odd) {
  if constexpr (kType == FloatType::kBF16) {
    const __m512i w = _mm512_loadu_si512(p);
    *even = AsFloat(_mm512_slli_epi32(w, 16));
    *odd = AsFloat(_mm512_and_si512(w, k.high_words));
    return _mm512_testn_epi16_mask(w, k.bf16_exponent) != 0;
  } else {
    const __m512 a = _mm512_loadu_ps(p);
    const __m512 b = _mm512_loadu_ps(p + 64);
    const __m512i two_j =
        _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    *even = _mm512_permutex2var_ps(a, two_j, b);
    *odd = _mm512_permutex2var_ps(a, _mm512_add_epi32(two_j, Set1(1)), b);
    return !_kortestz_mask16_u8(_mm512_testn_epi32_mask(AsInt(a), k.exponent),
                                _mm512_testn_epi32_mask(AsInt(b), k.exponent));
  }
}

// formats::Nvfp4BlockScale's last steps for 16 quotients s > 0 (1 where the quotient was 0):
// clamp to [2^-9, 448], round to E4M3 (to nearest even; on the subnormal grid of 2^-9 below
// 2^-6). Returns the bytes and writes the values of the scales as floats to *value.
QUANTD_INLINE __m512i RoundScales(__m512 s, const QuantConstants& k, __m512* value) {
  s = _mm512_min_ps(_mm512_max_ps(s, k.scale_lo), k.scale_hi);
  const __m512i bits = AsInt(s);
  // Normal: add half an E4M3 ulp less one, plus the kept mantissa's last bit, and truncate.
  const __m512i odd = _mm512_srli_epi32(_mm512_slli_epi32(bits, 11), 31);
  const __m512i rounded =
      _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(bits, k.low20), odd), k.high12);
  const __m512i normal_byte = _mm512_srli_epi32(_mm512_sub_epi32(rounded, Set1(120u << 23)), 20);
  const __m512 shifted = _mm512_add_ps(s, k.magic);
  const __mmask16 subnormal = _mm512_cmplt_epu32_mask(bits, k.e4m3_normal);
  *value = _mm512_mask_sub_ps(AsFloat(rounded), subnormal, shifted, k.magic);
  return _mm512_mask_sub_epi32(normal_byte, subnormal, AsInt(shifted), AsInt(k.magic));
}

// formats::Nvfp4BlockScale of 16 finite block maxima m (float bits): returns the scale bytes
// and writes float(scale) to *value. It divides max(m, floor) by D instead of m, which gives the
// same scale wherever the quotient is not 0 (below floor it is < 2^-28 and clamps to 2^-9), and
// has no subnormal operand or result. The quotient is 0 for m = 0 (scale 1), and for m > 0 only
// if D >= 2; those lanes are divided as the reference does.
QUANTD_INLINE __m512i BlockScales(__m512i amax, const QuantConstants& k, __m512* value) {
  const __mmask16 zero = _mm512_testn_epi32_mask(amax, amax);
  __m512 s = _mm512_div_ps(AsFloat(_mm512_max_epu32(amax, k.floor_bits)), k.scale_div);
  s = _mm512_mask_mov_ps(s, zero, k.one);
  if (k.tiny_may_vanish) {
    const __mmask16 tiny = _mm512_mask_cmplt_epu32_mask(~zero, amax, k.floor_bits);
    if (tiny != 0) {
      const __m512 q = _mm512_div_ps(_mm512_mask_mov_ps(k.one, tiny, AsFloat(amax)), k.scale_div);
      s = _mm512_mask_mov_ps(s, tiny, q);
      s = _mm512_mask_mov_ps(s, _mm512_cmp_ps_mask(s, _mm512_setzero_ps(), _CMP_EQ_OQ), k.one);
    }
  }
  return RoundScales(s, k, value);
}

// Top halves of the dwords of a pair of vectors as words in element order: word 2j from even's
// lane j, word 2j+1 from odd's.
QUANTD_INLINE __m512i TopWords(__m512i even, __m512i odd, const QuantConstants& k) {
  return _mm512_ternarylogic_epi32(_mm512_srli_epi32(even, 16), odd, k.high_words,
                                   0xD8);  // c ? b : a
}

// The same for the bottom halves.
QUANTD_INLINE __m512i BottomWords(__m512i even, __m512i odd, const QuantConstants& k) {
  return _mm512_ternarylogic_epi32(even, _mm512_slli_epi32(odd, 16), k.high_words,
                                   0xD8);  // c ? b : a
}

// formats::Nvfp4Encode of 16 lanes of a pair, exactly: a division where x is normal, the rule
// for tiny x (see above) elsewhere. d > 0 is the lanes' divisor.
__m512i EncodeExact(__m512 x, __m512 d) {
  const __mmask16 tiny = _mm512_testn_epi32_mask(AsInt(x), Set1(0x7F800000));
  const __m512i code =
      FloatToE2m1(_mm512_div_ps(_mm512_mask_mov_ps(x, tiny, _mm512_set1_ps(1.0f)), d));
  const __m512i k = _mm512_and_si512(AsInt(x), Set1(0x7FFFFFFF));
  const __mmask16 negative =
      _mm512_cmplt_epi32_mask(AsInt(x), _mm512_setzero_si512()) & _mm512_test_epi32_mask(k, k);
  const __mmask16 nonzero_q =
      _mm512_cmp_ps_mask(_mm512_cvtepi32_ps(_mm512_add_epi32(k, k)), d, _CMP_GT_OQ);
  return _mm512_mask_mov_epi32(code, tiny, _mm512_maskz_mov_epi32(negative & nonzero_q, Set1(8)));
}

// For tiny x where d < 2: a stand-in for q with q's code, 0 or 8 (see above): 1.125 * 2^-126,
// in the lowest bucket and far from its start, with the sign bit of (x - 1) & x, which is set
// exactly for negative x other than -0.
QUANTD_INLINE __m512 TinyQuotient(__m512 x, const QuantConstants& k) {
  const __m512i bits = AsInt(x);
  const __m512i sign = _mm512_and_si512(_mm512_sub_epi32(bits, Set1(1)), bits);
  return AsFloat(_mm512_ternarylogic_epi32(sign, k.sign_bit, k.tiny_quotient,
                                           0xEA));  // (a & b) | c
}

// formats::Nvfp4Encode of a pair of blocks (LoadPair lanes): lane j gives packed byte j (low 8
// bits; the rest 0). `r` holds the biased reciprocal of d per lane, `d` d itself; `tiny`: the
// pair has a tiny element; `small_d`: every d of its group is below 2. Exact (see above).
QUANTD_INLINE __m512i EncodePair(__m512 even, __m512 odd, bool tiny, bool small_d, __m512 r,
                                 __m512 d, const QuantConstants& k) {
  __m512 qe, qo;
  if (!tiny) {
    qe = _mm512_mul_ps(even, r);
    qo = _mm512_mul_ps(odd, r);
  } else {
    if (!small_d) goto exact;
    qe = _mm512_mask_mul_ps(TinyQuotient(even, k), _mm512_test_epi32_mask(AsInt(even), k.exponent),
                            even, r);
    qo = _mm512_mask_mul_ps(TinyQuotient(odd, k), _mm512_test_epi32_mask(AsInt(odd), k.exponent),
                            odd, r);
  }
  {
    // |q"| as words in element order; near: bits 5-20 all zero.
    const __m512i high = TopWords(AsInt(qe), AsInt(qo), k);
    const __m512i low = BottomWords(AsInt(qe), AsInt(qo), k);
    const __mmask32 near =
        _mm512_mask_testn_epi16_mask(_mm512_testn_epi16_mask(high, k.low5), low, k.high11_words);
    __m512i index = _mm512_min_epu16(
        _mm512_subs_epu16(_mm512_srli_epi16(_mm512_and_si512(high, k.abs_words), 5), k.bias),
        k.last);
    index = _mm512_mask_add_epi16(index, near, index, k.near_index);
    const __m512i magnitude = _mm512_permutex2var_epi16(k.table_lo, index, k.table_hi);
    if (_mm512_test_epi16_mask(magnitude, k.doubt) == 0) {
      // magnitude | (sign bit >> 12 & 8), then word 2j + 16 * word 2j+1 per lane.
      const __m512i codes = _mm512_ternarylogic_epi32(magnitude, _mm512_srli_epi16(high, 12),
                                                      k.code_bits, 0xE4);  // c ? a : b
      return _mm512_madd_epi16(codes, k.nibbles);
    }
  }
exact:
  return _mm512_or_si512(EncodeExact(even, d), _mm512_slli_epi32(EncodeExact(odd, d), 4));
}

// Four pairs' bytes (EncodePair) as 64 bytes in order.
__m512i PackPairs(__m512i a, __m512i b, __m512i c, __m512i d) {
  // Per 128-bit lane L: a's, b's, c's and d's dwords 4L..4L+3 as bytes.
  const __m512i bytes = _mm512_packus_epi16(_mm512_packus_epi32(a, b), _mm512_packus_epi32(c, d));
  return _mm512_permutexvar_epi32(
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), bytes);
}

// How many groups ahead of the one being prepared Nvfp4QuantizeRows prefetches (measured best
// among 2, 6 and 16 on a [2048, 4096] tensor).
constexpr int64_t kPrefetchGroups = 16;

// A group with its block scales chosen and written (PrepareGroup), waiting to be encoded.
struct ScaledGroup {
  GroupRef g;
  __m512 d;      // float(scale) * scale_2 of block j in lane j
  __m512 r;      // RN(RN(1 / d) * (1 + 2^-21)), see EncodePair
  bool small_d;  // every d < 2
};

// Writes the block scales of group `g` and returns in *s what encoding it needs; false, writing
// nothing, if the group holds a non-finite value.
template <FloatType kType>
QUANTD_INLINE bool PrepareGroup(const GroupRef& g, const QuantConstants& k, const Nvfp4Out& dst,
                                ScaledGroup* s) {
  // The hardware prefetchers alone leave part of the memory latency of a long tensor exposed.
  for (int64_t line = 0; line < kGroupElements * kElementSize<kType>; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(g.p) +
                     kPrefetchGroups * kGroupElements * kElementSize<kType> + line,
                 _MM_HINT_T0);
  }
  const __m512i amax = GroupAbsMax<kType>(g.p);
  if (_mm512_cmpge_epu32_mask(amax, Set1(0x7F800000)) != 0) return false;
  __m512 scale;
  const __m512i scale_bytes = BlockScales(amax, k, &scale);
  _mm512_mask_cvtepi32_storeu_epi8(dst.scales + g.block, Mask16(g.n), scale_bytes);
  s->g = g;
  s->d = _mm512_mul_ps(scale, k.scale_2);
  s->r = _mm512_mul_ps(_mm512_div_ps(k.one, s->d), k.recip_up);
  s->small_d = _mm512_cmp_ps_mask(s->d, k.two, _CMP_LT_OQ) == 0xFFFF;
  return true;
}

// formats::Nvfp4Encode of a prepared group (its elements are read again, from cache).
template <FloatType kType>
QUANTD_INLINE void EncodeGroup(const ScaledGroup& s, const QuantConstants& k, const Nvfp4Out& dst) {
  const __m512i pair_lanes = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  __m512i bytes[8];
#pragma GCC unroll 8
  for (int p = 0; p < 8; ++p) {
    __m512 even, odd;
    const bool tiny = LoadPair<kType>(s.g.p + 32 * p * kElementSize<kType>, k, &even, &odd);
    const __m512i lanes = _mm512_add_epi32(pair_lanes, Set1(2 * p));
    bytes[p] = EncodePair(even, odd, tiny, s.small_d, _mm512_permutexvar_ps(lanes, s.r),
                          _mm512_permutexvar_ps(lanes, s.d), k);
  }
  // 8 bytes per block: the first 64 hold blocks 0-7, the next 64 blocks 8-15.
  const int n = s.g.n;
  uint8_t* out = dst.data + s.g.block * kNvfp4BlockSize / 2;
  const __mmask64 all = ~__mmask64{0};
  const __mmask64 first = n >= 8 ? all : (__mmask64{1} << (8 * n)) - 1;
  const __mmask64 second = n >= 16 ? all : n <= 8 ? 0 : (__mmask64{1} << (8 * n - 64)) - 1;
  _mm512_mask_storeu_epi8(out, first, PackPairs(bytes[0], bytes[1], bytes[2], bytes[3]));
  _mm512_mask_storeu_epi8(out + 64, second, PackPairs(bytes[4], bytes[5], bytes[6], bytes[7]));
}

template <FloatType kType>
int64_t Nvfp4QuantizeRange(const DenseTensor& src, float scale_2, const Nvfp4Out& dst,
                           int64_t row_begin, int64_t row_end) {
  const QuantConstants k = MakeQuantConstants(scale_2);
  const int64_t begin = row_begin * src.cols, end = row_end * src.cols;
  const int64_t count = GroupCount(begin, end);
  alignas(64) uint8_t tail[kGroupElements * sizeof(float)];  // only the last group uses it
  ScaledGroup groups[2];
  // Group i + 1 is prepared before group i is encoded, so that the latency of its scales
  // overlaps the encoding work.
  for (int64_t i = 0; i <= count; ++i) {
    const bool ok = i == count || PrepareGroup<kType>(Group<kType>(src.data, begin, end, i, tail),
                                                      k, dst, &groups[i % 2]);
    if (i > 0) EncodeGroup<kType>(groups[(i - 1) % 2], k, dst);
    if (!ok) {
      return reference::Nvfp4QuantizeRows(src, scale_2, dst,
                                          (begin + i * kGroupElements) / src.cols, row_end);
    }
  }
  return -1;
}

int64_t Nvfp4QuantizeRows(const DenseTensor& src, float scale_2, const Nvfp4Out& dst,
                          int64_t row_begin, int64_t row_end) {
  // The exactness arguments above need scale_2 in [2^-100, 2^100]: then every d is normal and
  // finite, and so is RN(1/d). Only all-but-zero (or absurdly large) tensors have another.
  if (!(scale_2 >= 0x1p-100f && scale_2 <= 0x1p100f))
    return reference::Nvfp4QuantizeRows(src, scale_2, dst, row_begin, row_end);
  return src.type == FloatType::kBF16
             ? Nvfp4QuantizeRange<FloatType::kBF16>(src, scale_2, dst, row_begin, row_end)
             : Nvfp4QuantizeRange<FloatType::kF32>(src, scale_2, dst, row_begin, row_end);
}

// ---- NVFP4 decoding ---------------------------------------------------------------------------

// formats::Nvfp4Decode(code, b, scale_2) for every scale byte b and code: row b, entry code, as
// BF16 (RNE) or F32 per `type`.
void BuildDecodeTable(float scale_2, FloatType type, void* table) {
  const __m512 values = E2m1Table();
  for (int b = 0; b < 256; b += 16) {
    const __m512 scales = E4m3ToFloat(_mm512_add_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), Set1(b)));
    for (int j = 0; j < 16; ++j) {
      const __m512 v = _mm512_mul_ps(_mm512_mul_ps(values, _mm512_permutexvar_ps(Set1(j), scales)),
                                     _mm512_set1_ps(scale_2));
      if (type == FloatType::kBF16) {
        _mm256_store_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(table) + 16 * (b + j)),
                           FloatToBf16(v));
      } else {
        _mm512_store_ps(static_cast<float*>(table) + 16 * (b + j), v);
      }
    }
  }
}

// Every output value is one of 16 per scale byte, so each is looked up in a table of them.
void Nvfp4DequantRows(const Nvfp4Tensor& src, const DenseOut& dst, int64_t row_begin,
                      int64_t row_end) {
  const int64_t blocks_per_row = src.cols / kNvfp4BlockSize;
  const int64_t end = row_end * blocks_per_row;
  const uint8_t* scales = src.scales;
  const uint8_t* data = src.data;
  alignas(64) float table[256 * 16];  // BuildDecodeTable's rows: F32, or BF16 in the first half
  BuildDecodeTable(src.scale_2, dst.type, table);
  int64_t b = row_begin * blocks_per_row;
  if (dst.type == FloatType::kBF16) {
    const uint16_t* rows = reinterpret_cast<const uint16_t*>(table);
    uint16_t* out = static_cast<uint16_t*>(dst.data);
    // Two blocks at a time. Word 2j of the index is packed byte j (its low nibble in bits 0-3;
    // bit 4 is ignored, as each row is repeated), word 2j+1 its high nibble.
    for (; b + 2 <= end; b += 2) {
      const __m512i row_a = _mm512_broadcast_i64x4(
          _mm256_load_si256(reinterpret_cast<const __m256i*>(rows + 16 * scales[b])));
      const __m512i row_b = _mm512_broadcast_i64x4(
          _mm256_load_si256(reinterpret_cast<const __m256i*>(rows + 16 * scales[b + 1])));
      const __m512i x = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(data + b * kNvfp4BlockSize / 2)));
      const __m512i index = _mm512_or_si512(x, _mm512_slli_epi32(x, 12));
      const __m512i v = _mm512_mask_permutexvar_epi16(_mm512_permutexvar_epi16(index, row_a),
                                                      0xFFFF0000, index, row_b);
      _mm512_storeu_si512(out + b * kNvfp4BlockSize, v);
    }
    if (b < end) {
      const __m256i row =
          _mm256_load_si256(reinterpret_cast<const __m256i*>(rows + 16 * scales[b]));
      const __m256i x = _mm256_cvtepu8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(data + b * kNvfp4BlockSize / 2)));
      _mm256_storeu_si256(
          reinterpret_cast<__m256i*>(out + b * kNvfp4BlockSize),
          _mm256_permutexvar_epi16(_mm256_or_si256(x, _mm256_slli_epi32(x, 12)), row));
    }
    return;
  }
  float* out = static_cast<float*>(dst.data);
  for (; b < end; ++b) {
    const __m512i codes = _mm512_cvtepu8_epi32(UnpackNibbles8(data + b * kNvfp4BlockSize / 2));
    _mm512_storeu_ps(out + b * kNvfp4BlockSize,
                     _mm512_permutexvar_ps(codes, _mm512_load_ps(table + 16 * scales[b])));
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
