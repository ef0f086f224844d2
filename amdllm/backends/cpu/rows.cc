// A few rows of float32 activations (up to 64) times a bfloat16 weight matrix, reading the weights as they
// lie: a decode step's products, whose speed is the rate at which the weights are read. XLA:CPU widens
// bf16 weights to float32 first, a copy per layer per token; here each weight is widened in a register on
// its way into a float32 fused multiply-add: half the bytes of a float32 product, the same sums.
//
// Two layouts, both [rows of x] x K -> N:
//   bf16_rows_kn: W [K, N] (amdllm's [in, out] kernels). W's rows are cut into contiguous bands, each with
//                 its own [M, N] partial sums, so every thread streams its memory in order.
//   bf16_rows_nk: W [N, K] (a tied head's embedding table [V, D]). Each thread takes a band of W's rows.
// The threads are XLA's own intra-op pool (the FFI's ThreadPool; pool.h); the calling thread works too.
// Built by amdllm/backends/cpu/native.py with the host compiler (-O3 -march=native).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>

#include "pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace amdllm_native;  // pool.h

constexpr int64_t kMaxRows = 64;  // native.py MAX_ROWS
constexpr int64_t kSubBand = 16;  // rows of W that kn_any's groups of x rows share (256 KB at N = 8192: L2)

// f(std::integral_constant<int, m>) for the m (1 <= m <= Max) given at run time: a kernel templated on its
// number of rows, chosen per call.
template <int Max, class F>
static void with_rows(int64_t m, F&& f) {
  if constexpr (Max > 1)
    if (m < Max) return with_rows<Max - 1>(m, f);
  f(std::integral_constant<int, Max>{});
}

static inline float widen(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// y[M, N] += x[M, k0:k1] . W[k0:k1, N] for M <= 5: four rows of W (eight for one row of x) fused per
// pass over y, each weight widened once into the M running sums. No software prefetch: the rows are read in
// order, which the hardware prefetchers follow; on a 2-core EPYC (AVX2) prefetching the next rows by hand
// cost a fifth of the bandwidth (docs/benchmark-history.md, "the row kernel on AVX2").
template <int M, int R = (M == 1 ? 8 : 4)>
static void kn_chain(const float* x, const uint16_t* w, float* y, int64_t K, int64_t N, int64_t k0, int64_t k1) {
  int64_t k = k0;
  for (; k + R <= k1; k += R) {
    const uint16_t* r = w + k * N;
    float a[M][R];
    for (int m = 0; m < M; ++m)
      for (int i = 0; i < R; ++i) a[m][i] = x[m * K + k + i];
    for (int64_t j = 0; j < N; ++j) {
      float wv[R];
      for (int i = 0; i < R; ++i) wv[i] = widen(r[i * N + j]);
      for (int m = 0; m < M; ++m) {
        float s = y[m * N + j];
        for (int i = 0; i < R; ++i) s += a[m][i] * wv[i];
        y[m * N + j] = s;
      }
    }
  }
  for (; k < k1; ++k) {
    const uint16_t* r = w + k * N;
    for (int m = 0; m < M; ++m)
      for (int64_t j = 0; j < N; ++j) y[m * N + j] += x[m * K + k] * widen(r[j]);
  }
}

// f(rows, g) for the M rows of x in groups of up to G: rows (an integral_constant) in the group at row g.
template <int G, class F>
static void in_groups(int64_t M, F&& f) {
  for (int64_t g = 0; g < M; g += G) with_rows<G>(std::min<int64_t>(G, M - g), [&](auto rows) { f(rows, g); });
}

// y[M, N] += x[M, k0:k1] @ W[k0:k1, N] for any M: groups of up to 5 rows of x through kn_chain (from 6 rows
// the compiler no longer keeps kn_chain's widened weights and factors in registers: 2.4 GB/s), kSubBand
// rows of W at a time, so that every group after the first reads them from L2 rather than from memory.
static void kn_any(const float* x, const uint16_t* w, float* y, int64_t M, int64_t K, int64_t N, int64_t k0,
                   int64_t k1) {
  const int64_t band = M <= 5 ? k1 - k0 : kSubBand;  // one group: the whole range at once
  for (int64_t s = k0; s < k1; s += band) {
    const int64_t e = std::min(k1, s + band);
    in_groups<5>(M, [&](auto rows, int64_t g) { kn_chain<rows()>(x + g * K, w, y + g * N, K, N, s, e); });
  }
}

// y[0, n0:n1] = x[0, K] . W[n0:n1, K]^T: four rows of W share each load of x, 16 lanes of sums each.
static void nk_one(const float* x, const uint16_t* w, float* y, int64_t K, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    const uint16_t* r = w + n * K;
    float s0[16] = {}, s1[16] = {}, s2[16] = {}, s3[16] = {};
    int64_t d = 0;
    for (; d + 16 <= K; d += 16)
      for (int l = 0; l < 16; ++l) {
        const float xv = x[d + l];
        s0[l] += widen(r[d + l]) * xv;
        s1[l] += widen(r[K + d + l]) * xv;
        s2[l] += widen(r[2 * K + d + l]) * xv;
        s3[l] += widen(r[3 * K + d + l]) * xv;
      }
    float s[4] = {};
    for (int l = 0; l < 16; ++l) {
      s[0] += s0[l]; s[1] += s1[l]; s[2] += s2[l]; s[3] += s3[l];
    }
    for (int i = 0; i < 4; ++i) {
      for (int64_t e = d; e < K; ++e) s[i] += widen(r[i * K + e]) * x[e];
      y[n + i] = s[i];
    }
  }
  for (; n < n1; ++n) {
    float s = 0.f;
    for (int64_t d = 0; d < K; ++d) s += widen(w[n * K + d]) * x[d];
    y[n] = s;
  }
}

