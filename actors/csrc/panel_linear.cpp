// Linear layers at decode batch sizes (a few rows), for CPU fp32, and bf16 where the CPU has
// AVX512-BF16.
//
//   pack_panels(w)                     (N, K) -> (ceil(N / 32), K, 32): each panel holds 32
//                                      output features, k-major, zero-padded past N (bf16:
//                                      k in pairs, see below)
//   panel_linear(x, panels, n, bias)   y = x W^T (+ bias) for x (rows, K), y (rows, n)
//   panel_linear_bf16()                whether this build takes bf16
//
// With a few rows a linear layer is a read of its weight: 2 FLOPs per row per weight read.
// Laid out in panels, the weight is read once, front to back, each 128-byte step of a panel
// feeding up to 12 rows x 32 outputs of FMAs (24 accumulators, the broadcast row values from
// L1). Rows beyond 12 run in further groups over the same panel, then in L2. The loads ask
// for the bytes 4 KB ahead: the hardware prefetcher alone leaves the core waiting on memory
// (one core, weights 4x larger than L3: 15.7 against 13.1 GB/s).
//
// With more than one group, each group's pass also asks for its share of the next panel,
// into L2: the next panel's first group then reads from L2 instead of waiting on memory, and
// the memory reads spread over every group's FMAs. At 24-60 rows that makes the layer
// 1.13-1.25x faster (the model's projections, weights read from memory, this Intel host).
//
// Each output is summed over k in order, whatever the number of rows or how they are
// grouped: a row's numbers do not depend on its batch mates.
//
// bf16 runs the same plan on the CPU's bf16 dot product (vdpbf16ps: per fp32 lane, two bf16
// products added into the sum, the odd k then the even one). A panel's k step is then a pair
// of k: for each of its 32 outputs the two weights side by side, so that one 64-byte load
// holds 16 outputs' pairs and a row's pair of values is one 32-bit broadcast. That is half the
// instructions of widening each weight for an fp32 FMA, which kept that version compute-bound
// above a few rows (slower than oneDNN's AMX kernel at 16); bf16 weights are half the bytes
// of fp32 ones, and the layer stays a read of its weight to about 16 rows. Sums are fp32, in
// k order, each output rounded once.
//
// Built by actors/layers/kernels.py.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "vec_math.h"

