// Many rows of bfloat16 activations times a frozen bfloat16 weight matrix, float32 sums: on Intel AMX tiles,
// or, on a CPU without AMX, by AVX-512 BF16's VDPBF16PS (AMD Zen 4 and later, Intel Cooper Lake).
//
// Why: a LoRA step on a bf16 base multiplies 256+ rows by every weight matrix, forward and backward
// (dx = dy . W^T; the base gets no gradient). XLA:CPU ran those bf16 dots at 200-540 GFLOP/s on a 2-core
// Xeon with AMX, where PyTorch (oneDNN) reached 330-940, so peft's step was faster with the same work
// (docs/benchmark-history.md, "LoRA training step"); on a 2-core Zen 4 at 270-370 of the 465 that
// VDPBF16PS reaches there, where PyTorch reached 400-440 (benchmarks/bench_tiles.py).
// AMX multiplies 16x32 by 32x16 bf16 tiles into 16x16 float32 tiles in one instruction.
//
// Two layouts, both x [M, K] -> y [M, N] float32, W 2-D or a stack of layers' [L, ...] read at a layer index:
//   *_kn: W [K, N] (amdllm's [in, out] kernels; the backward of a tied head).
//   *_nk: W [N, K] (the backward of an [in, out] kernel, dy . W^T; a tied head's [V, D] table).
// Both instruction sets want their second operand as [K/2][N][2] pairs; neither layout is, so each thread
// packs a panel of W's columns into that order (kn: two rows interleaved; nk: 16x16 transposes of 32-bit
// pairs) right before using it, while it is hot in L2, and reuses it for every block of rows of x. x is
// packed once, into blocks of 32 (AMX) or 12 (VDPBF16PS) rows by 32 columns. On AMX, K goes in chunks of
// 2048; and an nk product with K a multiple of 32 is turned around (y^T = W . x^T, `rows_of_w`): W, as it
// lies, is the first operand, and x^T the packed one, so W is never packed.
// An AMX step multiplies a 32x32 block of y: 2 tiles of x by 2 tiles of W into 4 float32 tiles. A VDPBF16PS
// step multiplies 12 rows of x by 32 columns of W into 24 registers of 16 float32 sums.
// Threads: the caller and all but one of XLA's intra-op pool (pool.h: one thread a core). Called from outside
// the pool (benchmarks/bench_tiles.py), the caller and every pool thread were three workers on two cores:
// the ten products of bench_tiles took 50-56 ms against 45. Built by amdllm/native/__init__.py; the functions carry
// their own target attributes, so the file compiles on any x86-64 g++/clang++ that knows AMX, and
// amdllm_tiles_ready() and amdllm_dots_ready() say at run time which of the two this CPU (and, for AMX,
// Linux) lets a process use.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using amdllm_native::helpers_besides_caller;
using amdllm_native::in_parallel;

#if defined(__x86_64__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw")))
#define PACK __attribute__((target("avx512f,avx512bw")))
#define DOTS __attribute__((target("avx512f,avx512bw,avx512bf16")))

constexpr int64_t kBlock = 32;        // rows of x and columns of W per step
constexpr int64_t kStep = 1024;       // bf16 values per packed k-step of a block: 2 tiles of 16 x 32
constexpr int64_t kPanelBytes = 1 << 20;  // a thread's packed columns of W at once (L2)
constexpr int64_t kChunk = 64;            // k-steps at once on AMX (2048 of K): see `columns`

extern "C" int amdllm_tiles_ready() {  // 1 when this process may use AMX tiles (Linux asks for them)
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512bw")) return 0;
  unsigned a, b, c, d;
  __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
  const bool tile = (d >> 24) & 1, bf16 = (d >> 22) & 1;
  if (!tile || !bf16) return 0;
  constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0 ? 1 : 0;
}

