// Weight-streaming linear for small row counts on a CPU: y[R, O] = x[R, K] @ W[O, K]^T, with W stored as
// fp32, bf16, int8 (an fp16 scale per output and group of K) or int4 (an fp16 scale and minimum per group).
//
// fp32 / bf16: W is packed in blocks of 16 output columns, K-major inside a block: element (o, k) lives at
// [o / 16][k][o % 16]. A thread takes whole blocks and runs every row over each (register tiles of up to 6 rows x
// 16 columns of FMAs, the whole of K, bf16 widened in registers; the block stays in L1 / L2 for the next tile of
// rows), so the weights stream from memory once whatever the row count.
//
// int8 / int4: integer dot products, as llama.cpp's Q8_0 / Q4_1 kernels do. Each row of x is quantised once per
// call to int8 per group of K (symmetric: sx = max|x| / 127, qx = round(x / sx)); a group's dot product of
// codes is exact in int32, then y += sw * sx * dot (int4 also + mw * sx * sum(qx)), in fp32. With two passes
// ("int8x2") the residual x - s1 q1 (|.| <= s1 / 2, computed with one rounding) is rounded at the fixed step
// s2 = s1 / 254 to q2 (|q2| <= 127), a second row of codes over the same decoded weights: x ~ s2 (254 q1 + q2),
// one integer code of 16 bits in two int8 digits. The two dot products join in int32 (254 dot1 + dot2) and take
// one epilogue, y += sw * s2 * dot (+ mw * s2 * sum(254 q1 + q2)): an activation error 254x smaller for up to
// twice the integer work (the weight decode is shared), and the fp32 epilogue once per row and group, not once
// per pass. Codes are packed
// for AVX2's maddubs (u8 x s8 -> adjacent pairs summed to s16), per block of 16 columns: int8 as [o / 16][k / 4]
// [o % 16][k % 4], so one 256-bit load is 8 columns x 4 consecutive k, multiplied by x's 4 codes broadcast as one
// int32; int4 as [o / 16][k / 8][o % 16][k % 4] bytes holding k % 8 < 4 in the low nibble and k + 4 in the high.
// The s16 pair sums cannot saturate: int4 2 x 15 x 127 = 3810, int8 (by sign: |w| x sign(x, w)) 2 x 127 x 127 =
// 32258 < 32767. A block's codes are decoded in registers once per step of k for a tile of up to 4 rows. int8
// weights with two passes take the joined 16-bit code instead, against the weights widened to 16 bits
// (int_tile_wide_avx2: half the multiplies, the same integers).
//
// One source compiles to an AVX2+FMA path (function target attributes, chosen at run time), AVX-512 tiles with
// VNNI's dot product for int8 / int4 where the CPU has them (the same bits: int_tile_vnni), and a portable scalar
// path of the same integer math; no -march flag, so the same build runs on any x86-64 (and the scalar path on other
// CPUs).
#include "woq.h"

#include <c10/util/Half.h>
#include <torch/extension.h>

#include <ATen/Parallel.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define WOQ_X86 1
#endif

using namespace woq_kernel;

namespace {

constexpr int MR = 6;   // rows per register tile (fp32 / bf16)
constexpr int MR_INT = 4;  // rows per register tile (int8 / int4: 2 x 4 int32 accumulators + 4 decoded codes)
constexpr int MR_VNNI = 16;  // the same with AVX-512 (16 accumulators of 16 columns, of its 32 registers)
constexpr int32_t DIGIT = 254;  // two passes: x ~ s2 (DIGIT q1 + q2), s2 = s1 / DIGIT (file header)

inline float half_to_f32(uint16_t v) { return static_cast<float>(c10::Half(v, c10::Half::from_bits())); }

inline float bf16_to_f32(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// -- portable path ---------------------------------------------------------------------------------------
const float* tile_scalar(const Args& a, int64_t b, int64_t k0, int64_t kc, float* tile) {
  if (a.kind == F32) return static_cast<const float*>(a.w) + (b * a.K + k0) * NB;
  const uint16_t* w = static_cast<const uint16_t*>(a.w) + (b * a.K + k0) * NB;
  for (int64_t i = 0; i < kc * NB; ++i) tile[i] = bf16_to_f32(w[i]);
  return tile;
}

void rows_scalar(const Args& a, int64_t b, int64_t k0, int64_t kc, const float* t) {
  const int64_t cols = std::min<int64_t>(NB, a.O - b * NB);
  for (int64_t r = 0; r < a.rows; ++r) {
    const float* xr = a.x + r * a.K + k0;
    float acc[NB] = {0};
    for (int64_t k = 0; k < kc; ++k)
      for (int j = 0; j < NB; ++j) acc[j] += xr[k] * t[k * NB + j];
    float* yr = a.y + r * a.O + b * NB;
    for (int64_t j = 0; j < cols; ++j) yr[j] += acc[j];
  }
}

// max |x| over a group of n values.
float absmax_scalar(const float* x, int64_t n) {
  float m = 0.f;
  for (int64_t k = 0; k < n; ++k) m = std::max(m, std::fabs(x[k]));
  return m;
}

// One group of n values at step sx: qx = round(x / sx) (to nearest even, as torch.round), 0 where sx is 0; the
// callers' steps keep |x / sx| <= 127 up to rounding. Returns sum(qx).
int32_t round_scalar(const float* x, int64_t n, float sx, int8_t* q) {
  int32_t total = 0;
  for (int64_t k = 0; k < n; ++k) {
    const int32_t v = sx > 0.f ? static_cast<int32_t>(std::nearbyint(x[k] / sx)) : 0;
    q[k] = static_cast<int8_t>(std::clamp(v, -127, 127));
    total += v;
  }
  return total;
}

// The residual res = x - sx * qx of one group, rounded once (fma), what a second pass quantises.
void residual_scalar(const float* x, const int8_t* q, float sx, int64_t n, float* res) {
  for (int64_t k = 0; k < n; ++k) res[k] = std::fma(-sx, static_cast<float>(q[k]), x[k]);
}

// The logical code of column j (of the block at w) at k, from the packed layout (file header).
inline int32_t code(const Args& a, const uint8_t* w, int j, int64_t k) {
  if (a.kind == INT8) return static_cast<int8_t>(w[((k / 4) * NB + j) * 4 + k % 4]);
  const uint8_t byte = w[((k / 8) * NB + j) * 4 + k % 4];
  return (k % 8) < 4 ? (byte & 15) : (byte >> 4);
}

// Per row, group and column: dot = q . qx, or 254 (q . q1) + q . q2 (int32), then y += dot * (sw * s)
// [+ mw * s * sum(Q)].
void int_rows_scalar(const Args& a, const Acts& x, int64_t b) {
  const int64_t groups = a.K / a.group, cols = std::min<int64_t>(NB, a.O - b * NB);
  const uint8_t* w = static_cast<const uint8_t*>(a.w) + b * a.K * NB / (a.kind == INT4 ? 2 : 1);
  for (int64_t r = 0; r < a.rows; ++r) {
    std::fill(a.y + r * a.O + b * NB, a.y + r * a.O + b * NB + cols, 0.f);
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t j = 0; j < cols; ++j) {
        float& y = a.y[r * a.O + b * NB + j];
        int32_t dot = 0;
        for (int64_t v = r * x.passes; v < (r + 1) * x.passes; ++v) {  // v: the row of codes, its digit in turn
          int32_t part = 0;
          for (int64_t k = g * a.group; k < (g + 1) * a.group; ++k) part += code(a, w, j, k) * x.q[v * a.K + k];
          dot = dot * DIGIT + part;
        }
        y = std::fma(static_cast<float>(dot), half_to_f32(a.hscale[(b * groups + g) * NB + j]) * x.s[r * groups + g],
                     y);
        if (a.kind == INT4) y = std::fma(half_to_f32(a.hzero[(b * groups + g) * NB + j]), x.sum[r * groups + g], y);
      }
    }
  }
}

