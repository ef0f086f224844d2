// Token cross-entropy over float32 logits on a CPU, forward and backward: `amdllm.model.loss.token_nll`'s
// native route.
//
// Why: in the 31M benchmark model's LoRA step (8 x 256 tokens, vocabulary 8192) XLA:CPU wrote exp(logits -
// max) out to memory in the forward only to sum it, and read the logits twice more in the backward: its
// loss took 50-70 ms of a ~1.6 s step. Here the forward reads each row twice while it is in cache (its max,
// then the sum of exp) and writes two floats; the backward reads it once and writes the gradient.
//
// logits [N, V] float32, targets [N] int32 (in [0, V): the caller's data) -> nll [N] = lse - logits[target]
// and lse [N] = log sum exp(logits) (the forward's residual); backward: d logits = (exp(logits - lse) -
// onehot(target)) * g, g [N] the cotangent of nll. Rows are shared out over XLA's intra-op pool (pool.h).
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "pool.h"
#include "vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace amdllm_native;  // pool.h, vec.h

constexpr int64_t kRowsPerChunk = 8;

static float row_sum_exp(const float* row, int64_t V, float sub) {
  vf acc = vf{};
  int64_t j = 0;
  for (; j + kLanes <= V; j += kLanes) acc += vexp(load_v(row + j) - sub);
  float s = hsum(acc);
  for (; j < V; ++j) s += vexp(splat(row[j] - sub))[0];
  return s;
}

static bool shapes(const ffi::Buffer<ffi::F32>& logits, const ffi::Buffer<ffi::S32>& targets, int64_t& N,
                   int64_t& V) {
  const auto dims = logits.dimensions();
  if (dims.size() != 2 || targets.element_count() != size_t(dims[0])) return false;
  N = dims[0];
  V = dims[1];
  return V > 0;
}

static void over_rows(ffi::ThreadPool& pool, int64_t N, std::function<void(int64_t)> row) {
  in_parallel(pool, helpers_besides_caller(pool), (N + kRowsPerChunk - 1) / kRowsPerChunk,
              [&](int64_t c) {
                for (int64_t i = c * kRowsPerChunk; i < std::min(N, (c + 1) * kRowsPerChunk); ++i) row(i);
              });
}

static ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::S32> targets,
                          ffi::ResultBuffer<ffi::F32> nll, ffi::ResultBuffer<ffi::F32> lse) {
  int64_t N, V;
  if (!shapes(logits, targets, N, V) || int64_t(nll->element_count()) != N || int64_t(lse->element_count()) != N)
    return ffi::Error::InvalidArgument("cross_entropy_fwd: logits [N, V], targets [N], nll and lse [N]");
  const float* x = logits.typed_data();
  const int32_t* t = targets.typed_data();
  float* np = nll->typed_data();
  float* lp = lse->typed_data();
  over_rows(pool, N, [&](int64_t i) {
    const float* row = x + i * V;
    const float m = max_row(row, V);
    const float l = m + std::log(row_sum_exp(row, V, m));
    lp[i] = l;
    np[i] = l - row[std::clamp<int64_t>(t[i], 0, V - 1)];
  });
  return ffi::Error::Success();
}

static ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::S32> targets,
                           ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> g, ffi::ResultBuffer<ffi::F32> grad) {
  int64_t N, V;
  if (!shapes(logits, targets, N, V) || int64_t(lse.element_count()) != N || int64_t(g.element_count()) != N ||
      grad->element_count() != logits.element_count())
    return ffi::Error::InvalidArgument("cross_entropy_bwd: logits [N, V], targets, lse and g [N], grad like logits");
  const float* x = logits.typed_data();
  const int32_t* t = targets.typed_data();
  const float* lp = lse.typed_data();
  const float* gp = g.typed_data();
  float* out = grad->typed_data();
  over_rows(pool, N, [&](int64_t i) {
    const float* row = x + i * V;
    float* o = out + i * V;
    const float l = lp[i], gi = gp[i];
    int64_t j = 0;
    for (; j + kLanes <= V; j += kLanes) store_v(o + j, vexp(load_v(row + j) - l) * gi);
    for (; j < V; ++j) o[j] = vexp(splat(row[j] - l))[0] * gi;
    o[std::clamp<int64_t>(t[i], 0, V - 1)] -= gi;
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(CrossEntropyFwd, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // logits
                                  .Arg<ffi::Buffer<ffi::S32>>()   // targets
                                  .Ret<ffi::Buffer<ffi::F32>>()   // nll
                                  .Ret<ffi::Buffer<ffi::F32>>());  // lse

XLA_FFI_DEFINE_HANDLER_SYMBOL(CrossEntropyBwd, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // logits
                                  .Arg<ffi::Buffer<ffi::S32>>()   // targets
                                  .Arg<ffi::Buffer<ffi::F32>>()   // lse
                                  .Arg<ffi::Buffer<ffi::F32>>()   // g
                                  .Ret<ffi::Buffer<ffi::F32>>());  // grad
