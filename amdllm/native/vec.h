// Float32 vectors of the build's width (GCC vector extensions: 16 lanes with AVX-512, 8 otherwise; -O3
// -march=native turns their arithmetic into the CPU's vector instructions), and `with_rows`, for the
// kernels in this folder.
#pragma once

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

inline vf splat(float f) { return vf{} + f; }  // f in every lane (one broadcast instruction)

// f(std::integral_constant<int, m>) for the m (1 <= m <= Max) given at run time: a kernel templated on its
// number of rows, chosen per call.
template <int Max, class F>
void with_rows(int64_t m, F&& f) {
  if constexpr (Max > 1)
    if (m < Max) return with_rows<Max - 1>(m, f);
  f(std::integral_constant<int, Max>{});
}

}  // namespace amdllm_native