// y[M, n0:n1] = x[M, K] . W[n0:n1, K]^T for M <= 8 (`nk_any` takes more rows 8 at a time).
template <int M>
static void nk_rows(const float* x, const uint16_t* w, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* r = w + n * K;
    float s[M][16] = {};
    int64_t d = 0;
    for (; d + 16 <= K; d += 16) {
      float wf[16];
      for (int l = 0; l < 16; ++l) wf[l] = widen(r[d + l]);
      for (int m = 0; m < M; ++m)
        for (int l = 0; l < 16; ++l) s[m][l] += wf[l] * x[m * K + d + l];
    }
    for (int m = 0; m < M; ++m) {
      float t = 0.f;
      for (int l = 0; l < 16; ++l) t += s[m][l];
      for (int64_t e = d; e < K; ++e) t += widen(r[e]) * x[m * K + e];
      y[m * N + n] = t;
    }
  }
}


// y[M, n0:n1] = x[M, K] . W[n0:n1, K]^T for any M.
static void nk_any(const float* x, const uint16_t* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0,
                   int64_t n1) {
  if (M == 1) return nk_one(x, w, y, K, n0, n1);
  in_groups<8>(M, [&](auto rows, int64_t g) { nk_rows<rows()>(x + g * K, w, y + g * N, K, N, n0, n1); });
}

static int64_t chunk_rows(int64_t n, int64_t threads) {  // about 4 chunks a thread, a multiple of 8 rows
  return std::max<int64_t>(64, ((n + 4 * threads - 1) / (4 * threads) + 7) / 8 * 8);
}

// M, K, N of x [M, K] times W ([K, N], or [N, K] if transposed) into y [M, N] (y_count elements), with 1 <= M
// <= max_rows; false if the shapes are not so.
template <class W>
static bool shapes(const ffi::Buffer<ffi::F32>& x, const W& w, int64_t y_count, bool transposed, int64_t& M,
                   int64_t& K, int64_t& N, int64_t max_rows = kMaxRows) {
  if (w.dimensions().size() != 2) return false;
  K = w.dimensions()[transposed ? 1 : 0];
  N = w.dimensions()[transposed ? 0 : 1];
  M = K ? int64_t(x.element_count()) / K : 0;
  return 1 <= M && M <= max_rows && M * K == int64_t(x.element_count()) && y_count == M * N;
}

