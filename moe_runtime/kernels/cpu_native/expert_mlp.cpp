// Routed experts of a decode step on the CPU, as llama.cpp's mul_mat_id runs them: each busy expert's weights
// are streamed once for all the rows that chose it (gate/up rows dotted with every row of its segment while they
// are in cache, then the down rows), SwiGLU fused between the two, float32 accumulation. Weights are float32,
// bfloat16 (widened in registers), int8 with a float32 scale per row, or FP8 (e4m3fn) with a float32 scale per row
// and block of block_k columns (DeepSeek's block-scaled layout, row-expanded: kernels/fp8_block_weights.py); the
// codes are converted in registers and each scale multiplies its block's partial dot product; or int4 kept packed
// (two codes a byte, a float32 scale and zero point per group of columns: int4_dots.h). Activations float32
// or bfloat16 (widened once per segment). Threads split
// the experts' output rows (at::parallel_for), so one busy expert still uses every core. Two layouts: rows already
// grouped by expert (silu_expert_mlp, the eager step's) and the router's (token, expert) pairs grouped here
// (routed_expert_mlp, fixed shapes: a captured step calls it as one operator, kernels/cpu_native/custom_ops.py).
// rows_linear is the same streaming for one weight: the decode projections. The Python entry points
// release the GIL: with --cpu-experts the kernel runs on its own thread while the caller's thread goes on
// (moe_runtime/moe/host_experts.py).
//
// The dot products are AVX2 + FMA intrinsics where the CPU has them (built with -march=native for the machine it
// runs on), AVX-512F intrinsics (16 lanes) where the build's CPU has them, plain loops the compiler vectorises
// elsewhere; the kernel is compiled on first use for the CPU it runs on (kernels/cpu_native/build.py:
// -march=native), which is how the path is chosen. The AVX-512 path is compiled by the tests on every machine but
// runs only on one with the unit (the dev machine has AVX2 only); no AMX path (tile GEMMs pay off at larger row
// counts than a decode step's).
#include <ATen/ATen.h>
#include <torch/library.h>
#include <torch/python.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "int4_dots.h"
#include "weight_dots.h"

namespace {

using moe_cpu::dot_some;
using moe_cpu::widen;
#ifdef __AVX2__
using moe_cpu::DenormalsKept;
#endif


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

  // Busy expert b's rows are x's rows tokens[first[b] .. first[b + 1]) (a token once per expert that chose it).
  template <typename X>
  static Activations gather(const X* x, const std::vector<int64_t>& tokens, const std::vector<int64_t>& first,
                            int64_t width) {
    Activations a{std::vector<float>(tokens.size() * width), std::vector<int64_t>(first.size() - 1), width};
    for (size_t b = 0; b + 1 < first.size(); ++b) a.at[b] = first[b] * width;
    for (size_t row = 0; row < tokens.size(); ++row) {
      const X* src = x + tokens[row] * width;
      float* dst = a.data.data() + row * width;
      for (int64_t k = 0; k < width; ++k) dst[k] = widen(src[k]);
    }
    return a;
  }
};

// The float32 scales of a quantized weight [E, N, K]: scale[e][j][k / block_k] multiplies the dot product of
// row j's columns in that block (int8: one block of all K columns; FP8: DeepSeek's 128-column blocks). None for
// float32 / bfloat16 weights.
struct RowScales {
  const float* data = nullptr;   // [E, N, blocks]
  int64_t blocks = 1;            // per row: ceil(K / block_k)
  int64_t block_k = 0;           // columns per block (0: all K)

  int64_t columns(int64_t k) const { return block_k > 0 ? block_k : k; }
};

// A stack of float32 / bfloat16 / int8 / FP8 weights [E, N, K] (row e * N + j: expert e's output j) and, quantized,
// their scales: each column block's partial dot times its scale.
template <typename W>
struct DenseStack {
  const W* data;
  RowScales scales;

  // out[q] = dot(weight row `row`, row q of x) for `count` rows (1 to 4) of n columns, n apart.
  void dots(int64_t row, const float* x, int64_t n, int64_t count, float* out) const {
    const int64_t block = scales.columns(n);
    const W* w_row = data + row * n;
    const float* row_scales = scales.data != nullptr ? scales.data + row * scales.blocks : nullptr;
    float part[4];
    for (int64_t q = 0; q < count; ++q) out[q] = 0.f;
    for (int64_t k0 = 0, blk = 0; k0 < n; k0 += block, ++blk) {
      dot_some(w_row + k0, x + k0, std::min(block, n - k0), n, count, part);
      const float scale = row_scales != nullptr ? row_scales[blk] : 1.f;
      for (int64_t q = 0; q < count; ++q) out[q] += part[q] * scale;
    }
  }
};