// -- AVX2 + FMA path -------------------------------------------------------------------------------------
#ifdef WOQ_X86
// R rows (up to a register tile) of fp32 or bf16 weights, the whole of K: U accumulator pairs per row take k
// round-robin, as R * U >= 4 pairs hide the FMA latency (4-5 cycles). bf16 is widened in registers, which
// overlaps the weights' streaming with the FMAs (decoding a chunk into an fp32 buffer first, then multiplying, was
// 1.3-2x slower from 2 to 8 rows): interleaving zeros below the bf16 bits (unpacklo / unpackhi) widens 16 columns
// in two operations, in the order 0-3, 8-11 | 4-7, 12-15, which two 128-bit permutes at the end undo.
template <int R, int U, bool BF>
__attribute__((target("avx2,fma,f16c"))) void float_rows_avx2(const Args& a, int64_t b, int64_t r0) {
  constexpr int64_t bytes = BF ? 2 : 4;  // per weight
  const char* w = static_cast<const char*>(a.w) + b * a.K * NB * bytes;
  const float* x = a.x + r0 * a.K;
  const __m256i zero = _mm256_setzero_si256();
  __m256 c0[U][R], c1[U][R];
#pragma GCC unroll 24
  for (int u = 0; u < U; ++u)
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) c0[u][i] = c1[u][i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < a.K; k += 4) {  // K is a multiple of 8
#pragma GCC unroll 4
    for (int64_t line = 0; line < 4 * NB * bytes; line += 64)  // these 4 k's lines, 512 k (1 / 2 KiB) ahead
      _mm_prefetch(w + k * NB * bytes + 512 * bytes + line, _MM_HINT_T0);
#pragma GCC unroll 4
    for (int64_t kk = k; kk < k + 4; kk += U) {
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) {
        const char* wk = w + (kk + u) * NB * bytes;
        __m256 lo, hi;
        if constexpr (BF) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk));
          lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
          hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
        } else {
          lo = _mm256_loadu_ps(reinterpret_cast<const float*>(wk));
          hi = _mm256_loadu_ps(reinterpret_cast<const float*>(wk) + 8);
        }
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) {
          const __m256 xv = _mm256_broadcast_ss(x + i * a.K + kk + u);
          c0[u][i] = _mm256_fmadd_ps(xv, lo, c0[u][i]);
          c1[u][i] = _mm256_fmadd_ps(xv, hi, c1[u][i]);
        }
      }
    }
  }
  const int64_t cols = std::min<int64_t>(NB, a.O - b * NB);
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    __m256 s0 = c0[0][i], s1 = c1[0][i];
#pragma GCC unroll 4
    for (int u = 1; u < U; ++u) s0 = _mm256_add_ps(s0, c0[u][i]), s1 = _mm256_add_ps(s1, c1[u][i]);
    alignas(32) float acc[NB];
    _mm256_store_ps(acc, BF ? _mm256_permute2f128_ps(s0, s1, 0x20) : s0);
    _mm256_store_ps(acc + 8, BF ? _mm256_permute2f128_ps(s0, s1, 0x31) : s1);
    std::memcpy(a.y + (r0 + i) * a.O + b * NB, acc, cols * sizeof(float));
  }
}

// Every row over block b, in register tiles of up to MR rows (the block, 16 x K weights, stays in L1 / L2 for
// the next tile).
template <bool BF>
__attribute__((target("avx2,fma,f16c"))) void float_block_avx2(const Args& a, int64_t b) {
  for (int64_t r = 0; r < a.rows; r += MR) {
    switch (std::min<int64_t>(MR, a.rows - r)) {
      case 1: float_rows_avx2<1, 4, BF>(a, b, r); break;
      case 2: float_rows_avx2<2, 2, BF>(a, b, r); break;
      case 3: float_rows_avx2<3, 1, BF>(a, b, r); break;
      case 4: float_rows_avx2<4, 1, BF>(a, b, r); break;
      case 5: float_rows_avx2<5, 1, BF>(a, b, r); break;
      default: float_rows_avx2<6, 1, BF>(a, b, r); break;
    }
  }
}

// absmax_scalar 8 values at a time (a maximum is exact in any order).
__attribute__((target("avx2,fma,f16c"))) float absmax_avx2(const float* x, int64_t n) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_setzero_ps();
  for (int64_t k = 0; k < n; k += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + k), abs_mask));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// round_scalar 8 values at a time (division and rounding are IEEE-exact, so the codes are identical); the
// saturating packs clamp to [-128, 127], which |x / sx| <= 127 never reaches.
__attribute__((target("avx2,fma,f16c"))) int32_t round_avx2(const float* x, int64_t n, float sx, int8_t* q) {
  const __m256 sv = _mm256_set1_ps(sx);
  __m256i total = _mm256_setzero_si256();
  for (int64_t k = 0; k < n; k += 8) {
    __m256i v = _mm256_setzero_si256();
    if (sx > 0.f)
      v = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + k), sv),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    total = _mm256_add_epi32(total, v);
    const __m128i v16 = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), _mm_packs_epi16(v16, v16));
  }
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
  return _mm_cvtsi128_si32(t);
}

// residual_scalar 8 at a time: fnmadd rounds -(sx * q) + x once, as std::fma does, so the residuals are identical.
__attribute__((target("avx2,fma,f16c"))) void residual_avx2(const float* x, const int8_t* q, float sx, int64_t n,
                                                            float* res) {
  const __m256 sv = _mm256_set1_ps(sx);
  for (int64_t k = 0; k < n; k += 8) {
    const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k));
    const __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8));
    _mm256_storeu_ps(res + k, _mm256_fnmadd_ps(sv, qf, _mm256_loadu_ps(x + k)));
  }
}

