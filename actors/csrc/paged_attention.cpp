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
// Keys and values are read sixteen rows at a time, each tile serving every query head of the
// group while it sits in L1: a register's width of keys' scores (16 with AVX-512, 8 with
// AVX2) comes out of one lane reduction (`sum_tile`), and each value row is added into all
// the heads' sums from registers. The
// numbers are those of one key and one head at a time, bit for bit: the same products, added
// in the same order. A walk over the rows in reading order (`RowsAhead`) asks for them a few
// KB before they are read, across block, pass and item boundaries alike.
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

// Head dims that are multiples of 16 take the vector path: registers of kLanes floats (fnv,
// vec_math.h), bf16 and fp16 widened as they load (load_n).
//
// In the helpers below `D` is the head dim when it is a known multiple of 16 (then the loops
// unroll and accumulators stay in registers); 0 means `d` at run time, through plain loops.
//
// The products of q and k, folded to one register; the sum of its lanes (lanes kLanes / 2
// apart first, then half as far, to 1) is their dot product.
template <int D, typename T>
inline fnv dot_lanes(const float* q, const T* k) {
  constexpr int C = D / kLanes;
  static_assert(D > 0 && (C & (C - 1)) == 0, "D / kLanes must be a power of two");
  fnv acc[C];
  for (int c = 0; c < C; ++c) acc[c] = load_n(q + kLanes * c) * load_n(k + kLanes * c);
  for (int width = C; width > 1; width /= 2)
    for (int c = 0; c < width / 2; ++c) acc[c] += acc[c + width / 2];
  return acc[0];
}

template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  float acc = 0.0f;
  for (int64_t j = 0; j < d; ++j) acc += q[j] * widen(k[j]);
  return acc;
}