namespace {

constexpr int64_t kPanel = 32;        // outputs per panel: two 16-float vectors
constexpr int kMaxRows = 12;          // rows per group: 24 accumulators + 2 weights + 1 row value
constexpr int64_t kAhead = 1024;      // floats (4 KB) the loads prefetch ahead of the panel

// y[i][0:cols) = sum over k of x[i][k] * panel[k][0:cols), for i < R.
// `next`, when set, is this group's share of the next panel: `stride` bytes of it per k step.
template <int R>
void panel_rows(const float* x, int64_t ldx, const float* panel, int64_t K, float* y,
                int64_t ldy, int64_t cols, const char* next, int64_t stride) {
  f16v lo[R], hi[R];
  for (int i = 0; i < R; ++i) lo[i] = hi[i] = f16v{};
  for (int64_t k = 0; k < K; ++k) {
    const float* w = panel + k * kPanel;
    __builtin_prefetch(w + kAhead, 0, 3);
    __builtin_prefetch(w + kAhead + 16, 0, 3);
    if (next != nullptr) __builtin_prefetch(next + k * stride, 0, 2);
    const f16v w0 = load(w), w1 = load(w + 16);
    for (int i = 0; i < R; ++i) {
      const float xi = x[i * ldx + k];
      lo[i] += xi * w0;
      hi[i] += xi * w1;
    }
  }
  for (int i = 0; i < R; ++i) {
    if (cols == kPanel) {
      store(y + i * ldy, lo[i]);
      store(y + i * ldy + 16, hi[i]);
    } else {
      float row[kPanel];
      store(row, lo[i]);
      store(row + 16, hi[i]);
      std::memcpy(y + i * ldy, row, cols * sizeof(float));
    }
  }
}

template <int... R>
void run_group(int rows, std::integer_sequence<int, R...>, const float* x, int64_t ldx,
               const float* panel, int64_t K, float* y, int64_t ldy, int64_t cols,
               const char* next, int64_t stride) {
  ((rows == R + 1 ? panel_rows<R + 1>(x, ldx, panel, K, y, ldy, cols, next, stride) : void()),
   ...);
}

#if defined(__AVX512BF16__)
constexpr bool kBf16 = true;

// The bf16 counterpart of panel_rows: `panel` is (K / 2, 64) bf16, pair q holding, for output
// j < 16, weights (2q, 2q + 1) at 2j and 2j + 1, and for output 16 + j at 32 + 2j and 33 + 2j.
template <int R>
void panel_rows_bf16(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* panel,
                     int64_t K, c10::BFloat16* y, int64_t ldy, int64_t cols, const char* next,
                     int64_t stride) {
  constexpr int64_t kAheadPairs = 4096 / 128;  // 4 KB ahead, a pair step being 128 bytes
  __m512 lo[R], hi[R];
  for (int i = 0; i < R; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
  for (int64_t q = 0; q < K / 2; ++q) {
    const c10::BFloat16* w = panel + q * 2 * kPanel;
    __builtin_prefetch(w + kAheadPairs * 2 * kPanel, 0, 3);
    __builtin_prefetch(w + kAheadPairs * 2 * kPanel + 32, 0, 3);
    if (next != nullptr) __builtin_prefetch(next + q * stride, 0, 2);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + 32);
    for (int i = 0; i < R; ++i) {
      int32_t pair;
      std::memcpy(&pair, x + i * ldx + 2 * q, sizeof(pair));
      const __m512bh xi = (__m512bh)_mm512_set1_epi32(pair);
      lo[i] = _mm512_dpbf16_ps(lo[i], xi, w0);
      hi[i] = _mm512_dpbf16_ps(hi[i], xi, w1);
    }
  }
  for (int i = 0; i < R; ++i) {
    float sums[kPanel];
    _mm512_storeu_ps(sums, lo[i]);
    _mm512_storeu_ps(sums + 16, hi[i]);
    for (int64_t j = 0; j < cols; ++j) y[i * ldy + j] = narrow<c10::BFloat16>(sums[j]);
  }
}

template <int... R>
void run_group_bf16(int rows, std::integer_sequence<int, R...>, const c10::BFloat16* x,
                    int64_t ldx, const c10::BFloat16* panel, int64_t K, c10::BFloat16* y,
                    int64_t ldy, int64_t cols, const char* next, int64_t stride) {
  ((rows == R + 1 ? panel_rows_bf16<R + 1>(x, ldx, panel, K, y, ldy, cols, next, stride)
                  : void()),
   ...);
}
#else
constexpr bool kBf16 = false;
#endif

bool panel_linear_bf16() { return kBf16; }

at::Tensor pack_panels_bf16(const at::Tensor& w) {
  TORCH_CHECK(kBf16, "bf16 panels need a CPU with AVX512-BF16");
  const at::Tensor dense = w.contiguous();
  const int64_t N = dense.size(0), K = dense.size(1), panels = (N + kPanel - 1) / kPanel;
  TORCH_CHECK(K % 2 == 0, "bf16 panels need an even number of input features");
  at::Tensor out = at::zeros({panels, K, kPanel}, dense.options());
  const c10::BFloat16* src = dense.data_ptr<c10::BFloat16>();
  c10::BFloat16* dst = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t n = p * kPanel; n < std::min(N, (p + 1) * kPanel); ++n) {
        const int64_t j = n % kPanel, at = (j / 16) * 32 + 2 * (j % 16);
        for (int64_t k = 0; k < K; ++k)
          dst[p * K * kPanel + (k / 2) * 2 * kPanel + at + k % 2] = src[n * K + k];
      }
  });
  return out;
}