__attribute__((target("avx2,fma,f16c"))) inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// R rows of codes (from r0) of one block, the whole of K: per group, int32 accumulators of 8 columns x 2 halves x
// R rows; each step of k loads the block's codes once (64 bytes) and runs every row over them. P: passes, the
// rows of codes of one row of x, which add into its output row acc[i / P] in turn. G: int4's group size fixed at
// compile time where it is 32, else 0 (`a.group`): a group of 32 is 4 steps whose s16 pair sums (each <= 2 x 3810)
// add up to at most 30480 < 32767, so they accumulate in 16 bits and widen to int32 (vpmaddwd) once per group
// instead of once per step: a quarter of the widening multiplies, which share the multiply ports with maddubs
// (clover-smol's int4 forwards 3-15 % faster from 2 rows on, AVX2, the same bits: docs/cpu.md).
template <int R, bool I4, int P, int G>
__attribute__((target("avx2,fma,f16c"))) void int_tile_avx2(const Args& a, const Acts& x, int64_t b, int64_t r0,
                                                            float* acc) {
  const int64_t group = G ? G : a.group, groups = a.K / group;
  const uint8_t* w = static_cast<const uint8_t*>(a.w) + b * a.K * NB / (I4 ? 2 : 1);
  const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(15);
  const int8_t* xq = x.q + r0 * a.K;
  for (int64_t g = 0; g < groups; ++g) {
    __m256i c0[R], c1[R];
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) c0[i] = c1[i] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int64_t k = g * group; k < (g + 1) * group; k += I4 ? 8 : 4, w += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(w) + 1024, _MM_HINT_T0);  // streaming from DRAM: 10-20 % at 1 row
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32));
      if constexpr (I4) {  // low nibbles: k .. k + 3, high: k + 4 .. k + 7; pair sums <= 3810, so two add in s16
        const __m256i l0 = _mm256_and_si256(v0, nibble), h0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), nibble);
        const __m256i l1 = _mm256_and_si256(v1, nibble), h1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), nibble);
#pragma GCC unroll 4
        for (int i = 0; i < R; ++i) {
          const __m256i xl = bcast4(xq + i * a.K + k), xh = bcast4(xq + i * a.K + k + 4);
          const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(l0, xl), _mm256_maddubs_epi16(h0, xh));
          const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(l1, xl), _mm256_maddubs_epi16(h1, xh));
          if constexpr (G == 32) {  // 4 steps of <= 7620 stay below 32767: widened once, after the group
            c0[i] = _mm256_add_epi16(c0[i], p0), c1[i] = _mm256_add_epi16(c1[i], p1);
          } else {
            c0[i] = _mm256_add_epi32(c0[i], _mm256_madd_epi16(p0, ones));
            c1[i] = _mm256_add_epi32(c1[i], _mm256_madd_epi16(p1, ones));
          }
        }
      } else {  // signed x signed: |w| x (x with w's sign), so the unsigned operand is |w| <= 127
        const __m256i a0 = _mm256_abs_epi8(v0), a1 = _mm256_abs_epi8(v1);
#pragma GCC unroll 4
        for (int i = 0; i < R; ++i) {
          const __m256i xv = bcast4(xq + i * a.K + k);
          c0[i] = _mm256_add_epi32(c0[i], _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(xv, v0)), ones));
          c1[i] = _mm256_add_epi32(c1[i], _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(xv, v1)), ones));
        }
      }
    }
    if constexpr (I4 && G == 32) {
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) c0[i] = _mm256_madd_epi16(c0[i], ones), c1[i] = _mm256_madd_epi16(c1[i], ones);
    }
    // y += dot * (sw * s) [+ mw * s * sum(Q)], the order int_rows_scalar uses
    const __m128i* hs = reinterpret_cast<const __m128i*>(a.hscale + (b * groups + g) * NB);
    const __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128(hs)), s1 = _mm256_cvtph_ps(_mm_loadu_si128(hs + 1));
    __m256 m0 = s0, m1 = s1;
    if constexpr (I4) {
      const __m128i* hz = reinterpret_cast<const __m128i*>(a.hzero + (b * groups + g) * NB);
      m0 = _mm256_cvtph_ps(_mm_loadu_si128(hz)), m1 = _mm256_cvtph_ps(_mm_loadu_si128(hz + 1));
    }
#pragma GCC unroll 4
    for (int i = 0; i < R / P; ++i) {  // row i of x: its rows of codes P i (and P i + 1, the second digit)
      const __m256 sx = _mm256_broadcast_ss(x.s + (r0 / P + i) * groups + g);
      float* yr = acc + i * NB;
      __m256i d0 = c0[P * i], d1 = c1[P * i];
      if constexpr (P == 2) {
        const __m256i digit = _mm256_set1_epi32(DIGIT);
        d0 = _mm256_add_epi32(_mm256_mullo_epi32(d0, digit), c0[2 * i + 1]);
        d1 = _mm256_add_epi32(_mm256_mullo_epi32(d1, digit), c1[2 * i + 1]);
      }
      __m256 y0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_mul_ps(s0, sx), _mm256_load_ps(yr));
      __m256 y1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_mul_ps(s1, sx), _mm256_load_ps(yr + 8));
      if constexpr (I4) {
        const __m256 xs = _mm256_broadcast_ss(x.sum + (r0 / P + i) * groups + g);
        y0 = _mm256_fmadd_ps(m0, xs, y0), y1 = _mm256_fmadd_ps(m1, xs, y1);
      }
      _mm256_store_ps(yr, y0);
      _mm256_store_ps(yr + 8, y1);
    }
  }
}

// int_tile_avx2 with AVX-512: a block's 16 columns in one 512-bit register, and VNNI's dot product (vpdpbusd: u8 x
// s8, four adjacent products summed into each int32 lane), one instruction where AVX2 takes three (maddubs, madd,
// add) for each half. The int32 sums are the same, exactly (AVX2's s16 pair sums cannot saturate: file header),
// and each lane's fp32 epilogue is int_tile_avx2's, so both paths give the same bits. Up to 16 rows of codes per
// tile (AVX-512 has 32 registers) share each decoded step. The outputs stay in registers across the groups (the same
// sums in the same order as int_tile_avx2's through memory); G: the group size fixed at compile time for llama.cpp's
// 32 (its 4-8 steps of k unrolled), else 0 (`a.group`).
#define WOQ_AVX512 "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"
template <int R, bool I4, int P, int G>
__attribute__((target(WOQ_AVX512))) void int_tile_vnni(const Args& a, const Acts& x, int64_t b, int64_t r0,
                                                       float* acc) {
  const int64_t group = G ? G : a.group, groups = a.K / group;
  const uint8_t* w = static_cast<const uint8_t*>(a.w) + b * a.K * NB / (I4 ? 2 : 1);
  const int8_t* xq = x.q + r0 * a.K;
  const __m512i nibble = _mm512_set1_epi8(15);
  __m512 y[R / P];
#pragma GCC unroll 16
  for (int i = 0; i < R / P; ++i) y[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i c[R];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) c[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int64_t k = g * group; k < (g + 1) * group; k += I4 ? 8 : 4, w += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(w) + 1024, _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512(w);
      if constexpr (I4) {  // low nibbles: k .. k + 3, high: k + 4 .. k + 7
        const __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) {
          int32_t xl, xh;
          std::memcpy(&xl, xq + i * a.K + k, 4);
          std::memcpy(&xh, xq + i * a.K + k + 4, 4);
          c[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(c[i], lo, _mm512_set1_epi32(xl)), hi, _mm512_set1_epi32(xh));
        }
      } else {  // signed x signed: |w| x (x with w's sign)
        const __m512i mag = _mm512_abs_epi8(v);
        const __mmask64 negative = _mm512_movepi8_mask(v);
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) {
          int32_t xv;
          std::memcpy(&xv, xq + i * a.K + k, 4);
          const __m512i xb = _mm512_set1_epi32(xv);  // -x where w < 0; x * 0 where w == 0 is 0 either way
          c[i] = _mm512_dpbusd_epi32(c[i], mag, _mm512_mask_sub_epi8(xb, negative, _mm512_setzero_si512(), xb));
        }
      }
    }
    // y += dot * (sw * s) [+ mw * s * sum(Q)], in int_tile_avx2's order
    const __m512 sw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
        a.hscale + (b * groups + g) * NB)));
    __m512 mw = sw;
    if constexpr (I4)
      mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.hzero + (b * groups + g) * NB)));