// A stack of int4 weights kept packed, uint8 [E, N, ceil(K / 2)], with their groups' float32 scales [E, N, G] or
// (scale, zero point) pairs [E, N, G, 2] (moe_runtime/kernels/int4_layout.py; the dots in int4_dots.h).
struct Int4Stack {
  const uint8_t* values;
  const float* scales;
  int64_t groups;   // per row
  int64_t group;    // columns per group (a multiple of 8, or K: one group a row)
  int step;         // floats per group: 1 (zero point 8) or 2 (with its zero point)

  // The rows of x with their columns in the order the dots read them (moe_cpu::int4_order_columns).
  Activations ordered(const Activations& a) const {
    Activations out{std::vector<float>(a.data.size()), a.at, a.width};
    for (size_t at = 0; at < a.data.size(); at += a.width)
      moe_cpu::int4_order_columns(a.data.data() + at, out.data.data() + at, a.width, group);
    return out;
  }

  void dots(int64_t row, const float* x, int64_t n, int64_t count, float* out) const {   // x: ordered rows
    const moe_cpu::Int4Row w{values + row * ((n + 1) / 2), scales + row * groups * step, group, step};
    moe_cpu::int4_dot_some(w, x, n, n, count, out);
  }
};

// The rows as a stack's dots read them: as they are, or for int4 weights reordered (a copy the size of x).
template <typename W>
const Activations& rows_for(const DenseStack<W>&, const Activations& a, Activations&) { return a; }
inline const Activations& rows_for(const Int4Stack& weights, const Activations& a, Activations& scratch) {
  scratch = weights.ordered(a);
  return scratch;
}

// results[row of the expert][j] = dot(weights[e][j], row) for every busy expert's rows, j < outputs; tasks are
// (expert, output) pairs split over the threads.
template <typename Stack, typename Store>
void project(const Activations& a, const int64_t* counts, const int64_t* busy, int64_t num_busy, const Stack& weights,
             int64_t outputs, Store store) {
  const int64_t n = a.width;
  Activations scratch{};
  const Activations& read = rows_for(weights, a, scratch);
  at::parallel_for(0, num_busy * outputs, 16, [&](int64_t begin, int64_t end) {
#ifdef __AVX2__
    const DenormalsKept denormals;
#endif
    float acc[4];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / outputs, j = task % outputs, e = busy[b], c = counts[e];
      const float* rows = read.data.data() + read.at[b];
      for (int64_t r = 0; r < c; r += 4) {   // four rows at a time, the last 1 to 4 together
        const int64_t count = std::min<int64_t>(4, c - r);
        weights.dots(e * outputs + j, rows + r * n, n, count, acc);
        for (int64_t q = 0; q < count; ++q) store(b, r + q, j, acc[q]);
      }
    }
  });
}

// Gate/up, SwiGLU and down of every busy expert over its packed rows: store(b, r, h, v) receives row r of busy
// expert b's output h (float32, unweighted).
template <typename Stack, typename Store>
void experts_over(const Activations& xs, const int64_t* counts, const int64_t* busy, int64_t num_busy,
                  const Stack& w13, const Stack& w2, int64_t hidden, int64_t inter, Store store) {
  std::vector<int64_t> first(num_busy + 1, 0);   // each busy expert's first row among all busy rows
  for (int64_t b = 0; b < num_busy; ++b) first[b + 1] = first[b] + counts[busy[b]];
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
  project(acts, counts, busy, num_busy, w2, hidden, store);
}

// Rows of busy expert b at x's rows starts[busy[b]] .., its outputs at the same rows of out (the grouped layout's
// segments, or the masked layout's [E, M, H] with starts[e] = e * M).
template <typename Stack, typename X>
void run_experts(const X* x, const int64_t* starts, const int64_t* counts, const int64_t* busy, int64_t num_busy,
                 const Stack& w13, const Stack& w2, X* out, int64_t hidden, int64_t inter) {
  std::vector<int64_t> x_start(num_busy);
  for (int64_t b = 0; b < num_busy; ++b) x_start[b] = starts[busy[b]];
  const Activations xs = Activations::pack(x, x_start.data(), counts, busy, num_busy, hidden);
  experts_over(xs, counts, busy, num_busy, w13, w2, hidden, inter,
               [&](int64_t b, int64_t r, int64_t h, float v) {
                 out[(starts[busy[b]] + r) * hidden + h] = static_cast<X>(v);
               });
}

