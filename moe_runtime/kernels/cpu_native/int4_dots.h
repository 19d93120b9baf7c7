// Dot products of int4 weight rows with float32 rows, the weights kept packed (moe_runtime/kernels/int4_layout.py:
// byte j of a row holds column 2j in its low nibble and 2j + 1 in its high one, unsigned codes with a float32 scale
// and zero point per group of consecutive columns, the zero point 8 where the format stores none).
//
// Per group: the codes minus the group's zero point, converted to float32 (both exact, as the layout's rule has
// it), are multiplied with x and summed in float32 vector accumulators, and the group's scale multiplies that sum
// once (one FMA a group into the row's lane-wise total, summed across lanes at the row's end). The result is the
// dot with `dequantize_int4`'s float32 weights up to float32 rounding order: the scale multiplies a sum rather
// than each weight. Groups must start on a multiple of 8 columns (group sizes a multiple of 8, or one group for
// the whole row) so 8 columns are 4 whole bytes.
//
// AVX2: codes 8 at a time from one 32-bit word, column c of them at bits 4c of the little-endian word, spread over
// the lanes by a variable shift (load8_int4), or, for 2 to 4 rows, 32 at a time from 16 bytes (load32_int4). A
// build for AVX-512 takes the same AVX2 code (its CPUs have AVX2); plain loops elsewhere. Included by
// expert_mlp.cpp; build.py copies it beside it and hashes it.
#pragma once

#include "weight_dots.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace moe_cpu {

constexpr float kInt4SymmetricZero = 8.f;   // the zero point of a format that stores none (int4_layout.SYMMETRIC_ZERO)

// One int4 weight row: its packed codes and its groups' scales (and zero points).
struct Int4Row {
  const uint8_t* codes;   // ceil(n / 2) bytes
  const float* scales;    // group g: scale at [g * step], its zero point at [g * step + 1] where step is 2
  int64_t group;          // columns per group: a multiple of 8, or n or more (one group)
  int step;               // 1: scales only (zero point 8); 2: (scale, zero point) pairs

  float scale(int64_t g) const { return scales[g * step]; }
  float zero(int64_t g) const { return step == 2 ? scales[g * step + 1] : kInt4SymmetricZero; }
  int code(int64_t k) const { return (codes[k >> 1] >> ((k & 1) * 4)) & 0xF; }
};

#ifdef __AVX2__
// Columns k .. k + 7 (k a multiple of 8) minus the zero point, as float32.
inline __m256 load8_int4(const uint8_t* codes, int64_t k, __m256 zero) {
  uint32_t word;
  std::memcpy(&word, codes + k / 2, sizeof(word));
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i nibbles = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), shifts),
                                           _mm256_set1_epi32(0xF));
  return _mm256_sub_ps(_mm256_cvtepi32_ps(nibbles), zero);
}

// Columns k .. k + 31 (k a multiple of 8) minus the zero point, as float32 in four registers: 16 bytes split into
// their low nibbles (even columns) and high ones (odd columns), interleaved back into column order, widened 8 at a
// time.
inline void load32_int4(const uint8_t* codes, int64_t k, __m256 zero, __m256 (&out)[4]) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k / 2));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i even = _mm_and_si128(bytes, mask), odd = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  const __m128i low = _mm_unpacklo_epi8(even, odd), high = _mm_unpackhi_epi8(even, odd);   // columns 0-15, 16-31
  const __m128i eights[4] = {low, _mm_unpackhi_epi64(low, low), high, _mm_unpackhi_epi64(high, high)};
  for (int q = 0; q < 4; ++q) out[q] = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eights[q])), zero);
}

// The lane-wise sums over columns [k, end) of a group (k advanced past its last multiple of 8) of (code - zero) * x
// for one row: two FMA chains, the codes 8 at a time (measured on the AVX2 dev machine, one row is fastest so; a
// 32-column step, more chains or load32_int4 were 10-45% slower).
inline __m256 int4_group_one(const uint8_t* codes, const float* __restrict x, int64_t& k, int64_t end, __m256 zero) {
  __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
  for (; k + 16 <= end; k += 16) {
    a = _mm256_fmadd_ps(load8_int4(codes, k, zero), _mm256_loadu_ps(x + k), a);
    b = _mm256_fmadd_ps(load8_int4(codes, k + 8, zero), _mm256_loadu_ps(x + k + 8), b);
  }
  if (k + 8 <= end) {
    a = _mm256_fmadd_ps(load8_int4(codes, k, zero), _mm256_loadu_ps(x + k), a);
    k += 8;
  }
  return _mm256_add_ps(a, b);
}

