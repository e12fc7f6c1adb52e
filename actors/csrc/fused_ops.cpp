// The decoder layer's small ops, each one pass over its rows instead of a chain of torch ops
// (every one of which allocates, dispatches and walks the tensor again):
//
//   rms_norm            out = x / rms(x) * weight
//   fused_add_rms_norm  residual += x; x = residual / rms(residual) * weight (in place)
//   rotary_embedding    q, k rotated in place at their positions (neox halves)
//   silu_and_mul        out = silu(gate) * up, for x = [gate | up]
//   argmax_rows         per row, torch.argmax's index: the first of the largest value, or
//                       the first NaN where there is one
//   masked_argmax       per listed row, the first index of the largest score among the
//                       tokens a grammar bitmask allows (-1 where none scores above -inf)
//
// Arithmetic in fp32 whatever the storage dtype, as the torch ops they replace. Built by
// actors/layers/kernels.py.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "vec_math.h"

namespace {

// Rows per task: small batches stay on one thread (a fork costs more than the work).
inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 16384 / row_elems); }

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " must be (rows, hidden) with unit stride");
}

template <typename T>
inline float inverse_rms(const T* row, int64_t n, float eps) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    const float v = widen(row[j]);
    sum += v * v;
  }
  return 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
}

// weight * (x * inv).to(dtype): the rounding to the storage dtype comes before the weight,
// as in the torch module.
template <typename T>
inline void scale_row(T* out, const T* x, const T* weight, float inv, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float h = widen(narrow<T>(widen(x[j]) * inv));
    out[j] = narrow<T>(widen(weight[j]) * h);
  }
}

template <typename T>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, float eps, at::Tensor& out) {
  const int64_t n = x.size(1), stride = x.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, x.size(0), grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = xp + r * stride;
      scale_row(op + r * n, row, wp, inverse_rms(row, n, eps), n);
    }
  });
}

template <typename T>
void add_rms_norm_rows(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, float eps) {
  const int64_t n = x.size(1);
  T* xp = x.data_ptr<T>();
  T* rp = residual.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  at::parallel_for(0, x.size(0), grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = xp + r * n;
      T* rr = rp + r * n;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j)
        rr[j] = narrow<T>(widen(xr[j]) + widen(rr[j]));
      scale_row(xr, rr, wp, inverse_rms(rr, n, eps), n);
    }
  });
}

template <typename T>
void silu_and_mul_rows(const at::Tensor& x, at::Tensor& out) {
  const int64_t n = x.size(1) / 2, stride = x.stride(0);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, x.size(0), grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = xp + r * stride;
      const T* up = gate + n;
      T* o = op + r * n;
      // A register of lanes at a time (fast_exp_n: as an `omp simd` loop over fast_exp, GCC
      // left this scalar on AVX2, 2.3x torch's time), the row's tail one lane at a time.
      int64_t j = 0;
      for (; j + kLanes <= n; j += kLanes) {
        const fnv g = load_n(gate + j);
        fnv act = g / (1.0f + fast_exp_n(-g));
        if constexpr (!std::is_same_v<T, float>) {
          // silu rounded to the storage dtype before the product, as F.silu(gate) * up.
          T rounded[kLanes];
          store_n(rounded, act);
          act = load_n(rounded);
        }
        store_n(o + j, act * load_n(up + j));
      }
      for (; j < n; ++j) {
        const float g = widen(gate[j]);
        const float act = widen(narrow<T>(g / (1.0f + fast_exp(-g))));
        o[j] = narrow<T>(act * widen(up[j]));
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight must be (hidden,)");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "x and weight differ in dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x, weight, static_cast<float>(eps), out);
  });
  return out;
}

void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous(), "x and residual must be contiguous");
  check_rows(x, "x");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual differ in shape");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight must be (hidden,)");
  TORCH_CHECK(x.scalar_type() == residual.scalar_type() && x.scalar_type() == weight.scalar_type(),
              "x, residual and weight differ in dtype");
  const int64_t n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_rows<scalar_t>(x, residual, weight, static_cast<float>(eps));
  });
}

template <typename T>
void rotate_rows(T* base, int64_t rows, int64_t heads, int64_t row_stride, int64_t head_stride,
                 int64_t half, const int64_t* positions, const float* cos, const float* sin) {
  at::parallel_for(0, rows, grain(heads * half * 2), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cos + positions[r] * half;
      const float* s = sin + positions[r] * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* x1 = base + r * row_stride + h * head_stride;
        T* x2 = x1 + half;
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {
          const float a = widen(x1[j]), b = widen(x2[j]);
          x1[j] = narrow<T>(a * c[j] - b * s[j]);
          x2[j] = narrow<T>(b * c[j] + a * s[j]);
        }
      }
    }
  });
}