#pragma GCC unroll 16
    for (int i = 0; i < R / P; ++i) {  // row i of x: its rows of codes P i (and P i + 1, the second digit)
      const __m512 sx = _mm512_set1_ps(x.s[(r0 / P + i) * groups + g]);
      __m512i dot = c[P * i];
      if constexpr (P == 2) dot = _mm512_add_epi32(_mm512_mullo_epi32(dot, _mm512_set1_epi32(DIGIT)), c[2 * i + 1]);
      y[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(sw, sx), y[i]);
      if constexpr (I4) y[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.sum[(r0 / P + i) * groups + g]), y[i]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < R / P; ++i) _mm512_store_ps(acc + i * NB, y[i]);
}

// int8 weights against two passes' joined codes Q = 254 q1 + q2 (|Q| <= 32385, one int16: Acts::wide): vpmaddwd
// multiplies a block's weights widened to 16 bits by Q directly, half the multiplies of two rows of int8 codes
// through maddubs (and no sign or abs per row). The int32 dot product is the same integer, sum w Q = 254 dot1 +
// dot2 (so within the bound woq_linear checks for two passes; a group of 32 reaches 1.3e8 at most), and the fp32
// epilogue is int_tile_avx2's, so the bits are the same. Per step of 4 k a register holds 4 columns x 4 k of
// weights; vpmaddwd leaves each column's sum in two int32 lanes, joined once per group (hadd, then the 64-bit lanes
// put in order).
// R (<= 2) rows of x from row r0; their outputs into acc [R, 16].
template <int R>
__attribute__((target("avx2,fma,f16c"))) void int_tile_wide_avx2(const Args& a, const Acts& x, int64_t b,
                                                                 int64_t r0, float* acc) {
  const int64_t groups = a.K / a.group;
  const int8_t* w = static_cast<const int8_t*>(a.w) + b * a.K * NB;
  const int16_t* xw = x.wide + r0 * a.K;
  for (int64_t g = 0; g < groups; ++g) {
    __m256i c[R][4];
#pragma GCC unroll 2
    for (int i = 0; i < R; ++i) c[i][0] = c[i][1] = c[i][2] = c[i][3] = _mm256_setzero_si256();
    for (int64_t k = g * a.group; k < (g + 1) * a.group; k += 4, w += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(w) + 1024, _MM_HINT_T0);
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32));
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v0));  // columns 0-3, 4 k each
      const __m256i w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v0, 1));  // 4-7
      const __m256i w2 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v1));  // 8-11
      const __m256i w3 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v1, 1));  // 12-15
#pragma GCC unroll 2
      for (int i = 0; i < R; ++i) {
        int64_t q4;
        std::memcpy(&q4, xw + i * a.K + k, 8);
        const __m256i xv = _mm256_set1_epi64x(q4);  // Q at k .. k + 3, in every 64 bits
        c[i][0] = _mm256_add_epi32(c[i][0], _mm256_madd_epi16(w0, xv));
        c[i][1] = _mm256_add_epi32(c[i][1], _mm256_madd_epi16(w1, xv));
        c[i][2] = _mm256_add_epi32(c[i][2], _mm256_madd_epi16(w2, xv));
        c[i][3] = _mm256_add_epi32(c[i][3], _mm256_madd_epi16(w3, xv));
      }
    }
    const __m128i* hs = reinterpret_cast<const __m128i*>(a.hscale + (b * groups + g) * NB);
    const __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128(hs)), s1 = _mm256_cvtph_ps(_mm_loadu_si128(hs + 1));
#pragma GCC unroll 2
    for (int i = 0; i < R; ++i) {  // hadd: columns 0 1 4 5 | 2 3 6 7; the 64-bit lanes 0 2 1 3 put them in order
      const __m256i d0 = _mm256_permute4x64_epi64(_mm256_hadd_epi32(c[i][0], c[i][1]), 0xD8);
      const __m256i d1 = _mm256_permute4x64_epi64(_mm256_hadd_epi32(c[i][2], c[i][3]), 0xD8);
      const __m256 sx = _mm256_broadcast_ss(x.s + (r0 + i) * groups + g);
      float* yr = acc + i * NB;
      _mm256_store_ps(yr, _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_mul_ps(s0, sx), _mm256_load_ps(yr)));
      _mm256_store_ps(yr + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_mul_ps(s1, sx), _mm256_load_ps(yr + 8)));
    }
  }
}

// int_tile_avx2 with int4's group of 32 compiled in where the layer has it (its pair sums then add in 16 bits).
template <int R, bool I4, int P>
__attribute__((target("avx2,fma,f16c"))) void avx2_tile(const Args& a, const Acts& x, int64_t b, int64_t r0,
                                                        float* acc) {
  I4 && a.group == 32 ? int_tile_avx2<R, I4, P, 32>(a, x, b, r0, acc) : int_tile_avx2<R, I4, P, 0>(a, x, b, r0, acc);
}

// Tiles of up to MR_INT rows of codes (a multiple of P: whole rows of x), then their output rows into y.
template <bool I4, int P>
__attribute__((target("avx2,fma,f16c"))) void int_rows_avx2(const Args& a, const Acts& x, int64_t b) {
  const int64_t cols = std::min<int64_t>(NB, a.O - b * NB), codes = a.rows * P;
  if (!I4 && P == 2 && x.wide) {  // rows of x two at a time, Q joined (int_tile_wide_avx2)
    for (int64_t r = 0; r < a.rows; r += 2) {
      alignas(32) float acc[2 * NB] = {0};
      const int64_t n = std::min<int64_t>(2, a.rows - r);
      n == 2 ? int_tile_wide_avx2<2>(a, x, b, r, acc) : int_tile_wide_avx2<1>(a, x, b, r, acc);
      for (int64_t i = 0; i < n; ++i) std::memcpy(a.y + (r + i) * a.O + b * NB, acc + i * NB, cols * sizeof(float));
    }
    return;
  }
  for (int64_t v = 0; v < codes; v += MR_INT) {
    const int64_t n = std::min<int64_t>(MR_INT, codes - v);
    alignas(32) float acc[MR_INT * NB] = {0};
    switch (n) {
      case 1: if constexpr (P == 1) avx2_tile<1, I4, P>(a, x, b, v, acc); break;
      case 2: avx2_tile<2, I4, P>(a, x, b, v, acc); break;
      case 3: if constexpr (P == 1) avx2_tile<3, I4, P>(a, x, b, v, acc); break;
      default: avx2_tile<4, I4, P>(a, x, b, v, acc); break;
    }
    for (int64_t i = 0; i < n / P; ++i)
      std::memcpy(a.y + (v / P + i) * a.O + b * NB, acc + i * NB, cols * sizeof(float));
  }
}