// The (token, expert) pairs of a step grouped by expert (a counting sort, pairs of one expert in token order):
// busy experts, their pairs' tokens and where each busy expert's pairs start.
struct PairGroups {
  std::vector<int64_t> counts, busy, first, tokens, pair_row;   // pair_row[t * K + k]: its row among the grouped

  static PairGroups of(const int64_t* slot_ids, int64_t num_tokens, int64_t top_k, int64_t num_experts) {
    PairGroups g{std::vector<int64_t>(num_experts, 0), {}, {0}, std::vector<int64_t>(num_tokens * top_k),
                 std::vector<int64_t>(num_tokens * top_k)};
    for (int64_t p = 0; p < num_tokens * top_k; ++p) {
      TORCH_CHECK(slot_ids[p] >= 0 && slot_ids[p] < num_experts, "routed_expert_mlp: slot ", slot_ids[p],
                  " is not one of the ", num_experts, " experts");
      ++g.counts[slot_ids[p]];
    }
    std::vector<int64_t> next(num_experts, 0);
    for (int64_t e = 0; e < num_experts; ++e) {
      if (g.counts[e] == 0) continue;
      next[e] = g.first.back();
      g.busy.push_back(e);
      g.first.push_back(g.first.back() + g.counts[e]);
    }
    for (int64_t p = 0; p < num_tokens * top_k; ++p) {
      const int64_t row = next[slot_ids[p]]++;
      g.tokens[row] = p / top_k;
      g.pair_row[p] = row;
    }
    return g;
  }
};

template <typename Stack, typename X>
void run_routed(const X* x, const PairGroups& g, const float* pair_weights, int64_t num_tokens, int64_t top_k,
                const Stack& w13, const Stack& w2, X* out, int64_t hidden, int64_t inter) {
  const int64_t nb = static_cast<int64_t>(g.busy.size());
  const Activations xs = Activations::gather(x, g.tokens, g.first, hidden);
  std::vector<float> down(g.tokens.size() * hidden);   // [P, H] by grouped row
  experts_over(xs, g.counts.data(), g.busy.data(), nb, w13, w2, hidden, inter,
               [&](int64_t b, int64_t r, int64_t h, float v) { down[(g.first[b] + r) * hidden + h] = v; });
  at::parallel_for(0, num_tokens, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sum(hidden);
    for (int64_t t = begin; t < end; ++t) {   // the weighted sum over the token's K experts, in float32
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t k = 0; k < top_k; ++k) {
        const float w = pair_weights[t * top_k + k];
        const float* row = down.data() + g.pair_row[t * top_k + k] * hidden;
        for (int64_t h = 0; h < hidden; ++h) sum[h] += w * row[h];
      }
      for (int64_t h = 0; h < hidden; ++h) out[t * hidden + h] = static_cast<X>(sum[h]);
    }
  });
}

struct Segments {
  std::vector<int64_t> starts, busy;
};

Segments segments_of(const torch::Tensor& counts, int64_t rows) {
  TORCH_CHECK(counts.scalar_type() == torch::kInt64 && counts.is_contiguous(), "expert_mlp: counts int64");
  const int64_t* count = counts.data_ptr<int64_t>();
  Segments s{std::vector<int64_t>(counts.numel()), {}};
  int64_t start = 0;
  for (int64_t e = 0; e < counts.numel(); ++e) {
    TORCH_CHECK(count[e] >= 0, "expert_mlp: counts[", e, "] = ", count[e], " is negative");
    s.starts[e] = start;
    start += count[e];
    if (count[e] > 0) s.busy.push_back(e);
  }
  TORCH_CHECK(start == rows, "expert_mlp: counts sum to ", start, ", x has ", rows, " rows");
  return s;
}

// A quantized weight's scales [E, N, ceil(K / block_k)] (int8: [E, N], block_k 0) checked against it.
RowScales scales_of(const c10::optional<torch::Tensor>& scale, bool quantized, bool fp8, int64_t block_k,
                    int64_t experts, int64_t outputs, int64_t columns, const char* name) {
  TORCH_CHECK(quantized == scale.has_value(), name, ": scales exactly with int8 / FP8 weights");
  if (!quantized) return RowScales{};
  TORCH_CHECK(fp8 ? block_k > 0 : block_k == 0, name, ": block_k > 0 exactly with FP8 weights (int8: one scale a row)");
  const int64_t blocks = fp8 ? (columns + block_k - 1) / block_k : 1;
  TORCH_CHECK(scale->scalar_type() == torch::kFloat32 && scale->is_contiguous() &&
              scale->numel() == experts * outputs * blocks, name, ": float32 scales, ", blocks, " per row of ",
              outputs, " rows x ", experts);
  return RowScales{scale->data_ptr<float>(), blocks, block_k};
}