extern "C" int amdllm_dots_ready() {  // 1 when this CPU has AVX-512 BF16 (VDPBF16PS)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512bf16") ? 1 : 0;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

AMX static void configure() {  // tiles 0-7: 16 rows of 64 bytes
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

struct Aligned {  // a 64-byte aligned scratch buffer of uint16
  std::unique_ptr<uint16_t, decltype(&std::free)> p{nullptr, &std::free};
  size_t n = 0;
  uint16_t* get(size_t want) {
    if (want > n) {
      p.reset(static_cast<uint16_t*>(std::aligned_alloc(64, (want * 2 + 63) / 64 * 64)));
      n = want;
    }
    return p.get();
  }
};

// x [M, K] -> blocks [M/rows][K/32][rows][32], zero-padded: the two x tiles of an AMX step lie in 2 KB.
static void pack_x(const uint16_t* x, int64_t M, int64_t K, int64_t mb, uint16_t* out, int64_t rows = kBlock) {
  const int64_t steps = (K + kBlock - 1) / kBlock;
  for (int64_t s = 0; s < steps; ++s) {
    uint16_t* dst = out + (mb * steps + s) * rows * kBlock;
    const int64_t k0 = s * kBlock, n = std::min(kBlock, K - k0);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t m = mb * rows + r;
      const int64_t have = m < M ? n : 0;
      if (have) std::memcpy(dst + r * kBlock, x + m * K + k0, have * 2);
      if (have < kBlock) std::memset(dst + r * kBlock + have, 0, (kBlock - have) * 2);
    }
  }
}

// W [K, N] column blocks nb0..nb1-1, k-steps s0..s1-1 -> each block [s1 - s0][2 tiles][16 pairs of rows][16
// columns][2], zero-padded, `stride` values apart. Row pair by row pair over all the blocks: W is read along
// its rows.
PACK static void pack_kn(const uint16_t* w, int64_t K, int64_t N, int64_t nb0, int64_t nb1, uint16_t* out,
                        int64_t stride, int64_t s0, int64_t s1) {
  const __m512i first = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
  const __m512i second = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
  for (int64_t k = s0 * kBlock; k < s1 * kBlock; k += 2) {
    for (int64_t nb = nb0; nb < nb1; ++nb) {
      const int64_t n0 = nb * kBlock, cols = std::min(kBlock, N - n0);
      const __mmask32 mask = cols == 32 ? ~__mmask32(0) : (__mmask32(1) << cols) - 1;
      const __m512i a = k < K ? _mm512_maskz_loadu_epi16(mask, w + k * N + n0) : _mm512_setzero_si512();
      const __m512i b = k + 1 < K ? _mm512_maskz_loadu_epi16(mask, w + (k + 1) * N + n0) : _mm512_setzero_si512();
      // unpack interleaves within 128-bit lanes: lo holds columns 0-3, 8-11, ..., hi 4-7, 12-15, ...
      const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
      uint16_t* dst = out + (nb - nb0) * stride + (k / kBlock - s0) * kStep + (k % kBlock) / 2 * kBlock;
      _mm512_store_si512(dst, _mm512_permutex2var_epi64(lo, first, hi));               // columns 0-15
      _mm512_store_si512(dst + kStep / 2, _mm512_permutex2var_epi64(lo, second, hi));  // columns 16-31
    }
  }
}

PACK static inline void transpose16(__m512i r[16]) {  // 16 x 16 32-bit values
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[4g + c], lane L: column 4L + c of rows 4g..4g+3
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i u0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88), u1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
    const __m512i v0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xdd), v1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xdd);
    t[c] = _mm512_shuffle_i32x4(u0, u1, 0x88);
    t[8 + c] = _mm512_shuffle_i32x4(u0, u1, 0xdd);
    t[4 + c] = _mm512_shuffle_i32x4(v0, v1, 0x88);
    t[12 + c] = _mm512_shuffle_i32x4(v0, v1, 0xdd);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// W [N, K] rows n0..n0+31, k-steps s0..s1-1 -> the same packed order as pack_kn: a pair (W[n, k], W[n, k+1])