// int_tile_vnni with llama.cpp's group size compiled in where the layer has it.
template <int R, bool I4, int P>
__attribute__((target(WOQ_AVX512))) void vnni_tile(const Args& a, const Acts& x, int64_t b, int64_t r0, float* acc) {
  a.group == 32 ? int_tile_vnni<R, I4, P, 32>(a, x, b, r0, acc) : int_tile_vnni<R, I4, P, 0>(a, x, b, r0, acc);
}

// int_rows_avx2 over tiles of 16, 8 or 4 rows of codes (int_tile_vnni), the largest that fits what is left; the last
// 1-3 take one AVX2 tile, whose extra instructions per row do not matter where the weights' streaming bounds the
// time. Every size but the last is even, so a tile holds whole rows of x for P = 2 (whose rows of codes are even).
template <bool I4, int P>
__attribute__((target(WOQ_AVX512))) void int_rows_vnni(const Args& a, const Acts& x, int64_t b) {
  const int64_t cols = std::min<int64_t>(NB, a.O - b * NB), codes = a.rows * P;
  for (int64_t v = 0, n = 0; v < codes; v += n) {
    const int64_t left = codes - v;
    alignas(64) float acc[MR_VNNI * NB] = {0};
    if (left >= 16) {
      n = 16, vnni_tile<16, I4, P>(a, x, b, v, acc);
    } else if (left >= 8) {
      n = 8, vnni_tile<8, I4, P>(a, x, b, v, acc);
    } else if (left >= 4) {
      n = 4, vnni_tile<4, I4, P>(a, x, b, v, acc);
    } else {
      switch (n = left) {  // odd only for P = 1
        case 1: if constexpr (P == 1) avx2_tile<1, I4, P>(a, x, b, v, acc); break;
        case 2: avx2_tile<2, I4, P>(a, x, b, v, acc); break;
        default: if constexpr (P == 1) avx2_tile<3, I4, P>(a, x, b, v, acc); break;
      }
    }
    for (int64_t i = 0; i < n / P; ++i)
      std::memcpy(a.y + (v / P + i) * a.O + b * NB, acc + i * NB, cols * sizeof(float));
  }
}

// A dot product of n floats (rms_norm, attention scores).
__attribute__((target("avx2,fma"))) float dot_avx2(const float* x, const float* w, int64_t n) {
  __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;  // four chains: FMA latency
  int64_t k = 0;
  for (; k + 32 <= n; k += 32) {
    c0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(w + k), c0);
    c1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), _mm256_loadu_ps(w + k + 8), c1);
    c2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 16), _mm256_loadu_ps(w + k + 16), c2);
    c3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 24), _mm256_loadu_ps(w + k + 24), c3);
  }
  alignas(32) float acc[8];
  _mm256_store_ps(acc, _mm256_add_ps(_mm256_add_ps(c0, c1), _mm256_add_ps(c2, c3)));
  float sum = acc[0] + acc[1] + acc[2] + acc[3] + acc[4] + acc[5] + acc[6] + acc[7];
  for (; k < n; ++k) sum += x[k] * w[k];
  return sum;
}

// The same with w in fp16 (the correction's A): F16C widens 8 at a time.
__attribute__((target("avx2,fma,f16c"))) float dot_half_avx2(const float* x, const uint16_t* w, int64_t n) {
  __m256 c0 = _mm256_setzero_ps(), c1 = c0;
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
    c0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_cvtph_ps(_mm256_castsi256_si128(h)), c0);
    c1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), c1);
  }
  alignas(32) float acc[8];
  _mm256_store_ps(acc, _mm256_add_ps(c0, c1));
  float sum = acc[0] + acc[1] + acc[2] + acc[3] + acc[4] + acc[5] + acc[6] + acc[7];
  for (; k < n; ++k) sum += x[k] * half_to_f32(w[k]);
  return sum;
}

// One row's correction of one block: y[0:16] += sum_i t[i] tile[i, 0:16] over n fp16 tile rows (two accumulators
// of 8 columns; the block's tile, at most rank x 32 bytes, stays in L1 for every row).
__attribute__((target("avx2,fma,f16c"))) void correction_avx2(const float* t, const uint16_t* tile, int64_t n,
                                                             float* y, int64_t cols) {
  alignas(32) float acc[NB];
  std::memcpy(acc, y, cols * sizeof(float));
  __m256 c0 = _mm256_load_ps(acc), c1 = _mm256_load_ps(acc + 8);
  for (int64_t i = 0; i < n; ++i) {
    const __m256 ti = _mm256_set1_ps(t[i]);
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + i * NB));
    c0 = _mm256_fmadd_ps(ti, _mm256_cvtph_ps(_mm256_castsi256_si128(h)), c0);
    c1 = _mm256_fmadd_ps(ti, _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), c1);
  }
  _mm256_store_ps(acc, c0);
  _mm256_store_ps(acc + 8, c1);
  std::memcpy(y, acc, cols * sizeof(float));
}

bool has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

// Whether the int8 / int4 tiles can take AVX-512 with VNNI's dot product (int_tile_vnni), and may:
// $CLOVER_WOQ_VNNI=0 keeps them on AVX2's (the same bits: a comparison, and the tests' way to reach both).
bool has_vnni() {
  static const bool on = [] {
    const char* env = std::getenv("CLOVER_WOQ_VNNI");
    return !(env && std::strcmp(env, "0") == 0) && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw");
  }();
  return on;
}
#else
bool has_avx2() { return false; }
bool has_vnni() { return false; }
#endif

// The correction y += (x A^T) B' of a layer that carries one (an adapter kept beside the packed weights): t = x A^T
// first (rows x rank dot products), then per block of 16 output columns, right after the block's own output, the
// rows of B' that are not zero over those columns, stored one after another as `tiles` [n, 16] (`index` [block]
// = first row, rows, offset into tiles; clover.ops.woq.tile_correction). So B' streams with the weights, and a
// fused projection's block-diagonal B' (one block of rows per adapted part) is read only where it is not zero.
struct Corr {
  const uint16_t* A;  // [rank, K] fp16
  int64_t rank;
  const uint16_t* tiles;  // [n, 16] fp16
  const int64_t* index;
  float* t;  // [rows, rank]
  // a gated adapter acts at query positions only: row r is corrected where r % period >= from (rows are a
  // flattened [N, period] token grid whose query stream starts at `from`); 1 and 0 correct every row
  int64_t period, from;
  bool corrects(int64_t row) const { return row % period >= from; }
};