void rotary_embedding(const at::Tensor& positions, at::Tensor& q, at::Tensor& k,
                      const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "positions must be int64");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "cos and sin must be contiguous float32 (max_position, head_dim / 2)");
  for (const at::Tensor* t : {&q, &k}) {
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1, "q and k must be (tokens, heads, head_dim)");
    TORCH_CHECK(t->size(0) == positions.numel(), "one position per token");
    TORCH_CHECK(t->size(2) == 2 * cos.size(1), "head_dim must be twice cos's width");
  }
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "q and k differ in dtype");
  const int64_t half = cos.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary", [&] {
    for (at::Tensor* t : {&q, &k})
      rotate_rows(t->data_ptr<scalar_t>(), t->size(0), t->size(1), t->stride(0), t->stride(1),
                  half, positions.data_ptr<int64_t>(), cos.data_ptr<float>(),
                  sin.data_ptr<float>());
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x must be [gate | up] along its last dim");
  const int64_t n = x.size(1) / 2;
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_mul", [&] {
    silu_and_mul_rows<scalar_t>(x, out);
  });
  return out;
}

void check_bitmask_args(const at::Tensor& scores, const at::Tensor& bitmask,
                        const at::Tensor& rows) {
  check_rows(scores, "scores");
  check_rows(bitmask, "bitmask");
  TORCH_CHECK(scores.scalar_type() == at::kFloat, "scores must be float32");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt, "bitmask must be int32");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(),
              "rows must be a 1-d int64 tensor");
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.numel(); ++i)
    TORCH_CHECK(rp[i] >= 0 && rp[i] < scores.size(0) && rp[i] < bitmask.size(0),
                "row ", rp[i], " is outside scores or bitmask");
}

// Values per block of argmax_row's search pass: one block is compared at once, then its
// lanes are searched only if one of them holds the value sought.
constexpr int64_t kSearchBlock = 64;

// The first index in s[0, n) holding `want` (a NaN where `want` is NaN), or n.
template <typename T>
int64_t first_equal(const T* s, int64_t n, float want) {
  const bool nan = want != want;
  for (int64_t b = 0; b < n; b += kSearchBlock) {
    const int64_t e = std::min(n, b + kSearchBlock);
    int hit = 0;
#pragma omp simd reduction(| : hit)
    for (int64_t i = b; i < e; ++i) {
      const float x = widen(s[i]);
      hit |= nan ? x != x : x == want;
    }
    if (hit)
      for (int64_t i = b; i < e; ++i) {
        const float x = widen(s[i]);
        if (nan ? x != x : x == want) return i;
      }
  }
  return n;
}

// torch.argmax over one row: a vectorized pass for the largest value (and whether any value is
// NaN, which torch ranks above every number), then the first index holding it.
template <typename T>
int64_t argmax_row(const T* s, int64_t n) {
  float top = -INFINITY;
  int nan = 0;
#pragma omp simd reduction(max : top) reduction(| : nan)
  for (int64_t i = 0; i < n; ++i) {
    const float x = widen(s[i]);
    top = x > top ? x : top;  // not std::max: see max_of
    nan |= x != x;
  }
  const int64_t at = first_equal(s, n, nan ? NAN : top);
  return at < n ? at : 0;  // only an all -inf row finds -inf at 0 anyway
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.stride(1) == 1,
              "x must be (rows, n) with n > 0 and unit stride along n");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                  x.scalar_type() == at::kHalf,
              "argmax_rows takes float32, bfloat16 or float16");
  const int64_t rows = x.size(0), n = x.size(1), ld = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "argmax_rows", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) op[i] = argmax_row(xp + i * ld, n);
    });
  });
  return out;
}

