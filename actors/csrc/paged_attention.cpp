// Decode attention that reads the paged KV cache in place, for CPU.
//
// Each query row attends the first `row_ctx[r]` positions of the sequence whose block table
// is row `row_seq[r]` of `block_tables` (the last `window` of them when a window is set).
// A decode step has one row per sequence; a sequence verifying k proposed tokens has 1 + k
// rows sharing one table, each with its own context length (causal within them).
//
// Work is split over (row, KV head) pairs; each pair reads its keys and values straight from
// the cache blocks (no gather copy), keeps its query heads' scores in a small buffer, and
// writes its heads' outputs. A pair's result depends only on its own row: batch mates never
// change a sequence's numbers.
//
// Built by actors/layers/kernels.py with the machine's own compiler on first use.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vec_math.h"

namespace {

// Sixteen floats as one value: the compiler maps it onto the vector unit it has (one AVX-512
// register, two AVX2 ones). Head dims that are multiples of 16 take this path.
typedef float f16v __attribute__((vector_size(64)));
typedef float f8v __attribute__((vector_size(32)));
typedef float f4v __attribute__((vector_size(16)));

template <typename T>
inline f16v load16(const T* p) {
  f16v v;
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(&v, p, sizeof(v));
  } else {
    for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(p[i]);
  }
  return v;
}

// A pairwise sum of the lanes (a strictly ordered one would chain sixteen additions).
inline float sum_lanes(f16v v) {
  const f8v a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f4v b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// Dot product and accumulate over one head's row. `D` is the head dim when it is a known
// multiple of 16 (then the loops unroll and accumulators stay in registers); 0 means `d` at
// run time, through plain loops.
template <int D, typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  if constexpr (D > 0) {
    f16v acc[D / 16];
    for (int c = 0; c < D / 16; ++c) acc[c] = load16(q + 16 * c) * load16(k + 16 * c);
    static_assert((D / 16 & (D / 16 - 1)) == 0, "D / 16 must be a power of two");
    for (int width = D / 16; width > 1; width /= 2)
      for (int c = 0; c < width / 2; ++c) acc[c] += acc[c + width / 2];
    return sum_lanes(acc[0]);
  } else {
    float acc = 0.0f;
    for (int64_t j = 0; j < d; ++j) acc += q[j] * static_cast<float>(k[j]);
    return acc;
  }
}

// acc[0:d) += the sum over u < rows of p[u] * v[u][0:d), rows d apart.
template <int D, typename T>
inline void accumulate(float* acc, const float* p, const T* v, int64_t rows, int64_t d) {
  if constexpr (D > 0) {
    f16v a[D / 16];
    for (int c = 0; c < D / 16; ++c) a[c] = load16(acc + 16 * c);
    for (int64_t u = 0; u < rows; ++u, v += D)
      for (int c = 0; c < D / 16; ++c) a[c] += p[u] * load16(v + 16 * c);
    for (int c = 0; c < D / 16; ++c) std::memcpy(acc + 16 * c, &a[c], sizeof(f16v));
  } else {
    for (int64_t u = 0; u < rows; ++u, v += d)
      for (int64_t j = 0; j < d; ++j) acc[j] += p[u] * static_cast<float>(v[j]);
  }
}