#if defined(__AVX512F__)
// The lane sums of sixteen vectors at once: out[u] = the sum of v[u]'s lanes, pairs added
// lanes 8 apart, then 4, 2, 1, in 31 shuffles and 15 additions instead of sixteen separate
// reductions.
inline fnv sum_tile(const fnv* v) {
  fnv b[8], c[4], e[2];
  for (int m = 0; m < 8; ++m)
    b[m] = __builtin_shufflevector(v[2 * m], v[2 * m + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                   19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * m], v[2 * m + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25,
                                   26, 27, 28, 29, 30, 31);
  // b[m]: vector 2m's eight partial sums in lanes 0-7, vector 2m+1's in lanes 8-15.
  for (int j = 0; j < 4; ++j)
    c[j] = __builtin_shufflevector(b[2 * j], b[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18,
                                   19, 24, 25, 26, 27) +
           __builtin_shufflevector(b[2 * j], b[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21,
                                   22, 23, 28, 29, 30, 31);
  // c[j]: lanes 4r..4r+3 hold vector 4j+r's four partial sums.
  for (int j = 0; j < 2; ++j)
    e[j] = __builtin_shufflevector(c[2 * j], c[2 * j + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24,
                                   25, 12, 13, 28, 29) +
           __builtin_shufflevector(c[2 * j], c[2 * j + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26,
                                   27, 14, 15, 30, 31);
  // e[j], lanes 4r..4r+3: the two partial sums of vector 8j+r, then of vector 8j+4+r.
  const fnv f = __builtin_shufflevector(e[0], e[1], 0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26,
                                        12, 14, 28, 30) +
                __builtin_shufflevector(e[0], e[1], 1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27,
                                        13, 15, 29, 31);
  // f, lane 4r+s: vector 4s+r.
  return __builtin_shufflevector(f, f, 0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
}
#elif defined(__AVX__)
// The same for eight vectors of eight lanes: lanes 4 apart, then 2, 1.
inline fnv sum_tile(const fnv* v) {
  fnv b[4], c[2];
  for (int m = 0; m < 4; ++m)
    b[m] = __builtin_shufflevector(v[2 * m], v[2 * m + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(v[2 * m], v[2 * m + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  // b[m]: vector 2m's four partial sums in lanes 0-3, vector 2m+1's in lanes 4-7.
  for (int j = 0; j < 2; ++j)
    c[j] = __builtin_shufflevector(b[2 * j], b[2 * j + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(b[2 * j], b[2 * j + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  // c[j]: the two partial sums of vectors 4j, 4j+2, 4j+1, 4j+3, in lane pairs.
  const fnv f = __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14) +
                __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15);
  // f: vectors 0, 2, 1, 3, 4, 6, 5, 7.
  return __builtin_shufflevector(f, f, 0, 2, 1, 3, 4, 6, 5, 7);
}
#else
inline fnv sum_tile(const fnv* v) {
  fnv out;
  for (int u = 0; u < kLanes; ++u) {
    fnv x = v[u];
    for (int width = kLanes / 2; width >= 1; width /= 2)
      for (int l = 0; l < width; ++l) x[l] += x[l + width];
    out[u] = x[0];
  }
  return out;
}
#endif

// s[u] = the dot product of q with key row u, for u < rows (rows d apart).
template <int D, typename T>
inline void scores_of(const float* q, const T* k, int64_t rows, int64_t d, float* s) {
  if constexpr (D > 0) {
    for (int64_t u0 = 0; u0 < rows; u0 += kLanes) {
      const int64_t n = std::min<int64_t>(kLanes, rows - u0);
      fnv v[kLanes];
      for (int64_t u = 0; u < kLanes; ++u) v[u] = u < n ? dot_lanes<D>(q, k + (u0 + u) * D) : fnv{};
      const fnv out = sum_tile(v);
      if (n == kLanes) store_n(s + u0, out);
      else for (int64_t u = 0; u < n; ++u) s[u0 + u] = out[u];
    }
  } else {
    for (int64_t u = 0; u < rows; ++u) s[u] = dot(q, k + u * d, d);
  }
}

// acc[g][0:d) += the sum over u < rows of p[g][u] * v[u][0:d), for g < heads (p rows `ps`
// apart, v rows d apart, acc rows d apart): each value row read once for all the heads, the
// head dim whole (AVX-512) or in slices of four registers (AVX2: fma_block).
template <int D, int G, typename T>
inline void accumulate(float* acc, const float* p, int64_t ps, const T* v, int64_t rows) {
  constexpr int C = kLanes == 16 ? D / kLanes : 4;
  for (int c0 = 0; c0 < D; c0 += C * kLanes) {
    fnv a[G][C];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) a[g][c] = load_n(acc + g * D + c0 + kLanes * c);
    for (int64_t u = 0; u < rows; ++u) {
      float pu[G];
      for (int g = 0; g < G; ++g) pu[g] = p[g * ps + u];
      fma_block(a, pu, v + u * D + c0);
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) store_n(acc + g * D + c0 + kLanes * c, a[g][c]);
  }
}

// The same for `heads` known only at run time: in chunks whose accumulators fit in sixteen
// vector registers. D = 0: plain loops over `d`.
template <int D, typename T>
inline void accumulate_heads(float* acc, const float* p, int64_t ps, const T* v, int64_t rows,
                             int64_t heads, int64_t d) {
  if constexpr (D > 0) {
    constexpr int kChunk = kLanes == 16 ? std::max(1, 16 / (D / 16)) : 3;
    for (int64_t g0 = 0; g0 < heads; g0 += kChunk) {
      float* a = acc + g0 * D;
      const float* pg = p + g0 * ps;
      switch (std::min<int64_t>(kChunk, heads - g0)) {
        // Sizes past kChunk never come here; min() keeps their cases compilable.
        case 1: accumulate<D, 1>(a, pg, ps, v, rows); break;
        case 2: accumulate<D, std::min(2, kChunk)>(a, pg, ps, v, rows); break;
        case 3: accumulate<D, std::min(3, kChunk)>(a, pg, ps, v, rows); break;
        default: accumulate<D, std::min(4, kChunk)>(a, pg, ps, v, rows); break;
      }
    }
  } else {
    for (int64_t g = 0; g < heads; ++g)
      for (int64_t u = 0; u < rows; ++u)
        for (int64_t j = 0; j < d; ++j)
          acc[g * d + j] += p[g * ps + u] * widen(v[u * d + j]);
  }
}

// Walks the rows a thread reads in the order it reads them (an item's keys, block by block,
// then its values, then the next item's) and asks for each a fixed distance before it is
// read, a few lines at a time as the reads go: blocks are scattered over the cache, so the
// hardware prefetcher cannot see the jumps between them, and a whole block asked for at once
// (32 KB at 128 tokens) would queue more misses than the core can track.
template <typename T>
class RowsAhead {
 public:
  RowsAhead(const T* k, const T* v, const int32_t* tables, int64_t max_blocks,
            const int32_t* seq_of, const int32_t* ctx_of, int64_t window, int64_t kv_heads,
            int64_t num_blocks, int64_t block_size, int64_t d, int64_t end)
      : k_(k), v_(v), tables_(tables), max_blocks_(max_blocks), seq_of_(seq_of),
        ctx_of_(ctx_of), window_(window), kv_heads_(kv_heads), num_blocks_(num_blocks),
        block_size_(block_size), d_(d), end_(end) {}

  // Starts the walk at `item`, `rows` rows ahead of the reads.
  void start(int64_t item, int64_t rows) {
    item_ = item;
    enter();
    advance(rows);
  }

  // Asks for the next `rows` rows of the walk; call as that many rows are read.
  void advance(int64_t rows) {
    while (rows > 0 && item_ < end_) {
      const int64_t offset = t_ % block_size_;
      const int64_t n = std::min({rows, ctx_ - t_, block_size_ - offset});
      const T* base = (values_ ? v_ : k_) +
                      ((item_ % kv_heads_ * num_blocks_ + table_[t_ / block_size_]) * block_size_ +
                       offset) * d_;
      const char* p = reinterpret_cast<const char*>(base);
      const int64_t bytes = n * d_ * static_cast<int64_t>(sizeof(T));
      for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
      rows -= n;
      t_ += n;
      if (t_ < ctx_) continue;
      if (!values_) {
        values_ = true;
        t_ = first_;
      } else {
        ++item_;
        enter();
      }
    }
  }

 private:
  void enter() {
    values_ = false;
    if (item_ >= end_) return;
    const int64_t r = item_ / kv_heads_;
    ctx_ = ctx_of_[r];
    first_ = window_ > 0 ? std::max<int64_t>(0, ctx_ - window_) : 0;
    t_ = first_;
    table_ = tables_ + static_cast<int64_t>(seq_of_[r]) * max_blocks_;
  }

  const T* k_;
  const T* v_;
  const int32_t* tables_;
  int64_t max_blocks_;
  const int32_t* seq_of_;
  const int32_t* ctx_of_;
  int64_t window_, kv_heads_, num_blocks_, block_size_, d_, end_;
  int64_t item_ = 0, first_ = 0, ctx_ = 0, t_ = 0;
  bool values_ = false;
  const int32_t* table_ = nullptr;
};

// Rows read at a time: one tile of sixteen keys' scores for every query head of the group,
// or sixteen values into every head's sum, while the tile sits in L1.
constexpr int64_t kTile = 16;

// How far the walk runs ahead of the reads, and into L2 (locality 2): on one core of an Intel
// Xeon, 64 sequences of 400 positions at 128 tokens a block, 8 KB ahead read 8.0 GB/s of K and
// V where one whole block ahead read 7.1 (a sequential read of the same caches: 10.5).
constexpr int64_t kAheadBytes = 8192;

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
    RowsAhead<T> ahead(kp, vp, tables, max_blocks, seq_of, ctx_of, window, kv_heads, num_blocks,
                       block_size, d, end);
    ahead.start(begin, kAheadBytes / (d * static_cast<int64_t>(sizeof(T))));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / kv_heads, h = item % kv_heads;
      const int64_t ctx = ctx_of[r];
      const int64_t first = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
      const int64_t n = ctx - first;
      const int32_t* table = tables + static_cast<int64_t>(seq_of[r]) * max_blocks;
      for (int64_t i = 0; i < group * d; ++i)
        qf[i] = widen(qp[(r * heads + h * group) * d + i]) * fscale;
      scores.resize(group * n);
      // Block by block: a block's rows for one head are contiguous and stay in L1 while
      // each query head of the group reads them.
      for (int64_t t = first; t < ctx;) {
        const int64_t block = table[t / block_size], offset = t % block_size;
        const int64_t stop = std::min(ctx, t + block_size - offset);
        const T* base = kp + ((h * num_blocks + block) * block_size + offset) * d;
        for (int64_t u = t; u < stop; u += kTile) {
          const int64_t tile = std::min(kTile, stop - u);
          ahead.advance(tile);
          for (int64_t g = 0; g < group; ++g)
            scores_of<D>(&qf[g * d], base + (u - t) * d, tile, d, &scores[g * n + u - first]);
        }
        t = stop;
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = &scores[g * n];
        const float top = max_of(s, n);
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
        for (int64_t u = t; u < stop; u += kTile) {
          const int64_t tile = std::min(kTile, stop - u);
          ahead.advance(tile);
          accumulate_heads<D>(acc.data(), &scores[u - first], n, base + (u - t) * d, tile, group, d);
        }
        t = stop;
      }
      T* o = op + (r * heads + h * group) * d;
      for (int64_t g = 0; g < group; ++g) {
        const float inv = 1.0f / total[g];
        for (int64_t j = 0; j < d; ++j) o[g * d + j] = narrow<T>(acc[g * d + j] * inv);
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
