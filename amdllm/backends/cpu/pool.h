// Work shared out over XLA's intra-op thread pool (the FFI's ThreadPool), for rows.cc.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace amdllm_native {

// run(c) for each chunk c < chunks, on the calling thread and the pool's. Chunks are claimed from a
// counter: the work is shared out as threads become free, the caller finishes it alone if the pool never
// gets to it (a pool of one thread that is running this very call), and a task that starts late finds
// nothing left and touches nothing.
struct Work {
  std::atomic<int64_t> next{0}, done{0};
  int64_t chunks = 0;
  std::function<void(int64_t)> run;
};

inline void claim(Work& work) {
  for (int64_t c; (c = work.next.fetch_add(1)) < work.chunks;) {
    work.run(c);
    work.done.fetch_add(1);
  }
}

// The pool's threads that may help the caller (at most 64).
inline int64_t helpers(xla::ffi::ThreadPool& pool) { return std::clamp<int64_t>(pool.num_threads(), 0, 64); }

// The helpers that give one thread per core with the caller (the pool has one thread per core).
inline int64_t helpers_besides_caller(xla::ffi::ThreadPool& pool) { return std::max<int64_t>(0, helpers(pool) - 1); }

// `helpers` of the pool's threads (at most chunks - 1 are scheduled) and the caller run the chunks.
inline void in_parallel(xla::ffi::ThreadPool& pool, int64_t helpers, int64_t chunks,
                        std::function<void(int64_t)> run) {
  auto work = std::make_shared<Work>();
  work->chunks = chunks;
  work->run = std::move(run);
  for (int64_t t = 0; t < std::min(helpers, chunks - 1); ++t) pool.Schedule([work]() { claim(*work); });
  claim(*work);
  while (work->done.load() < chunks) std::this_thread::yield();
}

}  // namespace amdllm_native