// is one 32-bit value of W's row, so each tile is a 16 x 16 transpose of those. (Also x^T's packing for
// rows_of_w, with x as "W".)
PACK static void pack_nk(const uint16_t* w, int64_t K, int64_t N, int64_t n0, uint16_t* out, int64_t s0,
                        int64_t s1) {
  for (int64_t s = s0; s < s1; ++s) {
    const int64_t k0 = s * kBlock, n = std::min(kBlock, K - k0);
    const __mmask32 mask = n == 32 ? ~__mmask32(0) : (__mmask32(1) << n) - 1;
    for (int t = 0; t < 2; ++t) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t row = n0 + 16 * t + i;
        r[i] = row < N ? _mm512_maskz_loadu_epi16(mask, w + row * K + k0) : _mm512_setzero_si512();
      }
      transpose16(r);
      uint16_t* dst = out + (s - s0) * kStep + t * (kStep / 2);
      for (int p = 0; p < 16; ++p) _mm512_store_si512(dst + p * kBlock, r[p]);
    }
  }
}

// W's column blocks nb0..nb1-1 at k-steps s0..s1-1 packed (pack_kn or pack_nk) into this thread's panel
// buffer, one block's [s1 - s0][2 tiles][16 pairs][16 columns][2] after another.
PACK static const uint16_t* pack_panel(const uint16_t* w, int64_t K, int64_t N, bool nk, int64_t nb0, int64_t nb1,
                                      int64_t s0, int64_t s1) {
  static thread_local Aligned panel_buffer;
  const int64_t stride = (s1 - s0) * kStep;
  uint16_t* panel = panel_buffer.get((nb1 - nb0) * stride);
  if (nk)
    for (int64_t nb = nb0; nb < nb1; ++nb) pack_nk(w, K, N, nb * kBlock, panel + (nb - nb0) * stride, s0, s1);
  else
    pack_kn(w, K, N, nb0, nb1, panel, stride, s0, s1);
  return panel;
}

// The first operand of an AMX step: two tiles of 16 rows, the second `half` values after the first, rows
// `stride` values apart, the next k-step `step` values on. Packed x: Rows{kStep / 2, kBlock, kStep}; W [N, K]
// where it lies: Rows{16 * K, K, kBlock}.
struct Rows {
  int64_t half, stride, step;
};
constexpr Rows kPackedX{kStep / 2, kBlock, kStep};

// y[32, 32] (row stride ldy) = (add ? y : 0) + a's 32 rows (laid out as `rows` says) . a block of packed W or
// x^T, `steps` k-steps. With `fetch` (a first pass over rows that are not packed, hence not in cache), each
// row's line `kAhead` k-steps on is asked for: 32 rows are 32 streams.
AMX static void block(const uint16_t* a, Rows rows, const uint16_t* b, int64_t steps, float* y, int64_t ldy, bool add,
                      bool fetch = false) {
  constexpr int64_t kAhead = 4;
  if (add) {
    _tile_loadd(0, y, ldy * 4);
    _tile_loadd(1, y + 16, ldy * 4);
    _tile_loadd(2, y + 16 * ldy, ldy * 4);
    _tile_loadd(3, y + 16 * ldy + 16, ldy * 4);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t s = 0; s < steps; ++s, a += rows.step, b += kStep) {
    if (fetch && s + kAhead < steps)
      for (int r = 0; r < 32; ++r)
        _mm_prefetch(
            reinterpret_cast<const char*>(a + (r / 16) * rows.half + (r % 16) * rows.stride + kAhead * rows.step),
            _MM_HINT_T0);
    _tile_loadd(4, a, rows.stride * 2);
    _tile_loadd(5, a + rows.half, rows.stride * 2);
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b + kStep / 2, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, y, ldy * 4);
  _tile_stored(1, y + 16, ldy * 4);
  _tile_stored(2, y + 16 * ldy, ldy * 4);
  _tile_stored(3, y + 16 * ldy + 16, ldy * 4);
}

