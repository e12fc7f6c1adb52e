// Linear layers at decode batch sizes (a few rows), for CPU fp32.
//
//   pack_panels(w)                     (N, K) -> (ceil(N / 32), K, 32): each panel holds 32
//                                      output features, k-major, zero-padded past N
//   panel_linear(x, panels, n, bias)   y = x W^T (+ bias) for x (rows, K), y (rows, n)
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
// Built by actors/layers/kernels.py.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>

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

at::Tensor pack_panels(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "weight must be (N, K) float32");
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

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be (rows, K) with unit stride");
  TORCH_CHECK(x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat,
              "panel_linear is float32");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous(),
              "panels must come from pack_panels");
  TORCH_CHECK(panels.size(1) == x.size(1), "x and the weight differ in input features");
  TORCH_CHECK(n > (panels.size(0) - 1) * kPanel && n <= panels.size(0) * kPanel,
              "n does not match the panels");
  const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0);
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Rows in groups of near-equal size, at most kMaxRows each.
  const int64_t groups = (M + kMaxRows - 1) / kMaxRows;
  // Bytes of the next panel each group's k step asks for: the groups share it out. The last
  // group's share may run past the next panel's end (past the tensor's, for the panel before
  // the last): a prefetch never faults.
  const int64_t stride = (kPanel * sizeof(float) + groups - 1) / groups;
  at::parallel_for(0, panels.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* panel = wp + p * K * kPanel;
      const int64_t cols = std::min(kPanel, n - p * kPanel);
      const bool ahead = groups > 1 && p + 1 < end;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t first = M * g / groups, last = M * (g + 1) / groups;
        const char* next =
            ahead ? reinterpret_cast<const char*>(panel + K * kPanel) + g * K * stride : nullptr;
        run_group(static_cast<int>(last - first), std::make_integer_sequence<int, kMaxRows>{},
                  xp + first * ldx, ldx, panel, K, yp + first * n + p * kPanel, n, cols, next,
                  stride);
      }
    }
  });
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n && bias->scalar_type() == at::kFloat, "bias must be (n,)");
    y.add_(bias->view({1, n}));
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(serve_app, m) {
  m.def("pack_panels(Tensor w) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor panels, int n, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(serve_app, CPU, m) {
  m.impl("pack_panels", pack_panels);
  m.impl("panel_linear", panel_linear);
}
