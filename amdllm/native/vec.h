// Float32 vectors of the build's width (GCC vector extensions: 16 lanes with AVX-512, 8 otherwise; -O3
// -march=native turns their arithmetic into the CPU's vector instructions), their exp, horizontal max
// and sum and a row's max, and `with_rows`, for the kernels in this folder.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace amdllm_native {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vf __attribute__((vector_size(kLanes * 4)));
typedef int32_t vi __attribute__((vector_size(kLanes * 4)));

inline vf load_v(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store_v(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// f in every lane: one broadcast, from memory where f is. Not vf{} + f: 0 + f is not f for f = -0, so the
// compiler must add first (an add and a register broadcast on the FMA's port, per splat); f - 0 is f.
inline vf splat(float f) { return f - vf{}; }

// f(std::integral_constant<int, m>) for the m (1 <= m <= Max) given at run time: a kernel templated on its
// number of rows, chosen per call.
template <int Max, class F>
void with_rows(int64_t m, F&& f) {
  if constexpr (Max > 1)
    if (m < Max) return with_rows<Max - 1>(m, f);
  f(std::integral_constant<int, Max>{});
}

// exp(x) for a vector, x <= 0 (a score or a logit minus its row's max); below -87.3 (2^-126) it is 0. Cephes'
// expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-7 polynomial for exp(r), times 2^n. About 1 ulp.
inline vf vexp(vf x) {
  const vf lo = splat(-87.33654f);
  const vi under = x < lo;
  x = under ? lo : x;
  const vf n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest (0x1.8p23)
  const vf r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  const vf y = p * (vf)bits;
  return under ? vf{} : y;
}

inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
}

// The sum of v's lanes, halves added pairwise (log2(kLanes) shuffles and adds): added one lane at a time
// it is a chain of kLanes dependent adds, which the compiler may not reorder (a decode step's attention
// spent a fifth of its time in them, one per query row and cached key).
inline float hsum(vf v) {
  typedef float h8 __attribute__((vector_size(32)));
  typedef float h4 __attribute__((vector_size(16)));
#if defined(__AVX512F__)
  const h8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const h8 a = v;  // 8 lanes
#endif
  const h4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// The largest of row[0..n).
inline float max_row(const float* row, int64_t n) {
  vf m = splat(-INFINITY);
  int64_t s = 0;
  for (; s + kLanes <= n; s += kLanes) {
    const vf v = load_v(row + s);
    m = v > m ? v : m;
  }
  float t = hmax(m);
  for (; s < n; ++s) t = std::max(t, row[s]);
  return t;
}

}  // namespace amdllm_native