// A worker's share: columns of y in groups of `group` blocks. K goes in chunks of kChunk k-steps; each
// group's W panel for a chunk is packed once and used by every block of rows, and the chunk's sums are added
// to y's. Why chunks: with all of a long K at once (the 1B shape's down projection, 8192; a tied head's
// backward, a vocabulary block), a block of x and a block of W no longer stay in the L2 cache while used
// (256 rows, 2-core Xeon: down's forward 9.6-9.7 -> 7.3-8.0 ms, the head block's backward 12.6-13.1 ->
// 8.1-8.9; benchmarks/bench_tiles.py).
AMX static void columns(const uint16_t* xp, const uint16_t* w, float* y, int64_t M, int64_t K, int64_t N,
                        bool nk, int64_t nb0, int64_t nb1) {
  const int64_t steps = (K + kBlock - 1) / kBlock, mbs = (M + kBlock - 1) / kBlock;
  alignas(64) float edge[kBlock * kBlock];
  configure();
  for (int64_t s0 = 0; s0 < steps; s0 += kChunk) {
    const int64_t s1 = std::min(steps, s0 + kChunk), n = s1 - s0;
    const uint16_t* panel = pack_panel(w, K, N, nk, nb0, nb1, s0, s1);
    const bool add = s0 > 0;
    for (int64_t mb = 0; mb < mbs; ++mb) {
      const uint16_t* a = xp + (mb * steps + s0) * kStep;
      for (int64_t nb = nb0; nb < nb1; ++nb) {
        const int64_t m0 = mb * kBlock, n0 = nb * kBlock;
        const uint16_t* b = panel + (nb - nb0) * n * kStep;
        if (m0 + kBlock <= M && n0 + kBlock <= N) {
          block(a, kPackedX, b, n, y + m0 * N + n0, N, add);
        } else {  // an edge block: through a 32 x 32 buffer
          const int64_t rows = std::min(kBlock, M - m0), cols = std::min(kBlock, N - n0);
          if (add)
            for (int64_t r = 0; r < rows; ++r) std::memcpy(edge + r * kBlock, y + (m0 + r) * N + n0, cols * 4);
          block(a, kPackedX, b, n, edge, kBlock, add);
          for (int64_t r = 0; r < rows; ++r) std::memcpy(y + (m0 + r) * N + n0, edge + r * kBlock, cols * 4);
        }
      }
    }
  }
  _tile_release();
}

// t [32 n][32 m] -> y[m0 + i, n0 + j] for i < rows, j < cols.
PACK static void store_transposed(const float* t, float* y, int64_t N, int64_t m0, int64_t n0, int64_t rows,
                                  int64_t cols) {
  for (int mh = 0; mh < 2; ++mh)
    for (int nh = 0; nh < 2; ++nh) {
      const int64_t have = std::min<int64_t>(16, cols - 16 * nh);
      if (have <= 0 || 16 * mh >= rows) continue;
      __m512i r[16];
      for (int j = 0; j < 16; ++j) r[j] = _mm512_load_si512(t + (16 * nh + j) * kBlock + 16 * mh);
      transpose16(r);
      const __mmask16 mask = have == 16 ? __mmask16(0xffff) : __mmask16((1u << have) - 1);
      for (int i = 0; i < 16 && 16 * mh + i < rows; ++i)
        _mm512_mask_storeu_epi32(y + (m0 + 16 * mh + i) * N + n0 + 16 * nh, mask, r[i]);
    }
}

