// Small math the kernels share, written as plain arithmetic so the loops calling it vectorize.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <c10/util/BFloat16.h>

// Storage dtype <-> fp32 inside the kernels' loops. c10's bf16 rounding branches on NaN, which
// keeps GCC from vectorizing a loop that calls it (the fused ops' bf16 loops ran 9-14x slower
// than fp32); the bf16 pair gives the same bits (round to nearest even, any NaN to 0x7FC0) as
// selects.
template <typename T>
inline float widen(T v) {
  return static_cast<float>(v);
}
template <typename T>
inline T narrow(float f) {
  return static_cast<T>(f);
}
template <>
inline float widen(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
template <>
inline c10::BFloat16 narrow(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const auto rounded = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return c10::BFloat16(std::isnan(f) ? uint16_t{0x7FC0} : rounded, c10::BFloat16::from_bits());
}

// One register of floats: 16 with AVX-512, 8 with AVX2, 4 elsewhere. The kernels' vector
// loops are written in this width. A wider GCC vector than the unit has is lowered badly: on
// an AVX2 host a 16-float vector was two registers, and each scalar-times-vector broadcast and
// each sum went through the stack (the panel kernel ran at 4.4 GFLOP/s there, a twentieth of
// what the same loop makes in this width).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
typedef float fnv __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t inv __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t unv __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef uint16_t hnv __attribute__((vector_size(kLanes * sizeof(uint16_t))));

// kLanes values of a storage dtype, widened to fp32, and back (narrow's rounding, lane-wise).
template <typename T>
inline fnv load_n(const T* p) {
  fnv v;
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(&v, p, sizeof(v));
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    hnv h;
    std::memcpy(&h, p, sizeof(h));
    const unv bits = __builtin_convertvector(h, unv) << 16;
    std::memcpy(&v, &bits, sizeof(v));
  } else {
    for (int i = 0; i < kLanes; ++i) v[i] = widen(p[i]);
  }
  return v;
}

template <typename T>
inline void store_n(T* p, fnv v) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(p, &v, sizeof(v));
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    unv u;
    std::memcpy(&u, &v, sizeof(u));
    unv rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    rounded = v != v ? unv{} + 0x7FC0u : rounded;
    const hnv h = __builtin_convertvector(rounded, hnv);
    std::memcpy(p, &h, sizeof(h));
  } else {
    for (int i = 0; i < kLanes; ++i) p[i] = narrow<T>(v[i]);
  }
}

// An empty asm that takes v in a register: GCC can neither fold a load of v into the
// instructions using it nor fuse the arithmetic that made v into them (no FMA contraction).
inline void in_register(fnv& v) {
#if defined(__x86_64__)
  asm("" : "+x"(v));
#elif defined(__aarch64__)
  asm("" : "+w"(v));
#endif
}

// acc[i][v] += s[i] * w[v * kLanes ...] for R scalars and V vectors at w: the step of the
// register-blocked loops (panel linear, prefill attention, decode attention's values). With
// AVX-512's 32 registers the V weight vectors are loaded first and each scalar broadcast
// as it is used. With 16 registers the R scalars are broadcast first and each weight vector
// loaded once for all R: GCC otherwise folds the load into every FMA, a load per FMA, and
// the loads set the pace (the panel kernel: 65 against 90 GFLOP/s on an AVX2 core).
template <int R, int V, typename T>
inline void fma_block(fnv (&acc)[R][V], const float (&s)[R], const T* w) {
#if defined(__AVX512F__)
  fnv wv[V];
  for (int v = 0; v < V; ++v) wv[v] = load_n(w + v * kLanes);
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < V; ++v) acc[i][v] += s[i] * wv[v];
#else
  for (int v = 0; v < V; ++v) {
    fnv wv = load_n(w + v * kLanes);
    in_register(wv);
    for (int i = 0; i < R; ++i) acc[i][v] += s[i] * wv;
  }
#endif
}

inline float sum_n(fnv v) {
  float total = 0.0f;
  for (int l = 0; l < kLanes; ++l) total += v[l];
  return total;
}

// exp(x) / 2^n for n = round(x / ln 2): Cody-Waite reduction to r = x - n ln 2 and a degree-6
// polynomial in r. V is a float or an fnv (lane-wise, the same steps).
template <typename V>
inline V exp_reduced(V x, V n) {
  const V r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// exp(x) to about 2 ulp for x in [-87, 88] (clamped outside): Cody-Waite range reduction and
// a degree-6 polynomial.
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float y = exp_reduced(x, n);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// fast_exp over a register of lanes, the same steps and numbers. Loops that call the scalar
// one under `#pragma omp simd` stay scalar on AVX2 where the clamp's branches are threaded
// through the loop ("control flow in loop"): softmax with a masked tail, silu.
inline fnv fast_exp_n(fnv x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  // Round to nearest even, as nearbyint in the default mode: exact for |n| < 2^22. The
  // product is rounded first, as the scalar one's (not fused into the add).
  fnv t = x * 1.44269504088896341f;
  in_register(t);
  const fnv n = (t + 12582912.0f) - 12582912.0f;
  const fnv y = exp_reduced(x, n);
  const inv bits = (__builtin_convertvector(n, inv) + 127) << 23;
  fnv scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// The largest of s[0, n), or -inf when n is 0. Written as a comparison rather than std::max,
// whose NaN ordering keeps the compiler from vectorizing the reduction: with std::max this
// loop ran one lane at a time, four cycles an element, as long as the rest of a prefill
// attention tile together.
inline float max_of(const float* s, int64_t n) {
  float top = -INFINITY;
#pragma omp simd reduction(max : top)
  for (int64_t i = 0; i < n; ++i) top = s[i] > top ? s[i] : top;
  return top;
}
