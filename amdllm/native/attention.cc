// Causal grouped-query attention in float32, forward and backward (flash-attention style), for training and
// prefill on a CPU: `amdllm.model.fast.causal_attention`'s native route.
//
// Why: XLA:CPU ran the blocked attention of the 31M benchmark model's LoRA step (batch 8 x 256, 8 heads over
// 2 kv heads, head size 64) at about 40 ms a layer forward and backward, a fifth of the step: its batched
// dots reach half the matmul rate, and about a third of the time went to copies that put each block's
// operands in the layout a dot wants. Here each (sequence, kv head) pair is one piece of work: its keys and
// values are packed once, then every query block's products run from the L2 cache through one register-
// blocked routine (`gemm`), and the softmax works on rows that are still in cache.
//
// The layout is the model's: q [B, T, H, hd], k and v [B, T, Hkv, hd], mask [B, T, T] (bool; true: query t
// sees key s), with H = Hkv * G. A query block of positions [a, e) computes keys 0..e only: the mask must be
// causal (no key after its query), as in `causal_attention`. A masked score is -1e30 (finite), so a row whose
// keys are all masked (padding) gets uniform weights, as the XLA version gives it. The forward also returns
// lse [B, H, T] (the log of each row's softmax denominator, the row max included), which the backward uses
// to recompute the probabilities instead of keeping them.
//
// Threads: XLA's intra-op pool (pool.h), one thread per core (the caller and pool threads - 1).
// Built by amdllm/native/__init__.py with -O3 -march=native: 16 float32 lanes with AVX-512, 8 with AVX2.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "pool.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace amdllm_native;  // pool.h, vec.h

constexpr int kRowsPer = 6;  // a block of 6 rows x kVecsPer vectors of sums in registers
#if defined(__AVX512F__)
constexpr int kVecsPer = 4;  // 24 of the 32 zmm registers
#else
constexpr int kVecsPer = 2;  // 12 of the 16 ymm registers
#endif
constexpr float kMasked = -1e30f;  // amdllm.model.attention.NEG_INF
constexpr int64_t kAhead = 16;  // cached_attention: keys fetched this many slots ahead

// ---------------------------------------------------------------------------------------------------------
// y[M, N] (+)= x[M, K] . w[K, N]: x's element (m, k) at x[m * xm + k * xk] (so x may be read transposed),
// w's row k at w + k * ldw, y's row m at y + m * ldy. Blocks of kRowsPer rows by kVecsPer vectors of
// columns keep their sums in registers for the whole K (K here is at most a sequence or a head size).
template <int M, int C>
static inline void gemm_block(const float* x, int64_t xm, int64_t xk, const float* w, int64_t ldw, float* y,
                              int64_t ldy, int64_t K, int64_t j, bool acc) {
  vf a[M][C];
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < C; ++c) a[m][c] = acc ? load_v(y + m * ldy + j + c * kLanes) : vf{};
  for (int64_t k = 0; k < K; ++k) {
    const float* r = w + k * ldw + j;
    vf wv[C];
    for (int c = 0; c < C; ++c) wv[c] = load_v(r + c * kLanes);
    for (int m = 0; m < M; ++m) {
      const vf xv = splat(x[m * xm + k * xk]);
      for (int c = 0; c < C; ++c) a[m][c] += xv * wv[c];
    }
  }
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < C; ++c) store_v(y + m * ldy + j + c * kLanes, a[m][c]);
}

template <int M>
static void gemm_rows(const float* x, int64_t xm, int64_t xk, const float* w, int64_t ldw, float* y, int64_t ldy,
                      int64_t K, int64_t N, bool acc) {
  int64_t j = 0;
  for (; j + kVecsPer * kLanes <= N; j += kVecsPer * kLanes)
    gemm_block<M, kVecsPer>(x, xm, xk, w, ldw, y, ldy, K, j, acc);
  if constexpr (kVecsPer > 2)  // e.g. 32 columns left of a block's 96 keys
    for (; j + 2 * kLanes <= N; j += 2 * kLanes) gemm_block<M, 2>(x, xm, xk, w, ldw, y, ldy, K, j, acc);
  for (; j + kLanes <= N; j += kLanes) gemm_block<M, 1>(x, xm, xk, w, ldw, y, ldy, K, j, acc);
  for (; j < N; ++j)
    for (int m = 0; m < M; ++m) {
      float s = acc ? y[m * ldy + j] : 0.f;
      for (int64_t k = 0; k < K; ++k) s += x[m * xm + k * xk] * w[k * ldw + j];
      y[m * ldy + j] = s;
    }
}