// nk on AMX, with K a multiple of 32: y^T = W . x^T, so W [N, K] is the A operand where it lies (a tile is 16
// of its rows, 64 bytes of K each, K * 2 bytes apart) and x^T, packed once by pack_nk, is the B operand; W is
// never packed. Each 32 x 32 block of sums is y^T's, and is transposed on its way into y. Packing W was
// about a third of an nk product's time (256 rows of the 1B shape, 2-core Xeon; bench_tiles.py).
// A worker's share of such a product: W's row blocks nb0..nb1-1, K in chunks of kChunk
// k-steps as in `columns` (the sums between chunks are kept per block in a thread's buffer, since y is
// written transposed).
AMX static void rows_of_w(const uint16_t* xt, const uint16_t* w, float* y, int64_t M, int64_t K, int64_t N,
                          int64_t nb0, int64_t nb1) {
  static thread_local Aligned edge_rows;  // the last block's rows of W, zero-padded to 32
  static thread_local Aligned sums;       // with K in chunks: each block's sums between chunks
  const int64_t steps = K / kBlock, mbs = (M + kBlock - 1) / kBlock;
  const int64_t chunk = std::min(steps, kChunk);
  alignas(64) float t[kBlock * kBlock];
  float* acc = chunk < steps ? reinterpret_cast<float*>(sums.get((nb1 - nb0) * mbs * kBlock * kBlock * 2)) : nullptr;
  configure();
  for (int64_t s0 = 0; s0 < steps; s0 += chunk) {
    const int64_t n = std::min(chunk, steps - s0);
    const bool last = s0 + n == steps;
    for (int64_t nb = nb0; nb < nb1; ++nb) {
      const int64_t n0 = nb * kBlock, cols = std::min(kBlock, N - n0);
      const uint16_t* a = w + n0 * K;
      if (cols < kBlock) {
        uint16_t* p = edge_rows.get(kBlock * K);
        if (s0 == 0) {
          std::memcpy(p, a, cols * K * 2);
          std::memset(p + cols * K, 0, (kBlock - cols) * K * 2);
        }
        a = p;
      }
      for (int64_t mb = 0; mb < mbs; ++mb) {
        float* tb = acc ? acc + ((nb - nb0) * mbs + mb) * kBlock * kBlock : t;
        block(a + s0 * kBlock, Rows{16 * K, K, kBlock}, xt + (mb * steps + s0) * kStep, n, tb, kBlock, s0 > 0,
              mb == 0);
        if (last) store_transposed(tb, y, N, mb * kBlock, n0, std::min(kBlock, M - mb * kBlock), cols);
      }
    }
  }
  _tile_release();
}

// Without AMX, with AVX-512 BF16: the same packed panels, multiplied by VDPBF16PS, which adds
// x[m, k] W[k, n] + x[m, k+1] W[k+1, n] into each of 16 float32 lanes. One packed pair-row of a W tile
// (16 columns of (k, k+1) pairs) is one register; a pair of x is broadcast to all lanes. 12 rows x 32 columns
// measured the same as 8 x 32 (2-core Zen 4); packing W is about a tenth of the time at 256 rows.
constexpr int64_t kRows = 12;  // rows of x per VDPBF16PS step: 12 x 2 accumulators of the 32 registers

// y[rows, 32] (row stride ldy) = a block of kRows rows of packed x . a block of packed W.
DOTS static void dots_block(const uint16_t* a, const uint16_t* b, int64_t steps, float* y, int64_t ldy) {
  __m512 acc[kRows][2];
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t s = 0; s < steps; ++s, a += kRows * kBlock, b += kStep) {
    for (int p = 0; p < kBlock / 2; ++p) {
      const __m512bh b0 = (__m512bh)_mm512_load_si512(b + p * kBlock);              // columns 0-15
      const __m512bh b1 = (__m512bh)_mm512_load_si512(b + kStep / 2 + p * kBlock);  // columns 16-31
      for (int r = 0; r < kRows; ++r) {
        int32_t pair;
        std::memcpy(&pair, a + r * kBlock + 2 * p, 4);
        const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, b0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b1);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    _mm512_storeu_ps(y + r * ldy, acc[r][0]);
    _mm512_storeu_ps(y + r * ldy + 16, acc[r][1]);
  }
}