// y[i] += part[p * count + i] for p = 0, 1, ..., parts - 1 in that order (each band's partial sums, added
// in band order: the same numbers whichever thread ran which band). With helpers, ranges of y in parallel.
static void add_parts(ffi::ThreadPool& pool, int64_t helpers, float* y, const float* part, int64_t parts,
                      int64_t count) {
  const int64_t per = std::max<int64_t>(4096, (count + helpers) / (helpers + 1));
  in_parallel(pool, helpers, (count + per - 1) / per, [&](int64_t c) {
    const int64_t i0 = c * per, i1 = std::min(count, i0 + per);
    for (int64_t p = 0; p < parts; ++p)
      for (int64_t i = i0; i < i1; ++i) y[i] += part[p * count + i];
  });
}

static ffi::Error RowsKn(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U16> w,
                         ffi::ResultBuffer<ffi::F32> y) {
  int64_t M, K, N;
  if (!shapes(x, w, int64_t(y->element_count()), false, M, K, N))
    return ffi::Error::InvalidArgument("bf16_rows_kn: W must be 2-D [K, N], x [M, K] with 1 <= M <= 64, y [M, N]");
  const float* xp = x.typed_data();
  const uint16_t* wp = w.typed_data();
  float* yp = y->typed_data();
  const int64_t h = helpers(pool), per = chunk_rows(K, h + 1), chunks = (K + per - 1) / per;
  // Each chunk of W's rows sums into its own [M, N], added up in chunk order afterwards: which thread runs a
  // chunk varies from call to call, and the sums (so greedy decoding's ties) must not.
  // (Left unset here: each chunk zeroes its own, on the thread that then fills it.)
  std::unique_ptr<float[]> part(new float[(chunks - 1) * M * N]);
  in_parallel(pool, h, chunks, [&](int64_t c) {
    const int64_t k0 = c * per, k1 = std::min(K, k0 + per);
    float* out = c == 0 ? yp : part.get() + (c - 1) * M * N;
    std::fill(out, out + M * N, 0.f);
    kn_any(xp, wp, out, M, K, N, k0, k1);
  });
  add_parts(pool, 0, yp, part.get(), chunks - 1, M * N);
  return ffi::Error::Success();
}

static ffi::Error RowsNk(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U16> w,
                         ffi::ResultBuffer<ffi::F32> y) {
  int64_t M, K, N;
  if (!shapes(x, w, int64_t(y->element_count()), true, M, K, N))
    return ffi::Error::InvalidArgument("bf16_rows_nk: W must be 2-D [N, K], x [M, K] with 1 <= M <= 64, y [M, N]");
  const float* xp = x.typed_data();
  const uint16_t* wp = w.typed_data();
  float* yp = y->typed_data();
  const int64_t h = helpers(pool), per = chunk_rows(N, h + 1), chunks = (N + per - 1) / per;
  in_parallel(pool, h, chunks, [&](int64_t c) {
    const int64_t n0 = c * per, n1 = std::min(N, n0 + per);
    nk_any(xp, wp, yp, M, K, N, n0, n1);
  });
  return ffi::Error::Success();
}

// The handlers: float32 x, W of `wtype` (bf16 bits or float32), float32 y; XLA's intra-op pool for threads.
#define AMDLLM_ROWS_HANDLER(symbol, fn, wtype)                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, fn,                     \
                                ffi::Ffi::Bind()                \
                                    .Ctx<ffi::ThreadPool>()     \
                                    .Arg<ffi::Buffer<ffi::F32>>() \
                                    .Arg<ffi::Buffer<wtype>>()  \
                                    .Ret<ffi::Buffer<ffi::F32>>());
AMDLLM_ROWS_HANDLER(Bf16RowsKn, RowsKn, ffi::U16)
AMDLLM_ROWS_HANDLER(Bf16RowsNk, RowsNk, ffi::U16)