static void gemm(const float* x, int64_t xm, int64_t xk, const float* w, int64_t ldw, float* y, int64_t ldy,
                 int64_t M, int64_t K, int64_t N, bool acc) {
  int64_t m = 0;
  for (; m + kRowsPer <= M; m += kRowsPer) gemm_rows<kRowsPer>(x + m * xm, xm, xk, w, ldw, y + m * ldy, ldy, K, N, acc);
  if (m < M)
    with_rows<kRowsPer - 1>(M - m, [&](auto rows) {
      gemm_rows<rows()>(x + m * xm, xm, xk, w, ldw, y + m * ldy, ldy, K, N, acc);
    });
}

// row[s] = mask[s] ? row[s] * scale : kMasked for s < n (a score row, scaled and masked in place).
typedef int8_t vb __attribute__((vector_size(kLanes)));

static inline void scale_mask(float* row, const bool* mask, int64_t n, float scale) {
  int64_t s = 0;
  for (; s + kLanes <= n; s += kLanes) {
    vb m;
    std::memcpy(&m, mask + s, sizeof m);
    const vi on = __builtin_convertvector(m, vi) != 0;
    store_v(row + s, on ? load_v(row + s) * scale : splat(kMasked));
  }
  for (; s < n; ++s) row[s] = mask[s] ? row[s] * scale : kMasked;
}

// row[s] = exp(row[s] - sub) for s < n; returns the sum.
static inline float exp_row(float* row, int64_t n, float sub) {
  vf acc = vf{};
  int64_t s = 0;
  for (; s + kLanes <= n; s += kLanes) {
    const vf e = vexp(load_v(row + s) - sub);
    store_v(row + s, e);
    acc += e;
  }
  float t = hsum(acc);
  for (; s < n; ++s) {
    vf e = vexp(splat(row[s] - sub));
    row[s] = e[0];
    t += e[0];
  }
  return t;
}

// ---------------------------------------------------------------------------------------------------------
struct Dims {
  int64_t B, T, H, Hkv, G, hd, block;
  float scale;
  // element offsets of q[b, t, h, 0], k[b, s, kh, 0], mask[b, t, 0], lse[b, h, t]
  int64_t q(int64_t b, int64_t t, int64_t h) const { return ((b * T + t) * H + h) * hd; }
  int64_t k(int64_t b, int64_t s, int64_t kh) const { return ((b * T + s) * Hkv + kh) * hd; }
  int64_t mask(int64_t b, int64_t t) const { return (b * T + t) * T; }
  int64_t lse(int64_t b, int64_t h, int64_t t) const { return (b * H + h) * T + t; }
};

static bool read_dims(const ffi::Buffer<ffi::F32>& q, const ffi::Buffer<ffi::F32>& k, const ffi::Buffer<ffi::F32>& v,
                      const ffi::Buffer<ffi::PRED>& mask, float scale, int64_t block, Dims& d) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), md = mask.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || md.size() != 3) return false;
  d = Dims{qd[0], qd[1], qd[2], kd[2], 0, qd[3], std::max<int64_t>(1, block), scale};
  if (d.Hkv <= 0 || d.H % d.Hkv) return false;
  d.G = d.H / d.Hkv;
  for (int i = 0; i < 4; ++i)
    if (kd[i] != vd[i]) return false;
  return kd[0] == d.B && kd[1] == d.T && kd[3] == d.hd && md[0] == d.B && md[1] == d.T && md[2] == d.T;
}

// k[b, :, kh, :] as rows [T, hd] (if kp) and as columns [hd, T] (if kt).
static void pack_heads(const float* k, const Dims& d, int64_t b, int64_t kh, float* kp, float* kt) {
  for (int64_t s = 0; s < d.T; ++s) {
    const float* src = k + d.k(b, s, kh);
    if (kp) std::memcpy(kp + s * d.hd, src, d.hd * 4);
    if (kt)
      for (int64_t i = 0; i < d.hd; ++i) kt[i * d.T + s] = src[i];
  }
}

// The rows of query block [a, e) of kv head kh, position-major: row (t - a) * G + g is head kh * G + g.
static void gather_rows(const float* q, const Dims& d, int64_t b, int64_t kh, int64_t a, int64_t e, float* out) {
  for (int64_t t = a; t < e; ++t)
    for (int64_t g = 0; g < d.G; ++g)
      std::memcpy(out + ((t - a) * d.G + g) * d.hd, q + d.q(b, t, kh * d.G + g), d.hd * 4);
}

