// A float32 copy that XLA cannot fuse through: `amdllm.native.materialized`.
//
// Why: XLA:CPU fuses a cheap-looking producer into every consumer and evaluates it again per element there.
// The RoPE tables cos/sin [B, T, hd] are such a producer: each layer's rotation of q and k (H and Hkv heads,
// forward and backward) recomputed both transcendentals per element, about 40 ms of the 31M benchmark
// model's ~1.5 s LoRA step (docs/benchmark-history.md, "the per-layer training step"). Behind this copy
// the consumers read the tables from memory instead.
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static ffi::Error Copy(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> out) {
  std::memcpy(out->typed_data(), x.typed_data(), x.element_count() * sizeof(float));
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(CopyF32, Copy,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .Ret<ffi::Buffer<ffi::F32>>());  // its copy
