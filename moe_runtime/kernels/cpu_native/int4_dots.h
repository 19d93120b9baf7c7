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
// AVX2: x's columns reordered once (int4_order_columns) so 8 bytes widen to the 8 even columns' codes (low nibbles)
// and the 8 odd ones' (high nibbles) without shuffles (load16_int4); measured on the AVX2 dev machine against codes
// spread in column order by a variable shift (load8_int4, which serves a group's last 8 columns) or by nibble
// interleaving, it is 12-33% faster at one row, up to 30% at two. A build for AVX-512 takes the same AVX2 code (its
// CPUs have AVX2); plain loops elsewhere, on x reordered alike. Included by expert_mlp.cpp; build.py copies it
// beside it and hashes it.
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

// x as the dots read it (`ordered`, n floats from x's n): with AVX2, in each run of 16 columns that a group holds
// whole, its 8 even columns, then its 8 odd ones, the order 8 bytes' low nibbles and then their high nibbles come
// in (load16_int4); the columns after a group's last whole run stay in place, as every column does without AVX2.
// One pass over a row of x serves every weight row it is dotted with.
inline void int4_order_columns(const float* __restrict x, float* __restrict ordered, int64_t n, int64_t group) {
  for (int64_t k0 = 0; k0 < n; k0 += group) {
    const int64_t end = std::min(n, k0 + group);
    int64_t k = k0;
#ifdef __AVX2__
    for (; k + 16 <= end; k += 16) {
      for (int i = 0; i < 8; ++i) {
        ordered[k + i] = x[k + 2 * i];
        ordered[k + 8 + i] = x[k + 2 * i + 1];
      }
    }
#endif
    for (; k < end; ++k) ordered[k] = x[k];
  }
}

#ifdef __AVX2__
// Columns k .. k + 15 (8 bytes, k a multiple of 8) minus the zero point, as float32: the even columns (low nibbles)
// in `even`, the odd ones (high nibbles) in `odd`, as int4_order_columns has ordered x.
inline void load16_int4(const uint8_t* codes, int64_t k, __m256 zero, __m256& even, __m256& odd) {
  const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + k / 2)));
  even = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(0xF))), zero);
  odd = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4)), zero);
}

// Columns k .. k + 7 (4 bytes, k a multiple of 8: a group's last 8 to 15 columns) minus the zero point, as float32
// in column order: column c of them at bits 4c of the little-endian word, spread over the lanes by a variable shift.
inline __m256 load8_int4(const uint8_t* codes, int64_t k, __m256 zero) {
  uint32_t word;
  std::memcpy(&word, codes + k / 2, sizeof(word));
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i nibbles = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), shifts),
                                           _mm256_set1_epi32(0xF));
  return _mm256_sub_ps(_mm256_cvtepi32_ps(nibbles), zero);
}
#endif

// out[r] = dot(row w, row r of x) for R rows `stride` apart (R <= 4) of n columns, x ordered by int4_order_columns:
// each code is converted once for all R rows, two FMA chains a row (even and odd columns), each group's sum times
// its scale added into a lane-wise total.
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
    const __m256 zero = _mm256_set1_ps(w.zero(g));
    __m256 a[R], b[R];
    for (int r = 0; r < R; ++r) a[r] = b[r] = _mm256_setzero_ps();
    for (; k + 16 <= end; k += 16) {
      __m256 even, odd;
      load16_int4(w.codes, k, zero, even, odd);
      for (int r = 0; r < R; ++r) {
        a[r] = _mm256_fmadd_ps(even, _mm256_loadu_ps(x + r * stride + k), a[r]);
        b[r] = _mm256_fmadd_ps(odd, _mm256_loadu_ps(x + r * stride + k + 8), b[r]);
      }
    }
    if (k + 8 <= end) {
      const __m256 weights = load8_int4(w.codes, k, zero);
      for (int r = 0; r < R; ++r) a[r] = _mm256_fmadd_ps(weights, _mm256_loadu_ps(x + r * stride + k), a[r]);
      k += 8;
    }
    const __m256 scales = _mm256_set1_ps(scale);
    for (int r = 0; r < R; ++r) total[r] = _mm256_fmadd_ps(_mm256_add_ps(a[r], b[r]), scales, total[r]);
#endif
    if (k < end) {   // the columns past the last 8 (of a row's last group), in place; every column without AVX2
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
