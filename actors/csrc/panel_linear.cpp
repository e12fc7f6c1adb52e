// Linear layers at decode batch sizes (a few rows), for CPU fp32, and bf16 where the CPU has
// AMX.
//
//   pack_panels(w)                     (N, K) -> (ceil(N / 32), K, 32): each panel holds 32
//                                      output features, k-major, zero-padded past N (bf16:
//                                      k in pairs, see below)
//   panel_linear(x, panels, n, bias)   y = x W^T (+ bias) for x (rows, K), y (rows, n)
//   panel_linear_bf16()                whether this build and CPU take bf16
//
// With a few rows a linear layer is a read of its weight: 2 FLOPs per row per weight read.
// Laid out in panels, the weight is read once, front to back, each 128-byte step of a panel
// feeding up to 12 rows x 32 outputs of FMAs (24 accumulators, the broadcast row values from
// L1; with AVX2's 16 registers, 3 rows x 4 vectors). Further rows run in further groups over
// the same panel, then in L2. The loads ask
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
// bf16 runs on AMX: a panel's 32 outputs for up to 16 rows are two 16 x 16 fp32 tiles, fed 32
// k at a time by a tile of the rows' values and two tiles of the panel's weights. A panel's k
// step is then a pair of k, each output's two weights side by side (AMX's layout for its
// second operand), 16 pairs of one tile 128 bytes apart. The tiles' loads ask for the panel's
// bytes 8 KB ahead. Sums are fp32 and each output is rounded to bf16 once; a row's numbers
// do not depend on its batch mates. oneDNN's bf16 inner product runs on AMX too, but leaves the
// core waiting on memory at these sizes. Without AMX (or where Linux refuses its tile state)
// bf16 keeps oneDNN: the CPU's bf16 dot product alone (AVX512-BF16) ran at the fp32 FMA's
// rate here, compute-bound past 4 rows.
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
#include <type_traits>
#include <utility>

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "vec_math.h"

namespace {

constexpr int64_t kPanel = 32;        // outputs per panel: 128 bytes
constexpr int kVecs = kPanel / kLanes;  // registers (vec_math.h's fnv) a row's panel sums take
// Rows per group, their sums in registers beside a panel step's weights (AVX-512: 12 rows x
// 2 vectors of 32 registers) or its row values (AVX2: 3 x 4 of 16; see fma_block).
constexpr int kMaxRows = kLanes == 16 ? 12 : 3;
constexpr int64_t kAhead = 1024;      // floats (4 KB) the loads prefetch ahead of the panel

// y[i][0:cols) = sum over k of x[i][k] * panel[k][0:cols), for i < R.
// `next`, when set, is this group's share of the next panel: `stride` bytes of it per k step.
template <int R>
void panel_rows(const float* x, int64_t ldx, const float* panel, int64_t K, float* y,
                int64_t ldy, int64_t cols, const char* next, int64_t stride) {
  fnv acc[R][kVecs];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < kVecs; ++v) acc[i][v] = fnv{};
  for (int64_t k = 0; k < K; ++k) {
    const float* w = panel + k * kPanel;
    __builtin_prefetch(w + kAhead, 0, 3);
    __builtin_prefetch(w + kAhead + 16, 0, 3);
    if (next != nullptr) __builtin_prefetch(next + k * stride, 0, 2);
    float xs[R];
    for (int i = 0; i < R; ++i) xs[i] = x[i * ldx + k];
    fma_block(acc, xs, w);
  }
  for (int i = 0; i < R; ++i) {
    float row[kPanel];
    float* out = cols == kPanel ? y + i * ldy : row;
    for (int v = 0; v < kVecs; ++v) store_n(out + v * kLanes, acc[i][v]);
    if (cols < kPanel) std::memcpy(y + i * ldy, row, cols * sizeof(float));
  }
}

template <int... R>
void run_group(int rows, std::integer_sequence<int, R...>, const float* x, int64_t ldx,
               const float* panel, int64_t K, float* y, int64_t ldy, int64_t cols,
               const char* next, int64_t stride) {
  ((rows == R + 1 ? panel_rows<R + 1>(x, ldx, panel, K, y, ldy, cols, next, stride) : void()),
   ...);
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands out AMX's tile state on request, once per process.
bool amx_ready() {
  static const bool ready = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                    18 /* XFEATURE_XTILEDATA */) == 0;
  return ready;
}

