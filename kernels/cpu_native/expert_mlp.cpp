// Routed experts of a decode step on the CPU, as llama.cpp's mul_mat_id runs them: each busy expert's weights
// are streamed once for all the rows that chose it (gate/up rows dotted with every row of its segment while they
// are in cache, then the down rows), SwiGLU fused between the two, float32 accumulation. Weights are float32 or
// bfloat16 (widened in registers); activations float32 or bfloat16 (widened once per segment). Threads split
// the experts' output rows (at::parallel_for), so one busy expert still uses every core.
//
// The dot products are AVX2 + FMA intrinsics where the CPU has them (built with -march=native for the machine it
// runs on), plain loops the compiler vectorises elsewhere; the kernel is compiled on first use into a cache
// (kernels/cpu_native/build.py). An AVX-512 / AMX path is not written yet.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#include <cstdint>
#include <cstring>
#include <vector>

namespace {


inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

#ifdef __AVX2__
// 8 weights as float32: loaded, or bfloat16 widened (its 16 bits become a float32's high half)
inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const c10::BFloat16* w) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

inline float sum8(__m256 v) {
  const __m128 halves = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 0x1)));
}
#endif

// One row: dot(w_row, x) over n, along n (four vector accumulators: the FMAs pipeline).
template <typename W>
inline float dot_one(const W* __restrict w_row, const float* __restrict x, int64_t n) {
  int64_t k = 0;
  float acc = 0.f;
#ifdef __AVX2__
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

// Four rows (contiguous, `n` apart): out[r] = dot(w_row, row r), along n; each 8 weights are loaded once for the
// four rows, whose four accumulators keep the FMAs pipelined.
template <typename W>
inline void dot_four(const W* __restrict w_row, const float* __restrict x, int64_t n, float* __restrict out) {
  int64_t k = 0;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
#ifdef __AVX2__
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  for (; k + 8 <= n; k += 8) {
    const __m256 w = load8(w_row + k);
    a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + k), a0);
    a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + n + k), a1);
    a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + 2 * n + k), a2);
    a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + 3 * n + k), a3);
  }
  acc[0] = sum8(a0), acc[1] = sum8(a1), acc[2] = sum8(a2), acc[3] = sum8(a3);
#endif
  for (; k < n; ++k) {
    const float w = widen(w_row[k]);
    for (int64_t r = 0; r < 4; ++r) acc[r] += w * x[r * n + k];
  }
  for (int64_t r = 0; r < 4; ++r) out[r] = acc[r];
}

// The rows of every busy expert as float32, row-major; `at[b]`: where busy expert b's rows start.
struct Activations {
  std::vector<float> data;
  std::vector<int64_t> at;
  int64_t width;             // floats per row

  template <typename X>
  static Activations pack(const X* x, const int64_t* row_start, const int64_t* counts, const int64_t* busy,
                          int64_t num_busy, int64_t width) {   // row_start[b]: busy expert b's first row in x
    Activations a{{}, std::vector<int64_t>(num_busy), width};
    int64_t rows = 0;
    for (int64_t b = 0; b < num_busy; ++b) {
      a.at[b] = rows * width;
      rows += counts[busy[b]];
    }
    a.data.resize(rows * width);
    for (int64_t b = 0; b < num_busy; ++b) {
      const X* src = x + row_start[b] * width;
      float* dst = a.data.data() + a.at[b];
      for (int64_t k = 0; k < counts[busy[b]] * width; ++k) dst[k] = widen(src[k]);
    }
    return a;
  }
};

// results[row of the expert][j] = dot(weights[e][j], row) for every busy expert's rows, j < outputs;
// tasks are (expert, output) pairs split over the threads.
template <typename W, typename Store>
void project(const Activations& a, const int64_t* counts, const int64_t* busy, int64_t num_busy, const W* weights,
             int64_t outputs, Store store) {
  const int64_t n = a.width;
  at::parallel_for(0, num_busy * outputs, 16, [&](int64_t begin, int64_t end) {
    float block[4];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / outputs, j = task % outputs, e = busy[b], c = counts[e];
      const W* w_row = weights + (e * outputs + j) * n;
      const float* rows = a.data.data() + a.at[b];
      int64_t r = 0;
      for (; r + 4 <= c; r += 4) {
        dot_four(w_row, rows + r * n, n, block);
        for (int64_t q = 0; q < 4; ++q) store(b, r + q, j, block[q]);
      }
      for (; r < c; ++r) store(b, r, j, dot_one(w_row, rows + r * n, n));
    }
  });
}