void add_correction(const Args& a, const Corr& c, int64_t b, bool vector) {
  const int64_t first = c.index[3 * b], n = c.index[3 * b + 1], cols = std::min<int64_t>(NB, a.O - b * NB);
  const uint16_t* tile = c.tiles + c.index[3 * b + 2] * NB;
  for (int64_t r = 0; r < a.rows; ++r) {
    if (!c.corrects(r)) continue;
    const float* t = c.t + r * c.rank + first;
    float* y = a.y + r * a.O + b * NB;
#ifdef WOQ_X86
    if (vector) {
      correction_avx2(t, tile, n, y, cols);
      continue;
    }
#endif
    for (int64_t j = 0; j < cols; ++j)
      for (int64_t i = 0; i < n; ++i) y[j] += t[i] * half_to_f32(tile[i * NB + j]);
  }
}

float dot_half(const float* x, const uint16_t* w, int64_t n, bool vector) {
#ifdef WOQ_X86
  if (vector) return dot_half_avx2(x, w, n);
#endif
  float sum = 0;
  for (int64_t k = 0; k < n; ++k) sum += x[k] * half_to_f32(w[k]);
  return sum;
}

// first(begin, end) over [0, n1), then, once all of it is done, second(begin, end) over [0, n2), each thread taking
// a contiguous range of each (as at::parallel_for does), in one team of torch's threads (the OpenMP runtime torch
// links; torch.set_num_threads): a team's fork and join costs ~1.5 us on 2 cores, as much as a small layer's
// first loop, so the two share one.
template <typename First, typename Second>
void two_loops(int64_t n1, const First& first, int64_t n2, const Second& second) {
  const int64_t threads =
      at::in_parallel_region() ? 1 : std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(n2, 1));
  auto part = [](int64_t n, int64_t id, int64_t nt, const auto& fn) {
    const int64_t per = (n + nt - 1) / nt, begin = std::min(n, id * per), end = std::min(n, begin + per);
    if (begin < end) fn(begin, end);
  };
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const int64_t id = omp_get_thread_num(), nt = omp_get_num_threads();
    part(n1, id, nt, first);
#pragma omp barrier
    part(n2, id, nt, second);
  }
#else
  part(n1, 0, 1, first);
  part(n2, 0, 1, second);
#endif
}

// The quantisation's steps, by the AVX2 path where `vector` (the same results: absmax_avx2, round_avx2,
// residual_avx2).
float absmax(const float* x, int64_t n, bool vector) {
#ifdef WOQ_X86
  if (vector) return absmax_avx2(x, n);
#endif
  return absmax_scalar(x, n);
}

int32_t round_group(const float* x, int64_t n, float sx, int8_t* q, bool vector) {
#ifdef WOQ_X86
  if (vector) return round_avx2(x, n, sx, q);
#endif
  return round_scalar(x, n, sx, q);
}

void residual(const float* x, const int8_t* q, float sx, int64_t n, float* res, bool vector) {
#ifdef WOQ_X86
  if (vector) return residual_avx2(x, q, sx, n, res);
#endif
  residual_scalar(x, q, sx, n, res);
}

}  // namespace

void woq_kernel::float_block(const Args& a, int64_t b, float* tile, bool vector) {
#ifdef WOQ_X86
  if (vector) return a.kind == BF16 ? float_block_avx2<true>(a, b) : float_block_avx2<false>(a, b);
#endif
  for (int64_t k0 = 0; k0 < a.K; k0 += a.kc_max) {
    const int64_t kc = std::min(a.kc_max, a.K - k0);
    rows_scalar(a, b, k0, kc, tile_scalar(a, b, k0, kc, tile));
  }
}

void woq_kernel::int_block(const Args& a, const Acts& x, int64_t b, bool vector) {
#ifdef WOQ_X86
  if (vector && has_vnni()) {
    if (a.kind == INT4)
      x.passes == 2 ? int_rows_vnni<true, 2>(a, x, b) : int_rows_vnni<true, 1>(a, x, b);
    else
      x.passes == 2 ? int_rows_vnni<false, 2>(a, x, b) : int_rows_vnni<false, 1>(a, x, b);
    return;
  }
  if (vector) {
    if (a.kind == INT4)
      x.passes == 2 ? int_rows_avx2<true, 2>(a, x, b) : int_rows_avx2<true, 1>(a, x, b);
    else
      x.passes == 2 ? int_rows_avx2<false, 2>(a, x, b) : int_rows_avx2<false, 1>(a, x, b);
    return;
  }
#endif
  int_rows_scalar(a, x, b);
}


// Row r of x into its `x.passes` rows of codes (Acts), per group: pass 1 rounds x at sx = max|x| / 127, pass 2
// its residual at s2 = sx / 254 (file header).
void woq_kernel::quantise_row(const Args& a, const Acts& x, int64_t r, bool vector, float* res) {
  const int64_t groups = a.K / a.group;
  for (int64_t g = 0; g < groups; ++g) {
    const float* in = a.x + r * a.K + g * a.group;
    int8_t* q = x.q + r * x.passes * a.K + g * a.group;
    float step = absmax(in, a.group, vector) / 127.f;
    int32_t total = round_group(in, a.group, step, q, vector);
    if (x.passes == 2) {
      residual(in, q, step, a.group, res, vector);
      step /= static_cast<float>(DIGIT);
      total = total * DIGIT + round_group(res, a.group, step, q + a.K, vector);
    }
    x.s[r * groups + g] = step;
    x.sum[r * groups + g] = step * static_cast<float>(total);
  }
}

// y = x W^T (+ the correction) for x [rows, K] fp32: one team of threads; first each row's activation codes (int8 /
// int4) and the correction's t = x A^T, then the column blocks, each with its correction.
void run(const Args& a, int64_t passes, const Corr* corr, bool vector) {
  const bool ints = a.kind >= INT8;
  const int64_t codes = ints ? a.rows * passes : 0, groups = ints ? a.K / a.group : 0;
  std::vector<int8_t> q(codes * a.K);
  std::vector<float> s(ints ? 2 * a.rows * groups : 0);  // the step, and step * sum(Q), per row of x and group
  // int_tile_wide_avx2's joined codes, where it runs (int8 weights, two passes, AVX2 without VNNI)
  std::vector<int16_t> wide(ints && a.kind == INT8 && passes == 2 && vector && !has_vnni() ? a.rows * a.K : 0);
  const Acts acts{q.data(), s.data(), s.data() + a.rows * groups, passes, wide.empty() ? nullptr : wide.data()};
  const int64_t quantised = ints ? a.rows : 0, dots = corr ? a.rows * corr->rank : 0;
  two_loops(
      quantised + dots,
      [&](int64_t begin, int64_t end) {
        std::vector<float> res(ints ? a.group : 0);  // a group's residual between the passes
        for (int64_t i = begin; i < end; ++i) {
          if (i < quantised) {
            quantise_row(a, acts, i, vector, res.data());
            const int8_t *q1 = acts.q + 2 * i * a.K, *q2 = q1 + a.K;
            if (acts.wide)
              for (int64_t k = 0; k < a.K; ++k) acts.wide[i * a.K + k] = static_cast<int16_t>(DIGIT * q1[k] + q2[k]);
          } else if (const int64_t j = i - quantised; corr->corrects(j / corr->rank)) {
            corr->t[j] = dot_half(a.x + (j / corr->rank) * a.K, corr->A + (j % corr->rank) * a.K, a.K, vector);
          }
        }
      },
      a.blocks,
      [&](int64_t begin, int64_t end) {
        // the portable path's bf16 tile, decoded per chunk of K
        float* tile = ints || vector ? nullptr
                                     : static_cast<float*>(std::aligned_alloc(64, a.kc_max * NB * sizeof(float)));
        for (int64_t b = begin; b < end; ++b) {
          ints ? int_block(a, acts, b, vector) : float_block(a, b, tile, vector);
          if (corr) add_correction(a, *corr, b, vector);
        }
        std::free(tile);
      });
}