// `columns` for the AVX-512 BF16 kernel: x packed in blocks of kRows rows.
DOTS static void dot_columns(const uint16_t* xp, const uint16_t* w, float* y, int64_t M, int64_t K, int64_t N,
                             bool nk, int64_t nb0, int64_t nb1) {
  const int64_t steps = (K + kBlock - 1) / kBlock, mbs = (M + kRows - 1) / kRows;
  const uint16_t* panel = pack_panel(w, K, N, nk, nb0, nb1, 0, steps);
  alignas(64) float edge[kRows * kBlock];
  for (int64_t mb = 0; mb < mbs; ++mb) {
    const uint16_t* a = xp + mb * steps * kRows * kBlock;
    for (int64_t nb = nb0; nb < nb1; ++nb) {
      const uint16_t* b = panel + (nb - nb0) * steps * kStep;
      const int64_t m0 = mb * kRows, n0 = nb * kBlock;
      if (m0 + kRows <= M && n0 + kBlock <= N) {
        dots_block(a, b, steps, y + m0 * N + n0, N);
      } else {  // an edge: through a buffer
        dots_block(a, b, steps, edge, kBlock);
        const int64_t rows = std::min(kRows, M - m0), cols = std::min(kBlock, N - n0);
        for (int64_t r = 0; r < rows; ++r) std::memcpy(y + (m0 + r) * N + n0, edge + r * kBlock, cols * 4);
      }
    }
  }
}

static ffi::Error Tiles(ffi::ThreadPool& pool, ffi::Buffer<ffi::BF16>& x, ffi::Buffer<ffi::U16>& w,
                        ffi::Buffer<ffi::S32>& layer, ffi::Result<ffi::Buffer<ffi::F32>>& y, bool nk, bool amx) {
  const std::string name = std::string(amx ? "bf16_tiles" : "bf16_dots") + (nk ? "_nk" : "_kn");
  const auto dims = w.dimensions();
  const size_t rank = dims.size();
  if ((rank != 2 && rank != 3) || x.dimensions().size() != 2 || layer.element_count() != 1)
    return ffi::Error::InvalidArgument(name + ": x must be 2-D, W 2-D or a 3-D stack, the layer one int32");
  const int64_t K = dims[rank - (nk ? 1 : 2)], N = dims[rank - (nk ? 2 : 1)], M = x.dimensions()[0];
  if (x.dimensions()[1] != K || int64_t(y->element_count()) != M * N)
    return ffi::Error::InvalidArgument(name + ": x must be [M, K] and y [M, N] for W's K and N");
  // a stack of layers' weights [L, ...] is read in place at `layer`: the layer scan does not copy a slice out
  const int64_t at = rank == 3 ? layer.typed_data()[0] : 0;
  if (at < 0 || (rank == 3 && at >= dims[0])) return ffi::Error::InvalidArgument(name + ": layer out of range");
  if (M == 0 || N == 0) return ffi::Error::Success();
  float* yp = y->typed_data();
  if (K == 0) {
    std::fill(yp, yp + M * N, 0.f);
    return ffi::Error::Success();
  }
  const int64_t rows = amx ? kBlock : kRows;  // x's rows per packed block
  const int64_t steps = (K + kBlock - 1) / kBlock, mbs = (M + rows - 1) / rows, nbs = (N + kBlock - 1) / kBlock;
  Aligned x_buffer;  // per call: an evaluation's x can be large, and is freed on return
  uint16_t* xp = x_buffer.get(mbs * steps * rows * kBlock);
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x.typed_data());
  const uint16_t* wp = w.typed_data() + at * K * N;
  const int64_t workers = helpers_besides_caller(pool) + 1;
  if (amx && nk && K % kBlock == 0) {  // W read where it lies (rows_of_w); x^T packed
    in_parallel(pool, workers - 1, mbs,
                [&](int64_t mb) { pack_nk(xs, K, M, mb * kBlock, xp + mb * steps * kStep, 0, steps); });
    // two groups of W's rows a worker; with K in chunks, a group's kept sums at most kPanelBytes
    const int64_t kept = steps > kChunk ? kPanelBytes / (kBlock * kBlock * 4) / mbs : nbs;
    const int64_t group = std::max<int64_t>(1, std::min(kept, nbs / (2 * workers)));
    const int64_t groups = (nbs + group - 1) / group;
    in_parallel(pool, workers - 1, groups,
                [&](int64_t g) { rows_of_w(xp, wp, yp, M, K, N, g * group, std::min(nbs, (g + 1) * group)); });
    return ffi::Error::Success();
  }
  in_parallel(pool, workers - 1, mbs, [&](int64_t mb) { pack_x(xs, M, K, mb, xp, rows); });
  // groups of column blocks: a panel of about kPanelBytes, and at least 4 groups a worker where N allows
  const int64_t panel_steps = amx ? std::min(steps, kChunk) : steps;
  const int64_t fit = std::max<int64_t>(1, kPanelBytes / (panel_steps * kStep * 2));
  const int64_t group = std::max<int64_t>(1, std::min(fit, nbs / (4 * workers)));
  const int64_t groups = (nbs + group - 1) / group;
  in_parallel(pool, workers - 1, groups, [&](int64_t g) {
    if (amx)
      columns(xp, wp, yp, M, K, N, nk, g * group, std::min(nbs, (g + 1) * group));
    else
      dot_columns(xp, wp, yp, M, K, N, nk, g * group, std::min(nbs, (g + 1) * group));
  });
  return ffi::Error::Success();
}