at::Tensor pack_panels(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "weight must be (N, K) float32 or bfloat16");
  if (w.scalar_type() == at::kBFloat16) return pack_panels_bf16(w);
  const at::Tensor dense = w.contiguous();
  const int64_t N = dense.size(0), K = dense.size(1), panels = (N + kPanel - 1) / kPanel;
  at::Tensor out = at::zeros({panels, K, kPanel}, dense.options());
  const float* src = dense.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t n = p * kPanel; n < std::min(N, (p + 1) * kPanel); ++n)
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * kPanel + n % kPanel] = src[n * K + k];
  });
  return out;
}

// Runs `group(rows, x, panel, y, cols, next, stride)` for each panel and group of rows. A k
// step of a panel is 128 bytes whatever the dtype (32 fp32 weights, or 32 pairs of bf16 ones),
// `steps` of them per panel.
template <typename T, typename Group>
void over_panels(const at::Tensor& x, const at::Tensor& panels, int64_t n, at::Tensor& y,
                 int64_t steps, const Group& group) {
  const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = panels.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  // Rows in groups of near-equal size, at most kMaxRows each.
  const int64_t groups = (M + kMaxRows - 1) / kMaxRows;
  // Bytes of the next panel each group's k step asks for: the groups share it out. The last
  // group's share may run past the next panel's end (past the tensor's, for the panel before
  // the last): a prefetch never faults.
  const int64_t stride = (kPanel * int64_t{sizeof(float)} + groups - 1) / groups;
  at::parallel_for(0, panels.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const T* panel = wp + p * K * kPanel;
      const int64_t cols = std::min(kPanel, n - p * kPanel);
      const bool ahead = groups > 1 && p + 1 < end;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t first = M * g / groups, last = M * (g + 1) / groups;
        const char* next =
            ahead ? reinterpret_cast<const char*>(panel + K * kPanel) + g * steps * stride
                  : nullptr;
        group(static_cast<int>(last - first), xp + first * ldx, panel,
              yp + first * n + p * kPanel, cols, next, stride);
      }
    }
  });
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be (rows, K) with unit stride");
  TORCH_CHECK(panels.scalar_type() == x.scalar_type() &&
                  (x.scalar_type() == at::kFloat || (kBf16 && x.scalar_type() == at::kBFloat16)),
              "panel_linear takes float32 (or bfloat16 with AVX512-BF16), x and panels alike");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous(),
              "panels must come from pack_panels");
  TORCH_CHECK(panels.size(1) == x.size(1), "x and the weight differ in input features");
  TORCH_CHECK(n > (panels.size(0) - 1) * kPanel && n <= panels.size(0) * kPanel,
              "n does not match the panels");
  const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0);
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0) return y;
  const auto rows = std::make_integer_sequence<int, kMaxRows>{};
  if (x.scalar_type() == at::kFloat) {
    over_panels<float>(x, panels, n, y, K,
                       [&](int m, const float* xr, const float* panel, float* yr, int64_t cols,
                           const char* next, int64_t stride) {
                         run_group(m, rows, xr, ldx, panel, K, yr, n, cols, next, stride);
                       });
  } else {
#if defined(__AVX512BF16__)
    using bf16 = c10::BFloat16;
    over_panels<bf16>(x, panels, n, y, K / 2,
                      [&](int m, const bf16* xr, const bf16* panel, bf16* yr, int64_t cols,
                          const char* next, int64_t stride) {
                        run_group_bf16(m, rows, xr, ldx, panel, K, yr, n, cols, next, stride);
                      });
#endif
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n && bias->scalar_type() == x.scalar_type(),
                "bias must be (n,) of x's dtype");
    y.add_(bias->view({1, n}));
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(serve_app, m) {
  m.def("pack_panels(Tensor w) -> Tensor");
  m.def("panel_linear_bf16() -> bool", panel_linear_bf16);
  m.def("panel_linear(Tensor x, Tensor panels, int n, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(serve_app, CPU, m) {
  m.impl("pack_panels", pack_panels);
  m.impl("panel_linear", panel_linear);
}