// Kernel, then the optional low-rank correction `y += (x A^T) B'` (A [r, K] fp16 stored as int16 bits; B' as
// `corr_tiles` [n, 16] and `corr_index` [ceil(O / 16), 3], clover.ops.woq.tile_correction), and the cast back to
// x's dtype: one call from Python per layer. `chunk`: K per tile of the portable fp32 / bf16 path; `passes`: 1
// rounds int8 / int4's activations to int8 once, 2 also their residual (file header). The reshape and cast happen
// here, not in Python: a one-token step makes 121 of these calls.
torch::Tensor woq_linear(torch::Tensor input, torch::Tensor w, torch::Tensor scale, torch::Tensor zero, int64_t kind,
                         int64_t out_features, int64_t group, int64_t chunk, bool vector,
                         c10::optional<torch::Tensor> corr_a, c10::optional<torch::Tensor> corr_tiles,
                         c10::optional<torch::Tensor> corr_index, int64_t passes, int64_t corr_period,
                         int64_t corr_from) {  // defaults in woq.h
  TORCH_CHECK(input.dim() >= 1 && input.is_floating_point(), "x must be a float tensor [..., K]");
  TORCH_CHECK(w.is_contiguous() && scale.is_contiguous() && zero.is_contiguous(), "packed tensors must be contiguous");
  const int64_t K = input.size(-1), blocks = (out_features + NB - 1) / NB;
  const torch::Tensor x = input.scalar_type() == torch::kFloat && input.is_contiguous()
                              ? input
                              : input.to(torch::kFloat).contiguous();
  const int64_t rows = x.numel() / std::max<int64_t>(K, 1);
  std::vector<int64_t> shape = input.sizes().vec();
  shape.back() = out_features;
  // the portable fp32 / bf16 path adds into y chunk by chunk of K; the others write every output once
  vector = vector && has_avx2();
  auto y = kind >= INT8 || vector ? torch::empty(shape, x.options()) : torch::zeros(shape, x.options());
  Args a{x.data_ptr<float>(), rows, K, out_features, blocks, chunk, group, kind,
         w.data_ptr(), kind >= INT8 ? static_cast<const uint16_t*>(scale.data_ptr()) : nullptr,
         kind == INT4 ? static_cast<const uint16_t*>(zero.data_ptr()) : nullptr, y.data_ptr<float>()};
  if (kind >= INT8) {
    TORCH_CHECK(group > 0 && group % 8 == 0 && K % group == 0, "group size must be a multiple of 8 dividing K");
    TORCH_CHECK(passes == 1 || passes == 2, "activation passes must be 1 or 2, got ", passes);
    // two passes join a group's dot products in int32: |254 dot1 + dot2| <= 255 * group * 127 * max|code|
    const int64_t widest = ((int64_t{1} << 31) - 1) / (255 * 127 * (kind == INT4 ? 15 : 127));
    TORCH_CHECK(passes == 1 || group <= widest, "two activation passes (int8x2) would overflow int32 in ",
                kind == INT4 ? "int4" : "int8", " groups of ", group, " weights: at most ", widest,
                " per group, or one pass (int8)");
  }
  std::vector<float> t;
  Corr corr{};
  if (corr_a.has_value()) {
    TORCH_CHECK(corr_tiles.has_value() && corr_index.has_value(), "a correction needs A, its tiles and their index");
    const auto &A = *corr_a, &tiles = *corr_tiles, &index = *corr_index;
    TORCH_CHECK(A.dim() == 2 && A.size(1) == K && A.is_contiguous() && A.element_size() == 2 &&
                    A.scalar_type() != torch::kBFloat16,
                "the correction's A must be [r, K] fp16 (or its int16 bits), contiguous");
    TORCH_CHECK(tiles.dim() == 2 && tiles.size(1) == NB && tiles.is_contiguous() && tiles.element_size() == 2 &&
                    tiles.scalar_type() != torch::kBFloat16,
                "the correction's tiles must be [n, 16] fp16 (or its int16 bits), contiguous");
    TORCH_CHECK(index.scalar_type() == torch::kLong && index.is_contiguous() && index.dim() == 2 &&
                    index.size(0) == blocks && index.size(1) == 3,
                "the correction's index must be int64 [ceil(out_features / 16), 3]");
    const int64_t rank = A.size(0), n = tiles.size(0);
    const int64_t* ip = index.data_ptr<int64_t>();
    for (int64_t b = 0; b < blocks; ++b)
      TORCH_CHECK(ip[3 * b] >= 0 && ip[3 * b + 1] >= 0 && ip[3 * b] + ip[3 * b + 1] <= rank && ip[3 * b + 2] >= 0 &&
                      ip[3 * b + 2] + ip[3 * b + 1] <= n,
                  "the correction's index points outside A [", rank, ", K] or its ", n, " tile rows");
    TORCH_CHECK(corr_period >= 1 && corr_from >= 0 && rows % corr_period == 0,
                "a gated correction needs rows in whole sequences of corr_period >= 1 tokens and corr_from >= 0");
    t.resize(rows * rank);
    corr = Corr{static_cast<const uint16_t*>(A.data_ptr()), rank, static_cast<const uint16_t*>(tiles.data_ptr()),
                ip, t.data(), corr_period, corr_from};
  }
  if (rows) run(a, passes, corr_a.has_value() ? &corr : nullptr, vector);
  return input.scalar_type() == torch::kFloat ? y : y.to(input.scalar_type());
}

// One output row of a packed int8 / int4 layer as dense fp32, s * q (+ m) per group, rounded as `woq.unpack` rounds
// (a product, then a sum: no FMA, so the two paths agree bit for bit). `wb` is the row's block of 16 columns, `j`
// its column there, `sp` / `zp` the block's scales / minima.
static void dequantize_row(int64_t kind, const uint8_t* wb, int64_t j, const uint16_t* sp, const uint16_t* zp,
                           int64_t K, int64_t group, float* row) {
  for (int64_t g = 0; g < K / group; ++g) {
    const float s = half_to_f32(sp[g * NB + j]), m = zp ? half_to_f32(zp[g * NB + j]) : 0.f;
    for (int64_t k = g * group; k < (g + 1) * group; k += 8) {
      if (kind == INT4) {  // [k / 8][j][k % 4]: k % 8 < 4 in the low nibble, k + 4 in the high one
        const uint8_t* p = wb + ((k / 8) * NB + j) * 4;
        for (int t = 0; t < 4; ++t) {
          row[k + t] = s * static_cast<float>(p[t] & 15) + m;
          row[k + t + 4] = s * static_cast<float>(p[t] >> 4) + m;
        }
      } else {  // [k / 4][j][k % 4], two steps of 4 k
        for (int h = 0; h < 2; ++h) {
          const int8_t* p = reinterpret_cast<const int8_t*>(wb + (((k + 4 * h) / 4) * NB + j) * 4);
          for (int t = 0; t < 4; ++t) row[k + 4 * h + t] = s * static_cast<float>(p[t]);
        }
      }
    }
  }
}

