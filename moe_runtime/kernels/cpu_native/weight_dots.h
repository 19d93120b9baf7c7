// Weights of every format the CPU kernels take, as float32 and in dot products with float32 rows. Loads: one at a
// time (widen), 8 in an AVX2 register (load8) or 16 in an AVX-512 one (load16): float32 loaded, bfloat16 widened
// (its 16 bits become a float32's high half), int8 codes converted (the row's scale multiplies the dot product),
// FP8 e4m3fn codes decoded exactly (below). Dots: one row along four accumulators (dot_one), 2 to 4 rows per
// weight load (dot_rows, dot_some). No torch headers beyond c10's number types, so build.py can compile this
// alone for another CPU (compile_errors). Included by expert_mlp.cpp; build.py copies it beside it and hashes both.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cstdint>
#include <cstring>

namespace moe_cpu {

inline float widen(float v) { return v; }
inline float widen(int8_t v) { return static_cast<float>(v); }
inline float widen(c10::Float8_e4m3fn v) { return static_cast<float>(v); }
inline float widen(c10::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

#ifdef __AVX2__
inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const int8_t* w) {   // int8 codes as float32 (the row's scale multiplies the dot product)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}
inline __m256 load8(const c10::BFloat16* w) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// 8 FP8 e4m3fn codes as float32: the 7 payload bits of a byte moved to the top of a float32 word (its sign to the
// sign bit) are the value times 2^-120, subnormals included, so a sign-extending widen, a shift, a mask and a
// multiply by 2^120 decode them exactly (NaN codes, which checkpoints do not hold, would read as +-480).
inline __m256 load8(const c10::Float8_e4m3fn* w) {
  const __m256i codes = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w)));
  const __m256i bits = _mm256_and_si256(_mm256_slli_epi32(codes, 20), _mm256_set1_epi32(static_cast<int>(0x87F00000u)));
  return _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p120f));
}

// FP8's subnormal codes decode to float32 subnormals (times 2^120): a thread flushing denormals (FTZ / DAZ, e.g.
// torch.set_flush_denormal) would read them as zero, so the kernel's threads keep denormals while they run it.
class DenormalsKept {
 public:
  DenormalsKept() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ & ~(kFlushToZero | kDenormalsAreZero)); }
  ~DenormalsKept() { _mm_setcsr(saved_); }

 private:
  static constexpr unsigned kFlushToZero = 0x8000, kDenormalsAreZero = 0x0040;
  unsigned saved_;
};

inline float sum8(__m256 v) {
  const __m128 halves = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 0x1)));
}
#endif

#ifdef __AVX512F__
// 16 weights as float32, as load8 does with 8 (the same widening and FP8 decode, one 512-bit register).
inline __m512 load16(const float* w) { return _mm512_loadu_ps(w); }
inline __m512 load16(const int8_t* w) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}
inline __m512 load16(const c10::BFloat16* w) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const c10::Float8_e4m3fn* w) {
  const __m512i codes = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  const __m512i bits = _mm512_and_si512(_mm512_slli_epi32(codes, 20), _mm512_set1_epi32(static_cast<int>(0x87F00000u)));
  return _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f));
}
#endif

// One row: dot(w_row, x) over n, along n (four vector accumulators: the FMAs pipeline). With AVX-512 (a build on a
// CPU that has it: -march=native) 16 lanes a register, else AVX2's 8, then the scalar tail.
template <typename W>
inline float dot_one(const W* __restrict w_row, const float* __restrict x, int64_t n) {
  int64_t k = 0;
  float acc = 0.f;
#if defined(__AVX512F__)
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
  for (; k + 64 <= n; k += 64) {
    a0 = _mm512_fmadd_ps(load16(w_row + k), _mm512_loadu_ps(x + k), a0);
    a1 = _mm512_fmadd_ps(load16(w_row + k + 16), _mm512_loadu_ps(x + k + 16), a1);
    a2 = _mm512_fmadd_ps(load16(w_row + k + 32), _mm512_loadu_ps(x + k + 32), a2);
    a3 = _mm512_fmadd_ps(load16(w_row + k + 48), _mm512_loadu_ps(x + k + 48), a3);
  }
  for (; k + 16 <= n; k += 16) a0 = _mm512_fmadd_ps(load16(w_row + k), _mm512_loadu_ps(x + k), a0);
  acc = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#elif defined(__AVX2__)
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  for (; k + 32 <= n; k += 32) {
    a0 = _mm256_fmadd_ps(load8(w_row + k), _mm256_loadu_ps(x + k), a0);
    a1 = _mm256_fmadd_ps(load8(w_row + k + 8), _mm256_loadu_ps(x + k + 8), a1);
    a2 = _mm256_fmadd_ps(load8(w_row + k + 16), _mm256_loadu_ps(x + k + 16), a2);
    a3 = _mm256_fmadd_ps(load8(w_row + k + 24), _mm256_loadu_ps(x + k + 24), a3);
  }
  for (; k + 8 <= n; k += 8) a0 = _mm256_fmadd_ps(load8(w_row + k), _mm256_loadu_ps(x + k), a0);
  acc = sum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
  for (; k < n; ++k) acc += widen(w_row[k]) * x[k];
  return acc;
}

// R rows (`stride` apart, R <= 4): out[r] = dot(w_row, row r), along n; each vector of weights is loaded (and
// widened or decoded) once for all R rows, whose R accumulators keep the FMAs pipelined. A step's experts often
// hold 2 or 3 rows: they take R = 2, 3 rather than converting the same weights once per row.
template <int R, typename W>
inline void dot_rows(const W* __restrict w_row, const float* __restrict x, int64_t n, int64_t stride,
                     float* __restrict out) {
  int64_t k = 0;
  float acc[R] = {};
#if defined(__AVX512F__)
  __m512 a[R];
  for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
  for (; k + 16 <= n; k += 16) {
    const __m512 w = load16(w_row + k);
    for (int r = 0; r < R; ++r) a[r] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + r * stride + k), a[r]);
  }
  for (int r = 0; r < R; ++r) acc[r] = _mm512_reduce_add_ps(a[r]);
#elif defined(__AVX2__)
  __m256 a[R];
  for (int r = 0; r < R; ++r) a[r] = _mm256_setzero_ps();
  for (; k + 8 <= n; k += 8) {
    const __m256 w = load8(w_row + k);
    for (int r = 0; r < R; ++r) a[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + r * stride + k), a[r]);
  }
  for (int r = 0; r < R; ++r) acc[r] = sum8(a[r]);
#endif
  for (; k < n; ++k) {
    const float w = widen(w_row[k]);
    for (int r = 0; r < R; ++r) acc[r] += w * x[r * stride + k];
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

// out[r] = the dot of w_row with each of `count` rows (1 to 4): one row alone along four accumulators (dot_one),
// more with the weights converted once (dot_rows).
template <typename W>
inline void dot_some(const W* __restrict w_row, const float* __restrict x, int64_t n, int64_t stride, int64_t count,
                     float* __restrict out) {
  switch (count) {
    case 4: dot_rows<4>(w_row, x, n, stride, out); break;
    case 3: dot_rows<3>(w_row, x, n, stride, out); break;
    case 2: dot_rows<2>(w_row, x, n, stride, out); break;
    default: out[0] = dot_one(w_row, x, n);
  }
}

}  // namespace moe_cpu