#else  // not x86-64: no tiles (amdllm_tiles_ready() is 0, so the handlers are never called)

extern "C" int amdllm_tiles_ready() { return 0; }
extern "C" int amdllm_dots_ready() { return 0; }

static ffi::Error Tiles(ffi::ThreadPool&, ffi::Buffer<ffi::BF16>&, ffi::Buffer<ffi::U16>&, ffi::Buffer<ffi::S32>&,
                        ffi::Result<ffi::Buffer<ffi::F32>>&, bool, bool) {
  return ffi::Error::Internal("bf16_tiles: AMX tiles and AVX-512 BF16 need an x86-64 CPU");
}

#endif

template <bool NK, bool AMX_TILES>
static ffi::Error TilesIn(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::U16> w,
                         ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  return Tiles(pool, x, w, layer, y, NK, AMX_TILES);
}
// the handlers' functions by name (a template argument list's comma would split the macro's arguments)
static constexpr auto TilesKn = TilesIn<false, true>, TilesNk = TilesIn<true, true>;
static constexpr auto DotsKn = TilesIn<false, false>, DotsNk = TilesIn<true, false>;

// The four handlers take the same arguments: x, W's bits, the layer index; they return y.
#define AMDLLM_TILES_HANDLER(symbol, fn)                                                                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, fn,                                                              \
                                ffi::Ffi::Bind()                                                         \
                                    .Ctx<ffi::ThreadPool>()                                              \
                                    .Arg<ffi::Buffer<ffi::BF16>>()                                       \
                                    .Arg<ffi::Buffer<ffi::U16>>()                                        \
                                    .Arg<ffi::Buffer<ffi::S32>>()                                        \
                                    .Ret<ffi::Buffer<ffi::F32>>())
AMDLLM_TILES_HANDLER(Bf16TilesKn, TilesKn);
AMDLLM_TILES_HANDLER(Bf16TilesNk, TilesNk);
AMDLLM_TILES_HANDLER(Bf16DotsKn, DotsKn);
AMDLLM_TILES_HANDLER(Bf16DotsNk, DotsNk);