#ifdef WOQ_X86
// `dequantize_row` 8 k at a time: the step's 8 codes as one 8-byte vector (int4: the 4 low nibbles, then the 4
// high), widened to 8 floats. Compiled without "fma", so the product and the sum stay two roundings.
__attribute__((target("avx2"))) static void dequantize_row_avx2(int64_t kind, const uint8_t* wb, int64_t j,
                                                                const uint16_t* sp, const uint16_t* zp, int64_t K,
                                                                int64_t group, float* row) {
  const __m128i low = _mm_set1_epi8(15);
  for (int64_t g = 0; g < K / group; ++g) {
    const __m256 s = _mm256_set1_ps(half_to_f32(sp[g * NB + j]));
    const __m256 m = _mm256_set1_ps(zp ? half_to_f32(zp[g * NB + j]) : 0.f);
    for (int64_t k = g * group; k < (g + 1) * group; k += 8) {
      int32_t a, b;
      __m256 q;
      if (kind == INT4) {
        std::memcpy(&a, wb + ((k / 8) * NB + j) * 4, 4);
        const __m128i v = _mm_cvtsi32_si128(a);
        const __m128i codes = _mm_unpacklo_epi32(_mm_and_si128(v, low), _mm_and_si128(_mm_srli_epi16(v, 4), low));
        q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes));
      } else {
        std::memcpy(&a, wb + ((k / 4) * NB + j) * 4, 4);
        std::memcpy(&b, wb + ((k / 4 + 1) * NB + j) * 4, 4);
        q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpacklo_epi32(_mm_cvtsi32_si128(a), _mm_cvtsi32_si128(b))));
      }
      _mm256_storeu_ps(row + k, kind == INT4 ? _mm256_add_ps(_mm256_mul_ps(s, q), m) : _mm256_mul_ps(s, q));
    }
  }
}
#endif

// The dense fp32 weights [O, K] a packed int8 / int4 layer stands for, s * q (+ m), as `woq.unpack` computes them:
// prompt rows multiply these with torch's matmul where the integer kernel above has no AVX512-VNNI, and is slower
// there for a prompt's many rows (clover.model.quant.prompt_matmul). One thread per block of 16 output columns.
torch::Tensor woq_dequantize(torch::Tensor w, torch::Tensor scale, torch::Tensor zero, int64_t kind,
                             int64_t out_features, int64_t K, int64_t group, bool vector) {
  TORCH_CHECK(kind == INT8 || kind == INT4, "dequantize takes int8 / int4 weights, got kind ", kind);
  TORCH_CHECK(group > 0 && group % 8 == 0 && K % group == 0, "group size must be a multiple of 8 dividing K");
  TORCH_CHECK(w.is_contiguous() && scale.is_contiguous() && zero.is_contiguous(), "packed tensors must be contiguous");
  const int64_t blocks = (out_features + NB - 1) / NB, groups = K / group, per_byte = kind == INT4 ? 2 : 1;
  TORCH_CHECK(w.numel() * w.element_size() == blocks * K * NB / per_byte &&
                  scale.numel() * scale.element_size() == blocks * groups * NB * 2 &&
                  (kind == INT8 || zero.numel() * zero.element_size() == blocks * groups * NB * 2),
              "packed tensors do not match [", out_features, ", ", K, "] weights in groups of ", group);
  auto out = torch::empty({out_features, K}, torch::kFloat);
  const uint8_t* wp = static_cast<const uint8_t*>(w.data_ptr());
  const uint16_t* sp = static_cast<const uint16_t*>(scale.data_ptr());
  const uint16_t* zp = kind == INT4 ? static_cast<const uint16_t*>(zero.data_ptr()) : nullptr;
  float* y = out.data_ptr<float>();
  vector = vector && has_avx2();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* wb = wp + b * K * NB / per_byte;
      const uint16_t *sb = sp + b * groups * NB, *zb = zp ? zp + b * groups * NB : nullptr;
      for (int64_t j = 0; j < std::min<int64_t>(NB, out_features - b * NB); ++j) {
        float* row = y + (b * NB + j) * K;
#ifdef WOQ_X86
        if (vector) {
          dequantize_row_avx2(kind, wb, j, sb, zb, K, group, row);
          continue;
        }
#endif
        dequantize_row(kind, wb, j, sb, zb, K, group, row);
      }
    }
  });
  return out;
}

bool woq_has_avx2() { return has_avx2(); }

bool woq_has_vnni() { return has_vnni(); }

float woq_dot(const float* x, const float* w, int64_t n, bool vector) {
#ifdef WOQ_X86
  if (vector) return dot_avx2(x, w, n);
#endif
  float sum = 0;
  for (int64_t k = 0; k < n; ++k) sum += x[k] * w[k];
  return sum;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("woq_linear", &woq_linear, "weight-streaming linear (packed fp32/bf16/int8/int4 weights)", py::arg("x"),
        py::arg("w"), py::arg("scale"), py::arg("zero"), py::arg("kind"), py::arg("out_features"), py::arg("group"),
        py::arg("chunk"), py::arg("vector"), py::arg("corr_a") = py::none(), py::arg("corr_tiles") = py::none(),
        py::arg("corr_index") = py::none(), py::arg("passes") = 1, py::arg("corr_period") = 1,
        py::arg("corr_from") = 0);
  m.def("dequantize", &woq_dequantize, "the dense fp32 weights of a packed int8 / int4 layer", py::arg("w"),
        py::arg("scale"), py::arg("zero"), py::arg("kind"), py::arg("out_features"), py::arg("K"), py::arg("group"),
        py::arg("vector") = true);
  m.def("has_avx2", &woq_has_avx2, "whether the AVX2+FMA path can run on this CPU");
  m.def("has_vnni", &woq_has_vnni, "whether int8 / int4 tiles take AVX512-VNNI's dot product");
  m.def("moe", &moe_forward, "a sparse MoE layer over stacked packed experts, grouped by expert (moe.cpp)",
        py::arg("x"), py::arg("router"), py::arg("top_k"), py::arg("normalize"), py::arg("gate_up"), py::arg("down"),
        py::arg("shared_gate_up") = py::none(), py::arg("shared_down") = py::none(),
        py::arg("shared_gate") = py::none(), py::arg("passes") = 1, py::arg("vector") = true);
  m.def("deltanet_step", &deltanet_step, "one Gated DeltaNet decoding step after the input projections (deltanet.cpp)");
  m.def("decoder_layers", &decoder_layers, "Llama-form decoder layers over packed weights, in turn (layer.cpp)");
}