// A grammar bitmask row: bit (j & 31) of word j >> 5 set where token j is allowed.
// torch.argmax's answer on the row with every forbidden token set to -inf (the first index
// of the largest value), in one read of the row: each word's 32 scores are reduced to the
// largest allowed one, the first word to reach the row's maximum is remembered, and only its
// lanes are searched for the index. -1 where no allowed token scores above -inf. Tokens past
// the bitmask's width are allowed (as xgrammar's mask leaves them).
int64_t masked_argmax_row(const float* s, const uint32_t* words, int64_t vocab, int64_t width) {
  const int64_t covered = std::min(vocab, width * 32), full = covered / 32;
  float best = -INFINITY;
  int64_t best_word = -1;
  for (int64_t w = 0; w < full; ++w) {
    const uint32_t bits = words[w];
    if (bits == 0) continue;
    const float* p = s + w * 32;
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int b = 0; b < 32; ++b) {
      const float x = ((bits >> b) & 1u) ? p[b] : -INFINITY;
      m = x > m ? x : m;  // not std::max: see max_of
    }
    if (m > best) {
      best = m;
      best_word = w;
    }
  }
  int64_t arg = -1;
  if (best_word >= 0) {
    const uint32_t bits = words[best_word];
    const float* p = s + best_word * 32;
    for (int b = 0; b < 32; ++b)
      if (((bits >> b) & 1u) && p[b] == best) {
        arg = best_word * 32 + b;
        break;
      }
  }
  // The partial last word, then tokens past the bitmask: later indices win only if larger.
  for (int64_t j = full * 32; j < covered; ++j)
    if (((words[j >> 5] >> (j & 31)) & 1u) && s[j] > best) {
      best = s[j];
      arg = j;
    }
  for (int64_t j = covered; j < vocab; ++j)
    if (s[j] > best) {
      best = s[j];
      arg = j;
    }
  return arg;
}

at::Tensor masked_argmax(const at::Tensor& scores, const at::Tensor& bitmask,
                         const at::Tensor& rows) {
  check_bitmask_args(scores, bitmask, rows);
  const int64_t n = rows.numel(), vocab = scores.size(1), width = bitmask.size(1);
  const int64_t* rp = rows.data_ptr<int64_t>();
  at::Tensor out = at::empty({n}, rows.options());
  int64_t* op = out.data_ptr<int64_t>();
  const float* sp = scores.data_ptr<float>();
  const auto* mp = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  at::parallel_for(0, n, grain(vocab), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      op[i] = masked_argmax_row(sp + rp[i] * scores.stride(0), mp + rp[i] * bitmask.stride(0),
                                vocab, width);
  });
  return out;
}

// -inf wherever a row's grammar bitmask forbids a token, in place, for each row in `rows`.
// Only the row's own tokens are written: a partial last word stops at the vocab (xgrammar's
// CPU mask could write one -inf past it, into the next row or past the tensor). Tokens past
// the bitmask's width stay as they are.
void apply_bitmask_row(float* s, const uint32_t* words, int64_t vocab, int64_t width) {
  const int64_t covered = std::min(vocab, width * 32), full = covered / 32;
  for (int64_t w = 0; w < full; ++w) {
    const uint32_t bits = words[w];
    if (bits == 0xffffffffu) continue;
    float* p = s + w * 32;
#pragma omp simd
    for (int b = 0; b < 32; ++b) p[b] = ((bits >> b) & 1u) ? p[b] : -INFINITY;
  }
  for (int64_t j = full * 32; j < covered; ++j)
    if (!((words[j >> 5] >> (j & 31)) & 1u)) s[j] = -INFINITY;
}

void apply_bitmask(at::Tensor& scores, const at::Tensor& bitmask, const at::Tensor& rows) {
  check_bitmask_args(scores, bitmask, rows);
  const int64_t n = rows.numel(), vocab = scores.size(1), width = bitmask.size(1);
  const int64_t* rp = rows.data_ptr<int64_t>();
  float* sp = scores.data_ptr<float>();
  const auto* mp = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  at::parallel_for(0, n, grain(vocab), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      apply_bitmask_row(sp + rp[i] * scores.stride(0), mp + rp[i] * bitmask.stride(0), vocab,
                        width);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(serve_app, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def(
      "rotary_embedding(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) "
      "-> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("masked_argmax(Tensor scores, Tensor bitmask, Tensor rows) -> Tensor");
  m.def("apply_bitmask(Tensor(a!) scores, Tensor bitmask, Tensor rows) -> ()");
}

TORCH_LIBRARY_IMPL(serve_app, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("fused_add_rms_norm", fused_add_rms_norm);
  m.impl("rotary_embedding", rotary_embedding);
  m.impl("silu_and_mul", silu_and_mul);
  m.impl("argmax_rows", argmax_rows);
  m.impl("masked_argmax", masked_argmax);
  m.impl("apply_bitmask", apply_bitmask);
}