// Tiles: 0, 1 the sums; 2 the rows' values and 3, 4 the panel's pairs for a full 32 k; 5, 6, 7
// the same for the last `tail` k (tail < 32, even).
void configure(int m, int64_t tail) {
  TileConfig c;
  for (int t : {0, 1, 2}) c.rows[t] = m, c.colsb[t] = 64;
  for (int t : {3, 4}) c.rows[t] = 16, c.colsb[t] = 64;
  if (tail > 0) {
    c.rows[5] = m, c.colsb[5] = static_cast<uint16_t>(tail * 2);
    for (int t : {6, 7}) c.rows[t] = static_cast<uint8_t>(tail / 2), c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

void panel_rows_amx(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* panel, int64_t K,
                    c10::BFloat16* y, int64_t ldy, int m, int64_t cols) {
  const int64_t xs = ldx * 2;  // bytes between rows of x
  _tile_zero(0);
  _tile_zero(1);
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const c10::BFloat16* w = panel + k * kPanel;  // pair k / 2, 64 bf16 a pair
    // The panel's bytes 8 KB ahead: 2 KB (32 lines) for each 2 KB of pairs read.
    const c10::BFloat16* ahead = w + 4 * 32 * kPanel;
    for (int line = 0; line < 32; ++line) __builtin_prefetch(ahead + line * 32, 0, 3);
    _tile_loadd(2, x + k, xs);
    _tile_loadd(3, w, 128);
    _tile_loadd(4, w + 32, 128);
    _tile_dpbf16ps(0, 2, 3);
    _tile_dpbf16ps(1, 2, 4);
  }
  if (k < K) {
    const c10::BFloat16* w = panel + k * kPanel;
    _tile_loadd(5, x + k, xs);
    _tile_loadd(6, w, 128);
    _tile_loadd(7, w + 32, 128);
    _tile_dpbf16ps(0, 5, 6);
    _tile_dpbf16ps(1, 5, 7);
  }
  float sums[16 * kPanel];
  _tile_stored(0, sums, kPanel * 4);
  _tile_stored(1, sums + 16, kPanel * 4);
  for (int i = 0; i < m; ++i)
    for (int64_t j = 0; j < cols; ++j)
      y[i * ldy + j] = narrow<c10::BFloat16>(sums[i * kPanel + j]);
}

void amx_product(const at::Tensor& x, const at::Tensor& panels, int64_t n, at::Tensor& y) {
  using bf16 = c10::BFloat16;
  const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0);
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* wp = panels.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  const int64_t groups = (M + 15) / 16;
  at::parallel_for(0, panels.size(0), 1, [&](int64_t begin, int64_t end) {
    int configured = -1;  // the thread's tiles are configured per call: oneDNN sets its own
    for (int64_t p = begin; p < end; ++p) {
      const bf16* panel = wp + p * K * kPanel;
      const int64_t cols = std::min(kPanel, n - p * kPanel);
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t first = M * g / groups, last = M * (g + 1) / groups;
        const int m = static_cast<int>(last - first);
        if (m != configured) configure(configured = m, K % 32);
        panel_rows_amx(xp + first * ldx, ldx, panel, K, yp + first * n + p * kPanel, n, m, cols);
      }
    }
    _tile_release();
  });
}
#endif

bool panel_linear_bf16() {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  return amx_ready();
#else
  return false;
#endif
}

// Where weight k of output j lies in its panel (K k steps of 32): fp32 k-major; bf16 in
// pairs of k, outputs j and 16 + j's pairs in the two 64-byte halves of a pair step.
template <typename T>
int64_t panel_slot(int64_t k, int64_t j) {
  if constexpr (std::is_same_v<T, float>) return k * kPanel + j;
  return (k / 2) * 2 * kPanel + (j / 16) * 32 + 2 * (j % 16) + k % 2;
}

template <typename T>
void pack_into(const at::Tensor& dense, at::Tensor& out) {
  const int64_t N = dense.size(0), K = dense.size(1);
  const T* src = dense.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, out.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t n = p * kPanel; n < std::min(N, (p + 1) * kPanel); ++n)
        for (int64_t k = 0; k < K; ++k)
          dst[p * K * kPanel + panel_slot<T>(k, n % kPanel)] = src[n * K + k];
  });
}

at::Tensor pack_panels(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "weight must be (N, K) float32 or bfloat16");
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  TORCH_CHECK(!bf16 || panel_linear_bf16(), "bf16 panels need a CPU with AMX (AMX-BF16)");
  TORCH_CHECK(!bf16 || w.size(1) % 2 == 0, "bf16 panels need an even number of input features");
  const at::Tensor dense = w.contiguous();
  at::Tensor out = at::zeros({(dense.size(0) + kPanel - 1) / kPanel, dense.size(1), kPanel},
                             dense.options());
  if (bf16)
    pack_into<c10::BFloat16>(dense, out);
  else
    pack_into<float>(dense, out);
  return out;
}

at::Tensor add_bias(at::Tensor& y, const std::optional<at::Tensor>& bias, int64_t n) {
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n && bias->scalar_type() == y.scalar_type(),
                "bias must be (n,) of x's dtype");
    y.add_(bias->view({1, n}));
  }
  return y;
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be (rows, K) with unit stride");
  const bool bf16 = x.scalar_type() == at::kBFloat16 && panel_linear_bf16();
  TORCH_CHECK(panels.scalar_type() == x.scalar_type() && (x.scalar_type() == at::kFloat || bf16),
              "panel_linear takes float32 (or bfloat16 with AMX), x and panels alike");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous(),
              "panels must come from pack_panels");
  TORCH_CHECK(panels.size(1) == x.size(1), "x and the weight differ in input features");
  TORCH_CHECK(n > (panels.size(0) - 1) * kPanel && n <= panels.size(0) * kPanel,
              "n does not match the panels");
  const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0);
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0) return y;
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  if (bf16) {
    amx_product(x, panels, n, y);
    return add_bias(y, bias, n);
  }
#endif
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
  return add_bias(y, bias, n);
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
