// Small math the kernels share, written as plain arithmetic so the loops calling it vectorize.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>

// Sixteen floats as one value: the compiler maps it onto the vector unit it has (one AVX-512
// register, two AVX2 ones).
typedef float f16v __attribute__((vector_size(64)));
typedef float f8v __attribute__((vector_size(32)));
typedef float f4v __attribute__((vector_size(16)));

inline f16v load(const float* p) {
  f16v v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, f16v v) { std::memcpy(p, &v, sizeof(v)); }

// A pairwise sum of the lanes (a strictly ordered one would chain sixteen additions).
inline float sum_lanes(f16v v) {
  const f8v a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f4v b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// exp(x) to about 2 ulp for x in [-87, 88] (clamped outside): Cody-Waite range reduction and
// a degree-6 polynomial.
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
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
