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
// AVX2: 8 columns from one 32-bit word, column c of them at bits 4c of the little-endian word, spread over the
// lanes by a variable shift (vpsrlvd). A build for AVX-512 takes the same AVX2 code (its CPUs have AVX2); plain
// loops elsewhere. Included by expert_mlp.cpp; build.py copies it beside it and hashes it.
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
#endif

// out[r] = dot(row w, row r of x) for R rows `stride` apart (R <= 4), over n columns: each 8 codes are converted
// once for all R rows; two accumulators a row keep the FMAs pipelined.
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
      const __m256 w0 = load8_int4(w.codes, k, zero), w1 = load8_int4(w.codes, k + 8, zero);
      for (int r = 0; r < R; ++r) {
        a[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * stride + k), a[r]);
        b[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * stride + k + 8), b[r]);
      }
    }
    if (k + 8 <= end) {
      const __m256 w0 = load8_int4(w.codes, k, zero);
      for (int r = 0; r < R; ++r) a[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * stride + k), a[r]);
      k += 8;
    }
    const __m256 scales = _mm256_set1_ps(scale);
    for (int r = 0; r < R; ++r) total[r] = _mm256_fmadd_ps(_mm256_add_ps(a[r], b[r]), scales, total[r]);
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