template <typename W, typename X>
void run_experts(const X* x, const int64_t* starts, const int64_t* counts, const int64_t* busy, int64_t num_busy,
                 const W* w13, const W* w2, X* out, int64_t hidden, int64_t inter) {
  std::vector<int64_t> first(num_busy + 1, 0);   // each busy expert's first row among all busy rows
  for (int64_t b = 0; b < num_busy; ++b) first[b + 1] = first[b] + counts[busy[b]];
  std::vector<int64_t> x_start(num_busy);
  for (int64_t b = 0; b < num_busy; ++b) x_start[b] = starts[busy[b]];
  const Activations xs = Activations::pack(x, x_start.data(), counts, busy, num_busy, hidden);
  std::vector<float> gate_up(first[num_busy] * 2 * inter);
  project(xs, counts, busy, num_busy, w13, 2 * inter,
          [&](int64_t b, int64_t r, int64_t j, float v) { gate_up[(first[b] + r) * 2 * inter + j] = v; });
  std::vector<float> act(first[num_busy] * inter);
  for (int64_t row = 0; row < first[num_busy]; ++row) {
    const float* g = gate_up.data() + row * 2 * inter;
    for (int64_t i = 0; i < inter; ++i) act[row * inter + i] = g[i] / (1.f + std::exp(-g[i])) * g[inter + i];
  }
  // the activations packed as the gate/up inputs were (float32 already)
  const Activations acts = Activations::pack(act.data(), first.data(), counts, busy, num_busy, inter);
  project(acts, counts, busy, num_busy, w2, hidden, [&](int64_t b, int64_t r, int64_t h, float v) {
    out[(starts[busy[b]] + r) * hidden + h] = static_cast<X>(v);
  });
}

// x_sorted [N, H] grouped by expert, counts [E] int64 (on the host), w13 [E, 2I, H], w2 [E, H, I] -> [N, H]
torch::Tensor silu_expert_mlp(torch::Tensor x_sorted, torch::Tensor counts, torch::Tensor w13, torch::Tensor w2) {
  TORCH_CHECK(x_sorted.dim() == 2 && w13.dim() == 3 && w2.dim() == 3, "expert_mlp: x [N, H], w13 [E, 2I, H], w2 [E, H, I]");
  TORCH_CHECK(x_sorted.is_contiguous() && w13.is_contiguous() && w2.is_contiguous(), "expert_mlp: contiguous tensors");
  TORCH_CHECK(counts.scalar_type() == torch::kInt64 && counts.is_contiguous(), "expert_mlp: counts int64");
  TORCH_CHECK(w13.scalar_type() == w2.scalar_type(), "expert_mlp: w13 and w2 of one dtype");
  const int64_t num_experts = w13.size(0), hidden = x_sorted.size(1), inter = w2.size(2);
  TORCH_CHECK(w13.size(1) == 2 * inter && w13.size(2) == hidden && w2.size(1) == hidden, "expert_mlp: shapes");
  auto out = torch::empty_like(x_sorted);
  const int64_t* count = counts.data_ptr<int64_t>();
  std::vector<int64_t> starts(num_experts), busy;
  int64_t start = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    starts[e] = start;
    start += count[e];
    if (count[e] > 0) busy.push_back(e);
  }
  TORCH_CHECK(start == x_sorted.size(0), "expert_mlp: counts sum to ", start, ", x has ", x_sorted.size(0), " rows");
  const auto wt = w13.scalar_type(), xt = x_sorted.scalar_type();
  TORCH_CHECK(wt == torch::kFloat32 || wt == torch::kBFloat16, "expert_mlp: float32 or bfloat16 weights");
  TORCH_CHECK(xt == torch::kFloat32 || xt == torch::kBFloat16, "expert_mlp: float32 or bfloat16 activations");
  const int64_t nb = static_cast<int64_t>(busy.size());
#define RUN(W, X)                                                                                      \
  run_experts<W, X>(x_sorted.data_ptr<X>(), starts.data(), count, busy.data(), nb, w13.data_ptr<W>(), \
                    w2.data_ptr<W>(), out.data_ptr<X>(), hidden, inter)
  if (wt == torch::kFloat32 && xt == torch::kFloat32) RUN(float, float);
  else if (wt == torch::kBFloat16 && xt == torch::kBFloat16) RUN(c10::BFloat16, c10::BFloat16);
  else if (wt == torch::kBFloat16 && xt == torch::kFloat32) RUN(c10::BFloat16, float);
  else RUN(float, c10::BFloat16);
#undef RUN
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("silu_expert_mlp", &silu_expert_mlp, "routed SwiGLU experts over rows grouped by expert (see the file's top)");
}