bool is_fp8(const torch::Tensor& w) { return w.scalar_type() == torch::kFloat8_e4m3fn; }
bool is_quantized(const torch::Tensor& w) { return w.scalar_type() == torch::kInt8 || is_fp8(w); }

// The expert stacks' shapes, dtypes and (int8 / FP8 weights) scales, checked once for both layouts.
struct ExpertStacks {
  int64_t num_experts, hidden, inter;
  RowScales s13, s2;   // int8: [E, 2I] and [E, H]; FP8: [E, 2I, ceil(H / bk)] and [E, H, ceil(I / bk)]

  static ExpertStacks of(const torch::Tensor& x, const torch::Tensor& w13, const torch::Tensor& w2,
                         const c10::optional<torch::Tensor>& w13_scale, const c10::optional<torch::Tensor>& w2_scale,
                         int64_t block_k) {
    TORCH_CHECK(x.dim() == 2 && w13.dim() == 3 && w2.dim() == 3, "expert_mlp: x [N, H], w13 [E, 2I, H], w2 [E, H, I]");
    TORCH_CHECK(x.is_contiguous() && w13.is_contiguous() && w2.is_contiguous(), "expert_mlp: contiguous tensors");
    TORCH_CHECK(w13.scalar_type() == w2.scalar_type(), "expert_mlp: w13 and w2 of one dtype");
    ExpertStacks s{w13.size(0), x.size(1), w2.size(2)};
    TORCH_CHECK(w13.size(1) == 2 * s.inter && w13.size(2) == s.hidden && w2.size(1) == s.hidden &&
                w2.size(0) == s.num_experts, "expert_mlp: shapes");
    const auto wt = w13.scalar_type(), xt = x.scalar_type();
    TORCH_CHECK(wt == torch::kFloat32 || wt == torch::kBFloat16 || is_quantized(w13),
                "expert_mlp: float32, bfloat16, int8 or float8_e4m3fn weights");
    TORCH_CHECK(xt == torch::kFloat32 || xt == torch::kBFloat16, "expert_mlp: float32 or bfloat16 activations");
    s.s13 = scales_of(w13_scale, is_quantized(w13), is_fp8(w13), block_k, s.num_experts, 2 * s.inter, s.hidden,
                      "expert_mlp w13");
    s.s2 = scales_of(w2_scale, is_quantized(w2), is_fp8(w2), block_k, s.num_experts, s.hidden, s.inter,
                     "expert_mlp w2");
    return s;
  }
};

// Calls RUN(W, X) with the weight and activation element types of w13 and x.
#define DISPATCH_WEIGHTS_AND_ROWS(w13, x)                                        \
  {                                                                              \
    const bool x32 = (x).scalar_type() == torch::kFloat32;                       \
    if ((w13).scalar_type() == torch::kInt8) {                                   \
      if (x32) RUN(int8_t, float) else RUN(int8_t, c10::BFloat16)                \
    } else if ((w13).scalar_type() == torch::kFloat8_e4m3fn) {                   \
      if (x32) RUN(c10::Float8_e4m3fn, float)                                    \
      else RUN(c10::Float8_e4m3fn, c10::BFloat16)                                \
    } else if ((w13).scalar_type() == torch::kFloat32) {                         \
      if (x32) RUN(float, float) else RUN(float, c10::BFloat16)                  \
    } else {                                                                     \
      if (x32) RUN(c10::BFloat16, float) else RUN(c10::BFloat16, c10::BFloat16)  \
    }                                                                            \
  }

