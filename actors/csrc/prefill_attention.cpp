// Causal prefill attention for one sequence, for CPU, fp32, head dims 64 and 128.
//
// q is (heads, q_len, dim) and k, v are (kv_heads, ctx_len, dim), any strides with unit
// stride along dim (the projection's output seen per head, or a gathered cache). Query row i
// attends keys [0, ctx_len - q_len + i]: a first chunk (ctx_len == q_len) or a later chunk
// after cached tokens. The output is (q_len, heads * dim).
//
// torch's fused CPU kernel reaches about a fifth of this core's fp32 peak at these shapes
// (heads of 64, prompts of a few hundred tokens). Here the work is split over (KV head, block
// of 16 query positions); a task takes the block's rows of every query head sharing that KV
// head, so each key and value it loads serves the whole group:
//  1. scores: the group's rows against K, which is laid out once per KV head as (dim, keys)
//     so that a register of keys is one vector and each query element is a broadcast; rows
//     by 32 keys at a time with their accumulators in registers (8 rows with AVX-512, 3 with
//     AVX2: vec_math.h's fma_block);
//  2. softmax per row over its causal prefix, in place (fast_exp_n), a register of lanes at
//     a time to the row's end, the lanes past it masked;
//  3. the output: the probabilities against V, rows four (dim 64) or two (dim 128) at a time
//     with their accumulators in registers (AVX2: three rows, 32 columns at a time).
// A sequence's numbers depend only on its own tokens.
//
// Built by actors/layers/kernels.py with the machine's own compiler on first use.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vec_math.h"

