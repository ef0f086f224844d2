// A 2-D transpose of 2- or 4-byte elements between strided buffers: the checkpoint loader's (Hugging Face
// stores nn.Linear kernels [out, in], amdllm [in, out]) and the writer's, called through ctypes.
//
// Why: numpy copies a transposed view one element at a time, and in a matrix whose rows are a multiple of
// 4 KB apart every row of a column maps to the same L1 cache set, so that copy ran at 0.3-0.4 GB/s (a
// [8192, 2048] bf16 kernel: 118 ms; a 1B checkpoint's load spent 12.7 of its 14 s in the slab copies that
// ran it). Here 8 x 8 (2-byte) or 4 x 4 (4-byte) tiles are transposed in SSE registers, 64 x 64 blocks at a
// time: 10 ms.
//
// dst[j * ds + i] = src[i * ss + j] for i < rows, j < cols (strides in elements).
#include <algorithm>
#include <cstdint>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 64;  // tiles walked a block at a time: the block's rows and columns stay in L1/L2

#if defined(__SSE2__)
inline void tile16(const uint16_t* s, int64_t ss, uint16_t* d, int64_t ds) {  // 8 x 8 two-byte elements
  __m128i r[8];
  for (int k = 0; k < 8; ++k) r[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + k * ss));
  __m128i t[8], u[8];
  for (int k = 0; k < 4; ++k) {
    t[2 * k] = _mm_unpacklo_epi16(r[2 * k], r[2 * k + 1]);      // rows 2k, 2k+1: columns 0-3 interleaved
    t[2 * k + 1] = _mm_unpackhi_epi16(r[2 * k], r[2 * k + 1]);  // columns 4-7
  }
  for (int h = 0; h < 2; ++h) {  // h: columns 0-3 (t even) or 4-7 (t odd); rows 0-3 in u[0..3], 4-7 in u[4..7]
    u[2 * h] = _mm_unpacklo_epi32(t[h], t[2 + h]);
    u[2 * h + 1] = _mm_unpackhi_epi32(t[h], t[2 + h]);
    u[4 + 2 * h] = _mm_unpacklo_epi32(t[4 + h], t[6 + h]);
    u[4 + 2 * h + 1] = _mm_unpackhi_epi32(t[4 + h], t[6 + h]);
  }
  for (int k = 0; k < 4; ++k) {  // u[k] holds columns 2k, 2k+1 of rows 0-3; u[4 + k] of rows 4-7
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + (2 * k) * ds), _mm_unpacklo_epi64(u[k], u[4 + k]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + (2 * k + 1) * ds), _mm_unpackhi_epi64(u[k], u[4 + k]));
  }
}

inline void tile32(const uint32_t* s, int64_t ss, uint32_t* d, int64_t ds) {  // 4 x 4 four-byte elements
  __m128 r0 = _mm_loadu_ps(reinterpret_cast<const float*>(s));
  __m128 r1 = _mm_loadu_ps(reinterpret_cast<const float*>(s + ss));
  __m128 r2 = _mm_loadu_ps(reinterpret_cast<const float*>(s + 2 * ss));
  __m128 r3 = _mm_loadu_ps(reinterpret_cast<const float*>(s + 3 * ss));
  _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
  _mm_storeu_ps(reinterpret_cast<float*>(d), r0);
  _mm_storeu_ps(reinterpret_cast<float*>(d + ds), r1);
  _mm_storeu_ps(reinterpret_cast<float*>(d + 2 * ds), r2);
  _mm_storeu_ps(reinterpret_cast<float*>(d + 3 * ds), r3);
}
constexpr bool kTiles = true;
#else
inline void tile16(const uint16_t*, int64_t, uint16_t*, int64_t) {}
inline void tile32(const uint32_t*, int64_t, uint32_t*, int64_t) {}
constexpr bool kTiles = false;
#endif

template <typename T, int64_t kTile, void (*tile)(const T*, int64_t, T*, int64_t)>
void transpose(const T* src, int64_t rows, int64_t cols, int64_t ss, T* dst, int64_t ds) {
  const int64_t rt = kTiles ? rows - rows % kTile : 0, ct = kTiles ? cols - cols % kTile : 0;
  for (int64_t i0 = 0; i0 < rt; i0 += kBlock)
    for (int64_t j0 = 0; j0 < ct; j0 += kBlock)
      for (int64_t i = i0; i < std::min(rt, i0 + kBlock); i += kTile)
        for (int64_t j = j0; j < std::min(ct, j0 + kBlock); j += kTile) tile(src + i * ss + j, ss, dst + j * ds + i, ds);
  for (int64_t i = 0; i < rows; ++i)  // what the tiles left: the last columns of tiled rows, then whole rows
    for (int64_t j = i < rt ? ct : 0; j < cols; ++j) dst[j * ds + i] = src[i * ss + j];
}

}  // namespace

extern "C" {
void amdllm_transpose_2(const uint16_t* src, int64_t rows, int64_t cols, int64_t ss, uint16_t* dst, int64_t ds) {
  transpose<uint16_t, 8, tile16>(src, rows, cols, ss, dst, ds);
}
void amdllm_transpose_4(const uint32_t* src, int64_t rows, int64_t cols, int64_t ss, uint32_t* dst, int64_t ds) {
  transpose<uint32_t, 4, tile32>(src, rows, cols, ss, dst, ds);
}
}