// x_sorted [N, H] grouped by expert, counts [E] int64 (on the host), w13 [E, 2I, H], w2 [E, H, I] -> [N, H];
// int8 weights come with their rows' float32 scales (w13_scale [E, 2I], w2_scale [E, H]), FP8 weights with their
// row-expanded block scales (w13_scale [E, 2I, ceil(H / block_k)], w2_scale [E, H, ceil(I / block_k)]).
torch::Tensor silu_expert_mlp(torch::Tensor x_sorted, torch::Tensor counts, torch::Tensor w13, torch::Tensor w2,
                              c10::optional<torch::Tensor> w13_scale, c10::optional<torch::Tensor> w2_scale,
                              int64_t block_k) {
  const ExpertStacks st = ExpertStacks::of(x_sorted, w13, w2, w13_scale, w2_scale, block_k);
  TORCH_CHECK(counts.numel() == st.num_experts, "expert_mlp: one count per expert");
  const Segments seg = segments_of(counts, x_sorted.size(0));
  auto out = torch::empty_like(x_sorted);
  const int64_t nb = static_cast<int64_t>(seg.busy.size());
  const int64_t* count = counts.data_ptr<int64_t>();
#define RUN(W, X)                                                                                                 \
  {                                                                                                               \
    run_experts<DenseStack<W>, X>(x_sorted.data_ptr<X>(), seg.starts.data(), count, seg.busy.data(), nb,          \
                                  DenseStack<W>{w13.data_ptr<W>(), st.s13}, DenseStack<W>{w2.data_ptr<W>(), st.s2}, \
                                  out.data_ptr<X>(), st.hidden, st.inter);                                        \
  }
  DISPATCH_WEIGHTS_AND_ROWS(w13, x_sorted)
#undef RUN
  return out;
}

// The routed experts of a step in the router's layout, as llama.cpp's mul_mat_id: x [T, H], slot_ids [T, K] int64
// (each pair's expert), weights [T, K] float32 -> [T, H], the weighted sum over each token's K experts. The
// grouping by expert happens here, so the call has fixed shapes (a captured step keeps it as one opaque call).
torch::Tensor routed_expert_mlp(torch::Tensor x, torch::Tensor slot_ids, torch::Tensor weights, torch::Tensor w13,
                                torch::Tensor w2, c10::optional<torch::Tensor> w13_scale,
                                c10::optional<torch::Tensor> w2_scale, int64_t block_k) {
  const ExpertStacks st = ExpertStacks::of(x, w13, w2, w13_scale, w2_scale, block_k);
  TORCH_CHECK(slot_ids.dim() == 2 && slot_ids.size(0) == x.size(0) && slot_ids.scalar_type() == torch::kInt64 &&
              slot_ids.is_contiguous(), "routed_expert_mlp: slot_ids int64 [T, K] for x's T rows");
  TORCH_CHECK(weights.sizes() == slot_ids.sizes() && weights.scalar_type() == torch::kFloat32 &&
              weights.is_contiguous(), "routed_expert_mlp: weights float32 [T, K] like slot_ids");
  const int64_t num_tokens = x.size(0), top_k = slot_ids.size(1);
  const PairGroups groups = PairGroups::of(slot_ids.data_ptr<int64_t>(), num_tokens, top_k, st.num_experts);
  auto out = torch::empty_like(x);
  const float* pair_weights = weights.data_ptr<float>();
#define RUN(W, X)                                                                                                 \
  {                                                                                                               \
    run_routed<DenseStack<W>, X>(x.data_ptr<X>(), groups, pair_weights, num_tokens, top_k,                        \
                                 DenseStack<W>{w13.data_ptr<W>(), st.s13}, DenseStack<W>{w2.data_ptr<W>(), st.s2},  \
                                 out.data_ptr<X>(), st.hidden, st.inter);                                         \
  }
  DISPATCH_WEIGHTS_AND_ROWS(w13, x)
#undef RUN
  return out;
}

// x [M, K] @ w[N, K].T (int8 rows times scale [N], FP8 blocks times scale [N, ceil(K / block_k)]) -> [M, N] in x's
// dtype: a projection at few rows, each weight row read once for all of them (the decode GEMVs).
torch::Tensor rows_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> scale, int64_t block_k) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "rows_linear: x [M, K], w [N, K]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "rows_linear: contiguous tensors");
  const auto wt = w.scalar_type(), xt = x.scalar_type();
  TORCH_CHECK(xt == torch::kFloat32 || xt == torch::kBFloat16, "rows_linear: float32 or bfloat16 activations");
  TORCH_CHECK(wt == torch::kFloat32 || wt == torch::kBFloat16 || is_quantized(w),
              "rows_linear: float32, bfloat16, int8 or float8_e4m3fn weights");
  const int64_t m = x.size(0), n_out = w.size(0);
  const RowScales scales = scales_of(scale, is_quantized(w), is_fp8(w), block_k, 1, n_out, x.size(1), "rows_linear");
  auto out = torch::empty({m, n_out}, x.options());
  const int64_t counts[1] = {m}, busy[1] = {0}, start[1] = {0};