namespace {

constexpr int64_t kQueryBlock = 16;  // query positions per task
constexpr int64_t kKeyBlock = 32;    // keys per score tile (two vectors)

struct Strides {
  int64_t head, pos;
};

// K of one KV head as (dim, keys), keys padded to kKeyBlock with zeros. Sixteen keys at a
// time, so that each write is one whole cache line and the sixteen rows read stay in L1.
template <int D>
void transpose_keys(const float* k, Strides ks, int64_t ctx, int64_t padded, float* kt) {
  for (int64_t t0 = 0; t0 < padded; t0 += 16) {
    const int64_t n = std::max<int64_t>(0, std::min<int64_t>(16, ctx - t0));
    for (int dd = 0; dd < D; ++dd) {
      float* dst = kt + dd * padded + t0;
      for (int64_t t = 0; t < n; ++t) dst[t] = k[(t0 + t) * ks.pos + dd];
      for (int64_t t = n; t < 16; ++t) dst[t] = 0.0f;
    }
  }
}

// scores[x][t] = q_x . k_t for R rows against the 32 keys of one tile starting at kb: R x
// (32 / kLanes) accumulators in registers, each key vector loaded once for all R rows.
// acc[x][:] += the sum over t < n of rows[x][t] * (the V registers at w + t * step): the
// inner loop of the scores (q against K's columns) and of the values (p against V's rows).
template <int R, int V>
inline void row_products(fnv (&acc)[R][V], const float* const* rows, int64_t n, const float* w,
                         int64_t step) {
  for (int64_t t = 0; t < n; ++t) {
    float s[R];
    for (int x = 0; x < R; ++x) s[x] = rows[x][t];
    fma_block(acc, s, w + t * step);
  }
}

template <int D, int R>
inline void score_tile(const float* const* rows, const float* kt, int64_t padded, int64_t kb,
                       float* scores, int64_t stride) {
  constexpr int V = kKeyBlock / kLanes;
  fnv acc[R][V] = {};
  row_products(acc, rows, D, kt + kb, padded);
  for (int x = 0; x < R; ++x)
    for (int v = 0; v < V; ++v) store_n(scores + x * stride + kb + v * kLanes, acc[x][v]);
}

// Rows per score tile: 8 x 2 accumulators with AVX-512 (enough to keep both FMA ports busy
// through their latency), 3 x 4 with AVX2's 16 registers (fma_block).
constexpr int kScoreRows = kLanes == 16 ? 8 : 3;

// scores[r][t] = q_r . k_t for the task's rows against keys [0, keys), kScoreRows rows at a
// time, then four (AVX-512), then one.
template <int D>
void score_rows(const float* const* rows, int64_t num_rows, const float* kt, int64_t padded,
                int64_t keys, float* scores, int64_t stride) {
  for (int64_t kb = 0; kb < keys; kb += kKeyBlock) {
    int64_t r = 0;
    for (; r + kScoreRows <= num_rows; r += kScoreRows)
      score_tile<D, kScoreRows>(rows + r, kt, padded, kb, scores + r * stride, stride);
    if constexpr (kScoreRows > 4)
      for (; r + 4 <= num_rows; r += 4)
        score_tile<D, 4>(rows + r, kt, padded, kb, scores + r * stride, stride);
    for (; r < num_rows; ++r) score_tile<D, 1>(rows + r, kt, padded, kb, scores + r * stride, stride);
  }
}

// softmax(scale * s) over s[0, n) in place, zeros over [n, keys); returns 1 / the sum. The
// row's scores are computed in whole tiles, so s may be read up to n rounded up to 16: the
// exponentials run a register of lanes at a time to there, the lanes past n masked to zero,
// instead of ending each row in a one-lane loop as long as the vector part.
inline float softmax_row(float* s, int64_t n, int64_t keys, float scale) {
  const float top = max_of(s, n);
  const int64_t whole = (n + kLanes - 1) / kLanes * kLanes;
  fnv lane;
  for (int l = 0; l < kLanes; ++l) lane[l] = static_cast<float>(l);
  fnv sums{};
  for (int64_t t0 = 0; t0 < whole; t0 += kLanes) {
    fnv e = fast_exp_n((load_n(s + t0) - top) * scale);
    if (t0 + kLanes > n) e = lane < static_cast<float>(n - t0) ? e : 0.0f;
    store_n(s + t0, e);
    sums += e;
  }
  if (whole < keys) std::fill(s + whole, s + keys, 0.0f);
  return 1.0f / sum_n(sums);
}

// out_r = inv_r * sum_t p[r][t] v_t for R rows at a time over keys [0, n), the head dim in
// slices of C vectors: all of it at once with AVX-512, 32 floats at a time with AVX2 (the
// accumulators of R rows beside its R probabilities in 16 registers; fma_block).
template <int D, int R>
void weigh_values(const float* const* probs, const float* inv, int64_t n, const float* v,
                  int64_t v_pos, float* const* outs) {
  constexpr int C = kLanes == 16 ? D / kLanes : 4;
  for (int c0 = 0; c0 < D; c0 += C * kLanes) {
    fnv acc[R][C] = {};
    row_products(acc, probs, n, v + c0, v_pos);
    for (int x = 0; x < R; ++x)
      for (int c = 0; c < C; ++c) store_n(outs[x] + c0 + c * kLanes, acc[x][c] * inv[x]);
  }
}

template <int D>
void prefill_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                    at::Tensor& out) {
  const int64_t heads = q.size(0), q_len = q.size(1), kv_heads = k.size(0), ctx = k.size(1);
  const int64_t group = heads / kv_heads, offset = ctx - q_len;
  const int64_t padded = (ctx + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const Strides qs{q.stride(0), q.stride(1)}, ks{k.stride(0), k.stride(1)};
  const Strides vs{v.stride(0), v.stride(1)};
  const float sc = static_cast<float>(scale);
  // Rows per weigh_values call: AVX-512 holds a whole row of D in 4 (dim 64) or 8 registers.
  constexpr int R = kLanes == 16 ? (D == 64 ? 4 : 2) : 3;

  std::vector<float> kt(static_cast<size_t>(kv_heads * D * padded));
  at::parallel_for(0, kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h)
      transpose_keys<D>(kp + h * ks.head, ks, ctx, padded, kt.data() + h * D * padded);
  });

  const int64_t blocks = (q_len + kQueryBlock - 1) / kQueryBlock;
  at::parallel_for(0, kv_heads * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<const float*> rows, probs;
    std::vector<float*> outs;
    std::vector<float> inv;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / blocks, i0 = (task % blocks) * kQueryBlock;
      const int64_t i1 = std::min(q_len, i0 + kQueryBlock);
      const int64_t num_rows = (i1 - i0) * group;
      const int64_t keys = offset + i1;  // the last row's causal prefix
      const int64_t tiled = (keys + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
      scores.resize(static_cast<size_t>(num_rows * tiled));
      rows.resize(num_rows), probs.resize(num_rows), outs.resize(num_rows), inv.resize(num_rows);
      // Row r: query position i0 + r / group of head h * group + r % group.
      for (int64_t r = 0; r < num_rows; ++r) {
        const int64_t i = i0 + r / group, head = h * group + r % group;
        rows[r] = qp + head * qs.head + i * qs.pos;
        probs[r] = scores.data() + r * tiled;
        outs[r] = op + (i * heads + head) * D;
      }
      score_rows<D>(rows.data(), num_rows, kt.data() + h * D * padded, padded, keys,
                    scores.data(), tiled);
      for (int64_t r = 0; r < num_rows; ++r) {
        const int64_t seen = offset + i0 + r / group + 1;
        inv[r] = softmax_row(scores.data() + r * tiled, seen, keys, sc);
      }
      const float* vh = vp + h * vs.head;
      int64_t r = 0;
      for (; r + R <= num_rows; r += R) {
        // Rows are in position order: the last of the R sees the most keys.
        const int64_t seen = offset + i0 + (r + R - 1) / group + 1;
        weigh_values<D, R>(&probs[r], &inv[r], seen, vh, vs.pos, &outs[r]);
      }
      for (; r < num_rows; ++r) {
        const int64_t seen = offset + i0 + r / group + 1;
        weigh_values<D, 1>(&probs[r], &inv[r], seen, vh, vs.pos, &outs[r]);
      }
    }
  });
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3,
              "q, k, v must be (heads, tokens, dim)");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat,
              "prefill_attention takes float32");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "the head dim must be contiguous");
  TORCH_CHECK(k.sizes() == v.sizes(), "K and V differ in shape");
  TORCH_CHECK(q.size(2) == k.size(2), "q and K differ in head dim");
  TORCH_CHECK(q.size(0) % k.size(0) == 0, "heads must be a multiple of KV heads");
  TORCH_CHECK(q.size(1) <= k.size(1), "more query positions than keys");
  at::Tensor out = at::empty({q.size(1), q.size(0) * q.size(2)}, q.options());
  if (q.size(1) == 0) return out;
  if (q.size(2) == 64) prefill_kernel<64>(q, k, v, scale, out);
  else if (q.size(2) == 128) prefill_kernel<128>(q, k, v, scale, out);
  else TORCH_CHECK(false, "prefill_attention takes head dims 64 and 128");
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(serve_app, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(serve_app, CPU, m) { m.impl("prefill_attention", prefill_attention); }