// Asks for the block holding position `next` while this one is read: blocks are scattered
// over the cache, so the hardware prefetcher cannot see the jump.
template <typename T>
inline void prefetch_next(const T* cache, const int32_t* table, int64_t next, int64_t ctx,
                          int64_t h, int64_t num_blocks, int64_t block_size, int64_t d) {
  if (next >= ctx) return;
  const int64_t rows = std::min(ctx - next, block_size);
  const char* p = reinterpret_cast<const char*>(
      cache + ((h * num_blocks + table[next / block_size]) * block_size) * d);
  const int64_t bytes = rows * d * static_cast<int64_t>(sizeof(T));
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

template <typename T, int D>
void decode_kernel(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& row_seq,
                   const at::Tensor& row_ctx, int64_t window, double scale, at::Tensor& out) {
  const int64_t rows = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t kv_heads = k_cache.size(0), num_blocks = k_cache.size(1);
  const int64_t block_size = k_cache.size(2), max_blocks = block_tables.size(1);
  const int64_t group = heads / kv_heads;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* seq_of = row_seq.data_ptr<int32_t>();
  const int32_t* ctx_of = row_ctx.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * d), acc(group * d), total(group), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / kv_heads, h = item % kv_heads;
      const int64_t ctx = ctx_of[r];
      const int64_t first = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
      const int64_t n = ctx - first;
      const int32_t* table = tables + static_cast<int64_t>(seq_of[r]) * max_blocks;
      for (int64_t i = 0; i < group * d; ++i)
        qf[i] = static_cast<float>(qp[(r * heads + h * group) * d + i]) * fscale;
      scores.resize(group * n);
      // Block by block: a block's rows for one head are contiguous and stay in L1 while
      // each query head of the group reads them.
      for (int64_t t = first; t < ctx;) {
        const int64_t block = table[t / block_size], offset = t % block_size;
        const int64_t stop = std::min(ctx, t + block_size - offset);
        const T* base = kp + ((h * num_blocks + block) * block_size + offset) * d;
        prefetch_next(kp, table, stop, ctx, h, num_blocks, block_size, d);
        for (int64_t g = 0; g < group; ++g) {
          float* s = &scores[g * n + t - first];
          const float* qg = &qf[g * d];
          for (int64_t u = 0; u < stop - t; ++u) s[u] = dot<D>(qg, base + u * d, d);
        }
        t = stop;
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = &scores[g * n];
        float top = -INFINITY;
        for (int64_t i = 0; i < n; ++i) top = std::max(top, s[i]);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; ++i) {
          s[i] = fast_exp(s[i] - top);
          sum += s[i];
        }
        total[g] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t t = first; t < ctx;) {
        const int64_t block = table[t / block_size], offset = t % block_size;
        const int64_t stop = std::min(ctx, t + block_size - offset);
        const T* base = vp + ((h * num_blocks + block) * block_size + offset) * d;
        prefetch_next(vp, table, stop, ctx, h, num_blocks, block_size, d);
        for (int64_t g = 0; g < group; ++g)
          accumulate<D>(&acc[g * d], &scores[g * n + t - first], base, stop - t, d);
        t = stop;
      }
      T* o = op + (r * heads + h * group) * d;
      for (int64_t g = 0; g < group; ++g) {
        const float inv = 1.0f / total[g];
        for (int64_t j = 0; j < d; ++j) o[g * d + j] = static_cast<T>(acc[g * d + j] * inv);
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& row_seq, const at::Tensor& row_ctx,
                                  int64_t window, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous (rows, heads, dim)");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "caches must be contiguous (kv_heads, blocks, block_size, dim)");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "K and V caches differ in shape");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() &&
                  q.scalar_type() == v_cache.scalar_type(),
              "q and the caches differ in dtype");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "q and the caches differ in head dim");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0, "heads must be a multiple of KV heads");
  for (const at::Tensor* t : {&block_tables, &row_seq, &row_ctx})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "indices must be int32");
  TORCH_CHECK(block_tables.dim() == 2, "block_tables must be (seqs, max_blocks)");
  TORCH_CHECK(row_seq.numel() == q.size(0) && row_ctx.numel() == q.size(0),
              "one sequence and one context length per query row");
  at::Tensor out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    const auto run = [&](auto head_dim) {
      decode_kernel<scalar_t, decltype(head_dim)::value>(q, k_cache, v_cache, block_tables,
                                                         row_seq, row_ctx, window, scale, out);
    };
    if (q.size(2) == 64) run(std::integral_constant<int, 64>{});
    else if (q.size(2) == 128) run(std::integral_constant<int, 128>{});
    else run(std::integral_constant<int, 0>{});
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(serve_app, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor row_seq, Tensor row_ctx, int window, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(serve_app, CPU, m) { m.impl("paged_decode_attention", paged_decode_attention); }