#define RUN(W, X)                                                                                           \
  {                                                                                                         \
    const Activations a = Activations::pack(x.data_ptr<X>(), start, counts, busy, 1, x.size(1));           \
    X* o = out.data_ptr<X>();                                                                               \
    project(a, counts, busy, 1, DenseStack<W>{w.data_ptr<W>(), scales}, n_out,                              \
            [&](int64_t, int64_t r, int64_t j, float v) { o[r * n_out + j] = static_cast<X>(v); });         \
  }
  DISPATCH_WEIGHTS_AND_ROWS(w, x)
#undef RUN
  return out;
}

// An int4 weight stack uint8 [E, N, ceil(K / 2)] and its scales [E, N, G] (zero point 8) or [E, N, G, 2] (with zero
// points), G = ceil(K / group_size), or 1 where group_size is 0 (one group a row), checked against E, N and K.
Int4Stack int4_stack_of(const torch::Tensor& values, const torch::Tensor& scale, int64_t experts, int64_t outputs,
                        int64_t columns, int64_t group_size, const char* name) {
  TORCH_CHECK(group_size >= 0 && group_size % 8 == 0, name, ": int4 group size a multiple of 8 (0: one group a row), "
              "got ", group_size);
  const int64_t packed = (columns + 1) / 2, groups = group_size > 0 ? (columns + group_size - 1) / group_size : 1;
  TORCH_CHECK(values.scalar_type() == torch::kUInt8 && values.is_contiguous() && values.dim() == 3 &&
              values.size(0) == experts && values.size(1) == outputs && values.size(2) == packed, name,
              ": contiguous uint8 [", experts, ", ", outputs, ", ", packed, "] (int4 codes of ", columns,
              " columns, two a byte), got ", values.sizes());
  const bool zero_points = scale.dim() == 4;
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() &&
              (scale.dim() == 3 || (zero_points && scale.size(3) == 2)) && scale.size(0) == experts &&
              scale.size(1) == outputs && scale.size(2) == groups, name, "_scale: contiguous float32 [", experts, ", ",
              outputs, ", ", groups, "] or [", experts, ", ", outputs, ", ", groups, ", 2] (with zero points), got ",
              scale.sizes());
  return Int4Stack{values.data_ptr<uint8_t>(), scale.data_ptr<float>(), groups, group_size > 0 ? group_size : columns,
                   zero_points ? 2 : 1};
}

// The int4 expert stacks w13 [E, 2I, ceil(H / 2)] and w2 [E, H, ceil(I / 2)] with their scales, for x [..., H].
struct Int4Experts {
  int64_t num_experts, hidden, inter;
  Int4Stack s13, s2;