static void scatter_rows(const float* rows, const Dims& d, int64_t b, int64_t kh, int64_t a, int64_t e, float* q) {
  for (int64_t t = a; t < e; ++t)
    for (int64_t g = 0; g < d.G; ++g)
      std::memcpy(q + d.q(b, t, kh * d.G + g), rows + ((t - a) * d.G + g) * d.hd, d.hd * 4);
}

// A work item's buffers, left uninitialised (each is written before it is read).
struct Scratch {
  std::unique_ptr<float[]> p;
  explicit Scratch(int64_t n) : p(new float[n]) {}
  float* data() { return p.get(); }
  float& operator[](int64_t i) { return p[i]; }
};

static ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                          ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> mask, float scale, int64_t block,
                          ffi::ResultBuffer<ffi::F32> o, ffi::ResultBuffer<ffi::F32> lse) {
  Dims d;
  if (!read_dims(q, k, v, mask, scale, block, d) || o->element_count() != q.element_count() ||
      int64_t(lse->element_count()) != d.B * d.H * d.T)
    return ffi::Error::InvalidArgument("attention_fwd: q [B, T, H, hd], k and v [B, T, Hkv, hd] with Hkv dividing H, "
                                       "mask [B, T, T], o like q, lse [B, H, T]");
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  const bool* mp = mask.typed_data();
  float* op = o->typed_data();
  float* lp = lse->typed_data();
  in_parallel(pool, helpers_besides_caller(pool), d.B * d.Hkv, [&](int64_t item) {
    const int64_t b = item / d.Hkv, kh = item % d.Hkv, rows = d.block * d.G;
    Scratch kt(d.hd * d.T), vals(d.T * d.hd), qr(rows * d.hd), s(rows * d.T), out(rows * d.hd), inv(rows);
    pack_heads(kp, d, b, kh, nullptr, kt.data());
    pack_heads(vp, d, b, kh, vals.data(), nullptr);
    for (int64_t a = 0; a < d.T; a += d.block) {
      const int64_t e = std::min(d.T, a + d.block), R = (e - a) * d.G;  // keys 0..e: the rest are after e
      gather_rows(qp, d, b, kh, a, e, qr.data());
      gemm(qr.data(), d.hd, 1, kt.data(), d.T, s.data(), e, R, d.hd, e, false);  // scores [R, e]
      for (int64_t r = 0; r < R; ++r) {
        const int64_t t = a + r / d.G;
        float* row = s.data() + r * e;
        scale_mask(row, mp + d.mask(b, t), e, d.scale);
        const float mx = max_row(row, e), l = exp_row(row, e, mx);
        inv[r] = 1.f / l;
        lp[d.lse(b, kh * d.G + r % d.G, t)] = mx + std::log(l);
      }
      gemm(s.data(), e, 1, vals.data(), d.hd, out.data(), d.hd, R, e, d.hd, false);  // [R, hd]
      for (int64_t r = 0; r < R; ++r)
        for (int64_t i = 0; i < d.hd; ++i) out[r * d.hd + i] *= inv[r];
      scatter_rows(out.data(), d, b, kh, a, e, op);
    }
  });
  return ffi::Error::Success();
}

static ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                           ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::F32> o,
                           ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> dout, float scale, int64_t block,
                           ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk,
                           ffi::ResultBuffer<ffi::F32> dv) {
  Dims d;
  if (!read_dims(q, k, v, mask, scale, block, d) || o.element_count() != q.element_count() ||
      dout.element_count() != q.element_count() || int64_t(lse.element_count()) != d.B * d.H * d.T ||
      dq->element_count() != q.element_count() || dk->element_count() != k.element_count() ||
      dv->element_count() != v.element_count())
    return ffi::Error::InvalidArgument("attention_bwd: q, o, dout, dq [B, T, H, hd]; k, v, dk, dv [B, T, Hkv, hd]; "
                                       "mask [B, T, T]; lse [B, H, T]");
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  const bool* mp = mask.typed_data();
  const float* opp = o.typed_data();
  const float* lp = lse.typed_data();
  const float* dop = dout.typed_data();
  float* dqp = dq->typed_data();
  float* dkp = dk->typed_data();
  float* dvp = dv->typed_data();
  in_parallel(pool, helpers_besides_caller(pool), d.B * d.Hkv, [&](int64_t item) {
    const int64_t b = item / d.Hkv, kh = item % d.Hkv, rows = d.block * d.G;
    Scratch keys(d.T * d.hd), kt(d.hd * d.T), vt(d.hd * d.T), qr(rows * d.hd), dor(rows * d.hd), orow(rows * d.hd),
        p(rows * d.T), ds(rows * d.T), dqr(rows * d.hd), delta(rows);
    std::vector<float> dkacc(d.T * d.hd, 0.f), dvacc(d.T * d.hd, 0.f);
    pack_heads(kp, d, b, kh, keys.data(), kt.data());
    pack_heads(vp, d, b, kh, nullptr, vt.data());  // V only as columns: dP = dO V^T
    for (int64_t a = 0; a < d.T; a += d.block) {
      const int64_t e = std::min(d.T, a + d.block), R = (e - a) * d.G;
      gather_rows(qp, d, b, kh, a, e, qr.data());
      gather_rows(dop, d, b, kh, a, e, dor.data());
      gather_rows(opp, d, b, kh, a, e, orow.data());
      for (int64_t r = 0; r < R; ++r) {  // delta_r = sum_i dO * O = sum_s P * dP (the softmax backward's term)
        float t = 0.f;
        for (int64_t i = 0; i < d.hd; ++i) t += dor[r * d.hd + i] * orow[r * d.hd + i];
        delta[r] = t;
      }
      gemm(qr.data(), d.hd, 1, kt.data(), d.T, p.data(), e, R, d.hd, e, false);  // scores [R, e]
      for (int64_t r = 0; r < R; ++r) {  // P, recomputed from the forward's lse
        const int64_t t = a + r / d.G;
        float* row = p.data() + r * e;
        scale_mask(row, mp + d.mask(b, t), e, d.scale);
        const float l = lp[d.lse(b, kh * d.G + r % d.G, t)];
        exp_row(row, e, l);
        if (l <= 0.5f * kMasked)  // every key masked: the forward's uniform weights, 1 / e each
          for (int64_t s = 0; s < e; ++s) row[s] /= float(e);
      }
      gemm(p.data(), 1, e, dor.data(), d.hd, dvacc.data(), d.hd, e, R, d.hd, true);  // dV[0:e] += P^T dO
      gemm(dor.data(), d.hd, 1, vt.data(), d.T, ds.data(), e, R, d.hd, e, false);    // dP = dO V^T [R, e]
      for (int64_t r = 0; r < R; ++r) {  // dS = P (dP - delta) * scale: the scale of S = scale * q k
        const float* pr = p.data() + r * e;
        float* dr = ds.data() + r * e;
        const float dl = delta[r];
        for (int64_t s = 0; s < e; ++s) dr[s] = pr[s] * (dr[s] - dl) * d.scale;
      }
      gemm(ds.data(), e, 1, keys.data(), d.hd, dqr.data(), d.hd, R, e, d.hd, false);  // dQ = dS K
      scatter_rows(dqr.data(), d, b, kh, a, e, dqp);
      gemm(ds.data(), 1, e, qr.data(), d.hd, dkacc.data(), d.hd, e, R, d.hd, true);  // dK[0:e] += dS^T Q
    }
    for (int64_t s = 0; s < d.T; ++s) {
      std::memcpy(dkp + d.k(b, s, kh), dkacc.data() + s * d.hd, d.hd * 4);
      std::memcpy(dvp + d.k(b, s, kh), dvacc.data() + s * d.hd, d.hd * 4);
    }
  });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------------------
// How many of the S slots sequence b's T rows read: up to the last slot any row sees, rounded up to whole
// vectors (so `exp_row` sums the same lanes in the same order as over all S), or all S where some row sees
// no slot (its weights are uniform over all S, as in the XLA version).
static int64_t seen_slots(const bool* mask, int64_t T, int64_t S) {
  int64_t end = 0;
  for (int64_t t = 0; t < T; ++t) {
    const bool* row = mask + t * S;
    int64_t last = S;
    while (last > 0 && !row[last - 1]) --last;
    if (last == 0) return S;
    end = std::max(end, last);
  }
  return std::min(S, (end + kLanes - 1) / kLanes * kLanes);
}

// Decoding: q [B, T, H, hd] (a few new positions) over a head-major cache k, v [B, Hkv, S, hd], mask
// [B, T, S] -> o [B, T, H, hd]. Forward only. Each (sequence, kv head) pair's G * T query rows score its
// S cached keys (one dot product per row and key: the rows are too few for `gemm`'s blocks), then the
// weights multiply the values through `gemm`. XLA:CPU took about 220 us a layer for this at batch 8 and
// 192 slots (31M model), mostly in layout changes and the softmax's passes.
// Slots past the last one any of a sequence's rows may see are not read (`seen_slots`): a cache is sized
// for the whole generation (or the server's longest request), and early in decoding most of it is empty.
// Their weights would be exactly 0, so the output is the same to the bit.
static ffi::Error Cached(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                         ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> mask, float scale,
                         ffi::ResultBuffer<ffi::F32> o) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), md = mask.dimensions();
  bool ok = qd.size() == 4 && kd.size() == 4 && vd.size() == 4 && md.size() == 3 &&
            o->element_count() == q.element_count();
  for (int i = 0; ok && i < 4; ++i) ok = kd[i] == vd[i];
  ok = ok && kd[0] == qd[0] && kd[1] > 0 && qd[2] % kd[1] == 0 && kd[3] == qd[3] && md[0] == qd[0] &&
       md[1] == qd[1] && md[2] == kd[2];
  if (!ok)
    return ffi::Error::InvalidArgument("cached_attention: q [B, T, H, hd], k and v [B, Hkv, S, hd] with Hkv dividing "
                                       "H, mask [B, T, S], o like q");
  const int64_t B = qd[0], T = qd[1], H = qd[2], hd = qd[3], Hkv = kd[1], S = kd[2], G = H / Hkv, R = T * G;
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  const bool* mp = mask.typed_data();
  float* op = o->typed_data();
  in_parallel(pool, helpers_besides_caller(pool), B * Hkv, [&](int64_t item) {
    const int64_t b = item / Hkv, kh = item % Hkv;
    const float* keys = kp + item * S * hd;  // [S, hd], contiguous: the cache is head-major
    const float* vals = vp + item * S * hd;
    const int64_t E = seen_slots(mp + b * T * S, T, S);  // slots from E on are not read
    Scratch qr(R * hd), sc(R * S), out(R * hd);
    for (int64_t t = 0; t < T; ++t)  // row t * G + g: head kh * G + g at position t
      for (int64_t g = 0; g < G; ++g)
        std::memcpy(qr.data() + (t * G + g) * hd, qp + ((b * T + t) * H + kh * G + g) * hd, hd * 4);
    for (int64_t s = 0; s < E; ++s) {
      const float* kr = keys + s * hd;
      for (int64_t i = 0; i < hd; i += kLanes) {  // the cache is read cold: fetch later keys, and the values
        __builtin_prefetch(kr + kAhead * hd + i);
        __builtin_prefetch(vals + s * hd + i);
      }
      for (int64_t r = 0; r < R; ++r) {
        const float* x = qr.data() + r * hd;
        vf acc = vf{};
        int64_t i = 0;
        for (; i + kLanes <= hd; i += kLanes) acc += load_v(x + i) * load_v(kr + i);
        float t = hsum(acc);
        for (; i < hd; ++i) t += x[i] * kr[i];
        sc[r * S + s] = t;
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      float* row = sc.data() + r * S;
      scale_mask(row, mp + (b * T + r / G) * S, E, scale);
      const float l = exp_row(row, E, max_row(row, E)), inv = 1.f / l;
      for (int64_t s = 0; s < E; ++s) row[s] *= inv;
    }
    gemm(sc.data(), S, 1, vals, hd, out.data(), hd, R, E, hd, false);  // [R, hd]
    for (int64_t t = 0; t < T; ++t)
      for (int64_t g = 0; g < G; ++g)
        std::memcpy(op + ((b * T + t) * H + kh * G + g) * hd, out.data() + (t * G + g) * hd, hd * 4);
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionCached, Cached,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k cache
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v cache
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // mask
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // o

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionFwd, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // mask
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("block")
                                  .Ret<ffi::Buffer<ffi::F32>>()   // o
                                  .Ret<ffi::Buffer<ffi::F32>>());  // lse

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionBwd, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // mask
                                  .Arg<ffi::Buffer<ffi::F32>>()   // o
                                  .Arg<ffi::Buffer<ffi::F32>>()   // lse
                                  .Arg<ffi::Buffer<ffi::F32>>()   // dout
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("block")
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dq
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dk
                                  .Ret<ffi::Buffer<ffi::F32>>());  // dv