// The same for R rows `stride` apart (2 to 4): 32 codes converted at a time (load32_int4) for all R rows, A FMA
// chains a row (as many as the 16 registers hold beside them; 10-20% faster than int4_group_one's form here).
template <int R>
inline void int4_group_rows(const uint8_t* codes, const float* __restrict x, int64_t stride, int64_t& k, int64_t end,
                            __m256 zero, __m256 (&sums)[R]) {
  constexpr int A = R == 2 ? 4 : 2;
  __m256 a[A][R];
  for (int i = 0; i < A; ++i)
    for (int r = 0; r < R; ++r) a[i][r] = _mm256_setzero_ps();
  for (; k + 32 <= end; k += 32) {
    __m256 weights[4];
    load32_int4(codes, k, zero, weights);
    for (int q = 0; q < 4; ++q)
      for (int r = 0; r < R; ++r)
        a[q % A][r] = _mm256_fmadd_ps(weights[q], _mm256_loadu_ps(x + r * stride + k + 8 * q), a[q % A][r]);
  }
  for (; k + 8 <= end; k += 8) {   // a group's last 8 to 24 columns
    const __m256 weights = load8_int4(codes, k, zero);
    for (int r = 0; r < R; ++r) a[0][r] = _mm256_fmadd_ps(weights, _mm256_loadu_ps(x + r * stride + k), a[0][r]);
  }
  for (int r = 0; r < R; ++r) {
    sums[r] = a[0][r];
    for (int i = 1; i < A; ++i) sums[r] = _mm256_add_ps(sums[r], a[i][r]);
  }
}
#endif

// out[r] = dot(row w, row r of x) for R rows `stride` apart (R <= 4), over n columns: each code is converted once
// for all R rows, each group's sum times its scale added into a lane-wise total.
template <int R>
inline void int4_dot_rows(const Int4Row& w, const float* __restrict x, int64_t n, int64_t stride,
                          float* __restrict out) {
  float acc[R] = {};
#ifdef __AVX2__
  __m256 total[R];   // the groups' scaled sums, lane by lane
  for (int r = 0; r < R; ++r) total[r] = _mm256_setzero_ps();
#endif
  int64_t k0 = 0;
  for (int64_t g = 0; k0 < n; ++g, k0 += w.group) {
    const int64_t end = std::min(n, k0 + w.group);
    const float scale = w.scale(g);
    int64_t k = k0;
#ifdef __AVX2__
    const __m256 zero = _mm256_set1_ps(w.zero(g)), scales = _mm256_set1_ps(scale);
    if constexpr (R == 1) {
      total[0] = _mm256_fmadd_ps(int4_group_one(w.codes, x, k, end, zero), scales, total[0]);
    } else {
      __m256 sums[R];
      int4_group_rows<R>(w.codes, x, stride, k, end, zero, sums);
      for (int r = 0; r < R; ++r) total[r] = _mm256_fmadd_ps(sums[r], scales, total[r]);
    }
#endif
    if (k < end) {   // the columns past the last 8 (of a row's last group), or every column without AVX2
      float part[R] = {};
      for (; k < end; ++k) {
        const float c = static_cast<float>(w.code(k)) - w.zero(g);
        for (int r = 0; r < R; ++r) part[r] += c * x[r * stride + k];
      }
      for (int r = 0; r < R; ++r) acc[r] += part[r] * scale;
    }
  }
#ifdef __AVX2__
  for (int r = 0; r < R; ++r) acc[r] += sum8(total[r]);
#endif
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

// out[r] = the dot of row w with each of `count` rows (1 to 4), the codes converted once for all of them.
inline void int4_dot_some(const Int4Row& w, const float* __restrict x, int64_t n, int64_t stride, int64_t count,
                          float* __restrict out) {
  switch (count) {
    case 4: int4_dot_rows<4>(w, x, n, stride, out); break;
    case 3: int4_dot_rows<3>(w, x, n, stride, out); break;
    case 2: int4_dot_rows<2>(w, x, n, stride, out); break;
    default: int4_dot_rows<1>(w, x, n, stride, out);
  }
}

}  // namespace moe_cpu