  static Int4Experts of(const torch::Tensor& x, const torch::Tensor& w13, const torch::Tensor& w13_scale,
                        const torch::Tensor& w2, const torch::Tensor& w2_scale, int64_t group_size) {
    TORCH_CHECK(x.is_contiguous() && (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
                "int4 expert_mlp: contiguous float32 or bfloat16 activations");
    TORCH_CHECK(w13.dim() == 3 && w13.size(1) % 2 == 0, "int4 expert_mlp: w13 [E, 2I, ceil(H / 2)]");
    const int64_t experts = w13.size(0), hidden = x.size(-1), inter = w13.size(1) / 2;
    return Int4Experts{experts, hidden, inter,
                       int4_stack_of(w13, w13_scale, experts, 2 * inter, hidden, group_size, "int4 expert_mlp w13"),
                       int4_stack_of(w2, w2_scale, experts, hidden, inter, group_size, "int4 expert_mlp w2")};
  }
};

// Calls RUN(X) with the activations' element type (float32 or bfloat16, checked before).
#define DISPATCH_ROWS(x)                                                      \
  {                                                                           \
    if ((x).scalar_type() == torch::kFloat32) RUN(float) else RUN(c10::BFloat16) \
  }

// silu_expert_mlp with int4 weights kept packed: x_sorted [N, H] grouped by expert, counts [E] int64 (on the host),
// w13 uint8 [E, 2I, ceil(H / 2)], w2 uint8 [E, H, ceil(I / 2)], their scales as int4_stack_of has them -> [N, H].
torch::Tensor silu_int4_expert_mlp(torch::Tensor x_sorted, torch::Tensor counts, torch::Tensor w13,
                                   torch::Tensor w13_scale, torch::Tensor w2, torch::Tensor w2_scale,
                                   int64_t group_size) {
  TORCH_CHECK(x_sorted.dim() == 2, "int4 expert_mlp: x_sorted [N, H]");
  const Int4Experts st = Int4Experts::of(x_sorted, w13, w13_scale, w2, w2_scale, group_size);
  TORCH_CHECK(counts.numel() == st.num_experts, "int4 expert_mlp: one count per expert");
  const Segments seg = segments_of(counts, x_sorted.size(0));
  auto out = torch::empty_like(x_sorted);
  const int64_t* count = counts.data_ptr<int64_t>();
#define RUN(X)                                                                                                    \
  {                                                                                                               \
    run_experts<Int4Stack, X>(x_sorted.data_ptr<X>(), seg.starts.data(), count, seg.busy.data(),                  \
                              static_cast<int64_t>(seg.busy.size()), st.s13, st.s2, out.data_ptr<X>(), st.hidden, \
                              st.inter);                                                                          \
  }
  DISPATCH_ROWS(x_sorted)
#undef RUN
  return out;
}

// The masked layout: x [E, M, H], expert e's first counts[e] rows valid (the rest never read) -> [E, M, H], rows
// past counts[e] zero.
torch::Tensor silu_int4_masked_expert_mlp(torch::Tensor x, torch::Tensor counts, torch::Tensor w13,
                                          torch::Tensor w13_scale, torch::Tensor w2, torch::Tensor w2_scale,
                                          int64_t group_size) {
  TORCH_CHECK(x.dim() == 3, "int4 masked_expert_mlp: x [E, M, H]");
  const Int4Experts st = Int4Experts::of(x, w13, w13_scale, w2, w2_scale, group_size);
  TORCH_CHECK(x.size(0) == st.num_experts && counts.numel() == st.num_experts && counts.is_contiguous() &&
              counts.scalar_type() == torch::kInt64, "int4 masked_expert_mlp: x [E, M, H] and counts int64 [E] for ",
              st.num_experts, " experts");
  const int64_t rows = x.size(1);
  const int64_t* count = counts.data_ptr<int64_t>();
  std::vector<int64_t> starts(st.num_experts), busy;
  for (int64_t e = 0; e < st.num_experts; ++e) {
    TORCH_CHECK(count[e] >= 0 && count[e] <= rows, "int4 masked_expert_mlp: counts[", e, "] = ", count[e],
                " is not within the ", rows, " rows of x");
    starts[e] = e * rows;
    if (count[e] > 0) busy.push_back(e);
  }
  auto out = torch::zeros_like(x);
#define RUN(X)                                                                                                    \
  {                                                                                                               \
    run_experts<Int4Stack, X>(x.data_ptr<X>(), starts.data(), count, busy.data(), static_cast<int64_t>(busy.size()), \
                              st.s13, st.s2, out.data_ptr<X>(), st.hidden, st.inter);                             \
  }
  DISPATCH_ROWS(x)
#undef RUN
  return out;
}

// x [M, K] @ the int4 weight [N, K].T (values uint8 [N, ceil(K / 2)], scales [N, G] or [N, G, 2]) -> [M, N] in x's
// dtype: rows_linear with int4 weights.
torch::Tensor int4_rows_linear(torch::Tensor x, torch::Tensor values, torch::Tensor scale, int64_t group_size) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == torch::kFloat32 ||
              x.scalar_type() == torch::kBFloat16), "int4 rows_linear: contiguous float32 or bfloat16 x [M, K]");
  TORCH_CHECK(values.dim() == 2 && scale.dim() >= 2, "int4 rows_linear: values [N, ceil(K / 2)], scale [N, G(, 2)]");
  const int64_t m = x.size(0), n_out = values.size(0);
  const Int4Stack w = int4_stack_of(values.unsqueeze(0), scale.unsqueeze(0), 1, n_out, x.size(1), group_size,
                                    "int4 rows_linear");
  auto out = torch::empty({m, n_out}, x.options());
  const int64_t counts[1] = {m}, busy[1] = {0}, start[1] = {0};
#define RUN(X)                                                                                              \
  {                                                                                                         \
    const Activations a = Activations::pack(x.data_ptr<X>(), start, counts, busy, 1, x.size(1));           \
    X* o = out.data_ptr<X>();                                                                               \
    project(a, counts, busy, 1, w, n_out,                                                                   \
            [&](int64_t, int64_t r, int64_t j, float v) { o[r * n_out + j] = static_cast<X>(v); });         \
  }
  DISPATCH_ROWS(x)
#undef RUN
  return out;
}

// The operators' entries (the dispatcher passes tensors by reference): every weight format of the kernels above,
// the scales absent (None) for float32 / bfloat16 weights.
torch::Tensor routed_expert_mlp_op(const torch::Tensor& x, const torch::Tensor& slot_ids, const torch::Tensor& weights,
                                   const torch::Tensor& w13, const torch::Tensor& w2,
                                   const c10::optional<torch::Tensor>& w13_scale,
                                   const c10::optional<torch::Tensor>& w2_scale, int64_t block_k) {
  return routed_expert_mlp(x, slot_ids, weights, w13, w2, w13_scale, w2_scale, block_k);
}

torch::Tensor rows_linear_op(const torch::Tensor& x, const torch::Tensor& weight,
                             const c10::optional<torch::Tensor>& scale, int64_t block_k) {
  return rows_linear(x, weight, scale, block_k);
}

torch::Tensor int4_rows_linear_op(const torch::Tensor& x, const torch::Tensor& values, const torch::Tensor& scale,
                                  int64_t group_size) {
  return int4_rows_linear(x, values, scale, group_size);
}

}  // namespace

// The same kernels as torch operators (the dispatcher calls them without Python: a captured step's extern calls
// cost a few microseconds each, and inductor's C++ wrapper calls them from C++); their fake implementations are
// registered in kernels/cpu_native/custom_ops.py.
TORCH_LIBRARY(moe_cpu, m) {
  m.def("routed_expert_mlp(Tensor x, Tensor slot_ids, Tensor weights, Tensor w13, Tensor w2, "
        "Tensor? w13_scale=None, Tensor? w2_scale=None, int block_k=0) -> Tensor");
  m.def("rows_linear(Tensor x, Tensor weight, Tensor? scale=None, int block_k=0) -> Tensor");
  m.def("int4_rows_linear(Tensor x, Tensor values, Tensor scale, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(moe_cpu, CPU, m) {
  m.impl("routed_expert_mlp", TORCH_FN(routed_expert_mlp_op));
  m.impl("rows_linear", TORCH_FN(rows_linear_op));
  m.impl("int4_rows_linear", TORCH_FN(int4_rows_linear_op));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("silu_expert_mlp", &silu_expert_mlp, "routed SwiGLU experts over rows grouped by expert (see the file's top)",
        py::arg("x_sorted"), py::arg("counts"), py::arg("w13"), py::arg("w2"), py::arg("w13_scale") = py::none(),
        py::arg("w2_scale") = py::none(), py::arg("block_k") = 0, py::call_guard<py::gil_scoped_release>());
  m.def("routed_expert_mlp", &routed_expert_mlp,
        "routed SwiGLU experts over the router's (token, expert) pairs, weighted and summed per token",
        py::arg("x"), py::arg("slot_ids"), py::arg("weights"), py::arg("w13"), py::arg("w2"),
        py::arg("w13_scale") = py::none(), py::arg("w2_scale") = py::none(), py::arg("block_k") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("rows_linear", &rows_linear, "x [M, K] @ w[N, K].T at few rows (int8 / FP8 weights with their scales)",
        py::arg("x"), py::arg("w"), py::arg("scale") = py::none(), py::arg("block_k") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_int4_expert_mlp", &silu_int4_expert_mlp,
        "silu_expert_mlp with int4 weights kept packed (group_size 0: one group a row)", py::arg("x_sorted"),
        py::arg("counts"), py::arg("w13"), py::arg("w13_scale"), py::arg("w2"), py::arg("w2_scale"),
        py::arg("group_size"), py::call_guard<py::gil_scoped_release>());
  m.def("silu_int4_masked_expert_mlp", &silu_int4_masked_expert_mlp,
        "int4 experts over the masked layout x [E, M, H] (rows past counts[e] zero)", py::arg("x"), py::arg("counts"),
        py::arg("w13"), py::arg("w13_scale"), py::arg("w2"), py::arg("w2_scale"), py::arg("group_size"),
        py::call_guard<py::gil_scoped_release>());
  m.def("int4_rows_linear", &int4_rows_linear, "x [M, K] @ the int4 weight [N, K].T at few rows", py::arg("x"),
        py::arg("values"), py::arg("scale"), py::arg("group_size"), py::call_guard<py::gil_scoped_release>());
}
