// Weight-streaming linear for small row counts on a CPU: y[R, O] = x[R, K] @ W[O, K]^T, with W stored as
// fp32, bf16, int8 (an fp16 scale per output and group of K) or int4 (an fp16 scale and offset per group).
//
// W is packed in blocks of 16 output columns, K-major inside a block: element (o, k) lives at
// [o / 16][k][o % 16] (int4: two k per byte, even k in the low nibble). A thread takes whole blocks; for each
// chunk of K it dequantises the block's tile into an fp32 buffer in L1 once and runs every row over it
// (a 6-row x 16-column register tile of FMAs), so the weights are read and decoded once whatever the row
// count: the cost is flat in rows until the FMAs, not the memory, are the bound.
//
// One source compiles to an AVX2+FMA path (function target attributes, chosen at run time) and a portable
// scalar path; no -march flag, so the same build runs on any x86-64 (and the scalar path on other CPUs).
#include <c10/util/Half.h>
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define WOQ_X86 1
#endif

namespace {

enum Kind : int64_t { F32 = 0, BF16 = 1, INT8 = 2, INT4 = 3 };
constexpr int NB = 16;  // output columns per block
constexpr int MR = 6;   // rows per register tile

struct Args {
  const float* x;
  int64_t rows, K, O, blocks, kc_max, group;
  int64_t kind;
  const void* w;
  const uint16_t* hscale;  // [O / 16, K / group, 16] fp16 bits (int8, int4)
  const uint16_t* hzero;
  float* y;
};

inline float half_to_f32(uint16_t v) { return static_cast<float>(c10::Half(v, c10::Half::from_bits())); }

inline float bf16_to_f32(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// -- portable path ---------------------------------------------------------------------------------------
const float* tile_scalar(const Args& a, int64_t b, int64_t k0, int64_t kc, float* tile) {
  const int64_t K = a.K;
  switch (a.kind) {
    case F32:
      return static_cast<const float*>(a.w) + (b * K + k0) * NB;
    case BF16: {
      const uint16_t* w = static_cast<const uint16_t*>(a.w) + (b * K + k0) * NB;
      for (int64_t i = 0; i < kc * NB; ++i) tile[i] = bf16_to_f32(w[i]);
      return tile;
    }
    case INT8: {
      const int8_t* w = static_cast<const int8_t*>(a.w) + (b * K + k0) * NB;
      const int64_t groups = K / a.group;
      for (int64_t k = 0; k < kc; ++k) {
        const uint16_t* s = a.hscale + (b * groups + (k0 + k) / a.group) * NB;
        for (int j = 0; j < NB; ++j) tile[k * NB + j] = static_cast<float>(w[k * NB + j]) * half_to_f32(s[j]);
      }
      return tile;
    }
    default: {  // INT4
      const uint8_t* w = static_cast<const uint8_t*>(a.w) + (b * K + k0) / 2 * NB;
      const int64_t groups = K / a.group;
      for (int64_t k = 0; k < kc; ++k) {
        const int64_t g = (k0 + k) / a.group;
        const uint16_t* s = a.hscale + (b * groups + g) * NB;
        const uint16_t* z = a.hzero + (b * groups + g) * NB;
        const uint8_t* row = w + (k / 2) * NB;
        for (int j = 0; j < NB; ++j) {
          const int q = (k & 1) ? (row[j] >> 4) : (row[j] & 15);
          tile[k * NB + j] = static_cast<float>(q) * half_to_f32(s[j]) + half_to_f32(z[j]);
        }
      }
      return tile;
    }
  }
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

// -- AVX2 + FMA path -------------------------------------------------------------------------------------
#ifdef WOQ_X86
__attribute__((target("avx2,fma,f16c"))) const float* tile_avx2(const Args& a, int64_t b, int64_t k0, int64_t kc,
                                                            float* tile) {
  const int64_t K = a.K;
  switch (a.kind) {
    case F32:
      return static_cast<const float*>(a.w) + (b * K + k0) * NB;
    case BF16: {
      const uint16_t* w = static_cast<const uint16_t*>(a.w) + (b * K + k0) * NB;
      for (int64_t i = 0; i < kc * NB; i += 8) {
        __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i)));
        _mm256_store_ps(tile + i, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
      }
      return tile;
    }
    case INT8: {
      const int8_t* w = static_cast<const int8_t*>(a.w) + (b * K + k0) * NB;
      const int64_t groups = K / a.group;
      for (int64_t k = 0; k < kc; ++k) {
        const __m128i* s = reinterpret_cast<const __m128i*>(a.hscale + (b * groups + (k0 + k) / a.group) * NB);
        const __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128(s)), s1 = _mm256_cvtph_ps(_mm_loadu_si128(s + 1));
        __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * NB));
        __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
        __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)));
        _mm256_store_ps(tile + k * NB, _mm256_mul_ps(lo, s0));
        _mm256_store_ps(tile + k * NB + 8, _mm256_mul_ps(hi, s1));
      }
      return tile;
    }
    default: {  // INT4: 16 bytes hold k (low nibbles) and k + 1 (high nibbles) of the block's 16 columns
      const uint8_t* w = static_cast<const uint8_t*>(a.w) + (b * K + k0) / 2 * NB;
      const int64_t groups = K / a.group;
      const __m256i low = _mm256_set1_epi32(15);
      for (int64_t k = 0; k < kc; k += 2) {
        const int64_t g = (k0 + k) / a.group;
        const __m128i* s = reinterpret_cast<const __m128i*>(a.hscale + (b * groups + g) * NB);
        const __m128i* z = reinterpret_cast<const __m128i*>(a.hzero + (b * groups + g) * NB);
        const __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128(s)), s1 = _mm256_cvtph_ps(_mm_loadu_si128(s + 1));
        const __m256 z0 = _mm256_cvtph_ps(_mm_loadu_si128(z)), z1 = _mm256_cvtph_ps(_mm_loadu_si128(z + 1));
        __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (k / 2) * NB));
        __m256i q0 = _mm256_cvtepu8_epi32(q), q1 = _mm256_cvtepu8_epi32(_mm_srli_si128(q, 8));
        float* t = tile + k * NB;
        _mm256_store_ps(t, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q0, low)), s0, z0));
        _mm256_store_ps(t + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q1, low)), s1, z1));
        _mm256_store_ps(t + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q0, 4)), s0, z0));
        _mm256_store_ps(t + 24, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q1, 4)), s1, z1));
      }
      return tile;
    }
  }
}

// R rows x 16 columns of accumulators, U of them per k (taking k round-robin): with few rows, the FMA latency
// (4-5 cycles) would otherwise serialise each accumulator's chain, so R * U >= 4 keeps the FMA ports busy.
template <int R, int U>
__attribute__((target("avx2,fma,f16c"))) void tile_rows_avx2(const float* x, int64_t ldx, const float* t, int64_t kc,
                                                         float* y, int64_t ldy, int64_t cols) {
  __m256 c0[U][R], c1[U][R];
#pragma GCC unroll 24
  for (int u = 0; u < U; ++u)
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) c0[u][i] = c1[u][i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; k += U) {  // kc is a multiple of U (U divides 4, kc of 8)
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) {
      const __m256 w0 = _mm256_loadu_ps(t + (k + u) * NB), w1 = _mm256_loadu_ps(t + (k + u) * NB + 8);
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const __m256 xv = _mm256_broadcast_ss(x + i * ldx + k + u);
        c0[u][i] = _mm256_fmadd_ps(xv, w0, c0[u][i]);
        c1[u][i] = _mm256_fmadd_ps(xv, w1, c1[u][i]);
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    __m256 s0 = c0[0][i], s1 = c1[0][i];
#pragma GCC unroll 4
    for (int u = 1; u < U; ++u) s0 = _mm256_add_ps(s0, c0[u][i]), s1 = _mm256_add_ps(s1, c1[u][i]);
    float* yr = y + i * ldy;
    if (cols == NB) {
      _mm256_storeu_ps(yr, _mm256_add_ps(_mm256_loadu_ps(yr), s0));
      _mm256_storeu_ps(yr + 8, _mm256_add_ps(_mm256_loadu_ps(yr + 8), s1));
    } else {  // the last, partial block of an output size that 16 does not divide
      alignas(32) float acc[NB];
      _mm256_store_ps(acc, s0);
      _mm256_store_ps(acc + 8, s1);
      for (int64_t j = 0; j < cols; ++j) yr[j] += acc[j];
    }
  }
}

__attribute__((target("avx2,fma,f16c"))) void rows_avx2(const Args& a, int64_t b, int64_t k0, int64_t kc, const float* t) {
  const int64_t cols = std::min<int64_t>(NB, a.O - b * NB);
  for (int64_t r = 0; r < a.rows; r += MR) {
    const float* x = a.x + r * a.K + k0;
    float* y = a.y + r * a.O + b * NB;
    switch (std::min<int64_t>(MR, a.rows - r)) {
      case 1: tile_rows_avx2<1, 4>(x, a.K, t, kc, y, a.O, cols); break;
      case 2: tile_rows_avx2<2, 2>(x, a.K, t, kc, y, a.O, cols); break;
      case 3: tile_rows_avx2<3, 1>(x, a.K, t, kc, y, a.O, cols); break;
      case 4: tile_rows_avx2<4, 1>(x, a.K, t, kc, y, a.O, cols); break;
      case 5: tile_rows_avx2<5, 1>(x, a.K, t, kc, y, a.O, cols); break;
      default: tile_rows_avx2<6, 1>(x, a.K, t, kc, y, a.O, cols); break;
    }
  }
}

// One row (a single-token step) of int8 / int4: decode in registers and multiply at once, skipping the tile's
// round trip through L1 that only pays when several rows share it. Two k per iteration, four accumulators.
__attribute__((target("avx2,fma,f16c"))) void one_row_avx2(const Args& a, int64_t b, int64_t k0, int64_t kc) {
  const float* x = a.x + k0;
  const int64_t groups = a.K / a.group;
  __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
  if (a.kind == INT4) {
    const uint8_t* w = static_cast<const uint8_t*>(a.w) + (b * a.K + k0) / 2 * NB;
    const __m256i low = _mm256_set1_epi32(15);
    for (int64_t k = 0; k < kc; k += 2) {
      const int64_t g = (k0 + k) / a.group;
      const __m128i* s = reinterpret_cast<const __m128i*>(a.hscale + (b * groups + g) * NB);
      const __m128i* z = reinterpret_cast<const __m128i*>(a.hzero + (b * groups + g) * NB);
      const __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128(s)), s1 = _mm256_cvtph_ps(_mm_loadu_si128(s + 1));
      const __m256 z0 = _mm256_cvtph_ps(_mm_loadu_si128(z)), z1 = _mm256_cvtph_ps(_mm_loadu_si128(z + 1));
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (k / 2) * NB));
      const __m256i q0 = _mm256_cvtepu8_epi32(q), q1 = _mm256_cvtepu8_epi32(_mm_srli_si128(q, 8));
      const __m256 x0 = _mm256_broadcast_ss(x + k), x1 = _mm256_broadcast_ss(x + k + 1);
      c0 = _mm256_fmadd_ps(x0, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q0, low)), s0, z0), c0);
      c1 = _mm256_fmadd_ps(x0, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q1, low)), s1, z1), c1);
      c2 = _mm256_fmadd_ps(x1, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q0, 4)), s0, z0), c2);
      c3 = _mm256_fmadd_ps(x1, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q1, 4)), s1, z1), c3);
    }
  } else {  // INT8
    const int8_t* w = static_cast<const int8_t*>(a.w) + (b * a.K + k0) * NB;
    for (int64_t k = 0; k < kc; k += 2) {  // a group is even-sized, so k and k + 1 share it
      const __m128i* s = reinterpret_cast<const __m128i*>(a.hscale + (b * groups + (k0 + k) / a.group) * NB);
      const __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128(s)), s1 = _mm256_cvtph_ps(_mm_loadu_si128(s + 1));
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * NB));
      const __m128i r = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (k + 1) * NB));
      const __m256 x0 = _mm256_mul_ps(_mm256_broadcast_ss(x + k), s0);
      const __m256 x1 = _mm256_mul_ps(_mm256_broadcast_ss(x + k), s1);
      const __m256 x2 = _mm256_mul_ps(_mm256_broadcast_ss(x + k + 1), s0);
      const __m256 x3 = _mm256_mul_ps(_mm256_broadcast_ss(x + k + 1), s1);
      c0 = _mm256_fmadd_ps(x0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), c0);
      c1 = _mm256_fmadd_ps(x1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), c1);
      c2 = _mm256_fmadd_ps(x2, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(r)), c2);
      c3 = _mm256_fmadd_ps(x3, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(r, 8))), c3);
    }
  }
  alignas(32) float acc[NB];
  _mm256_store_ps(acc, _mm256_add_ps(c0, c2));
  _mm256_store_ps(acc + 8, _mm256_add_ps(c1, c3));
  float* y = a.y + b * NB;
  const int64_t cols = std::min<int64_t>(NB, a.O - b * NB);
  for (int64_t j = 0; j < cols; ++j) y[j] += acc[j];
}

bool has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
#else
bool has_avx2() { return false; }
#endif

void run(const Args& a, bool vector) {
  // torch's intra-op pool (what torch.set_num_threads sets); each task takes whole column blocks
  at::parallel_for(0, a.blocks, 1, [&](int64_t begin, int64_t end) {
    float* tile = static_cast<float*>(std::aligned_alloc(64, a.kc_max * NB * sizeof(float)));
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t k0 = 0; k0 < a.K; k0 += a.kc_max) {
        const int64_t kc = std::min(a.kc_max, a.K - k0);
#ifdef WOQ_X86
        if (vector) {
          if (a.rows == 1 && (a.kind == INT8 || a.kind == INT4))
            one_row_avx2(a, b, k0, kc);
          else
            rows_avx2(a, b, k0, kc, tile_avx2(a, b, k0, kc, tile));
          continue;
        }
#endif
        rows_scalar(a, b, k0, kc, tile_scalar(a, b, k0, kc, tile));
      }
    }
    std::free(tile);
  });
}

}  // namespace

// x [R, K] fp32 contiguous; returns y [R, out_features] fp32. `chunk`: K per tile (a multiple of the group).
torch::Tensor woq_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scale, torch::Tensor zero, int64_t kind,
                         int64_t out_features, int64_t group, int64_t chunk, bool vector) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x must be [R, K] fp32");
  TORCH_CHECK(w.is_contiguous() && scale.is_contiguous() && zero.is_contiguous(), "packed tensors must be contiguous");
  auto y = torch::zeros({x.size(0), out_features}, x.options());
  Args a{x.data_ptr<float>(), x.size(0), x.size(1), out_features, (out_features + NB - 1) / NB, chunk, group, kind,
         w.data_ptr(), kind >= INT8 ? static_cast<const uint16_t*>(scale.data_ptr()) : nullptr,
         kind == INT4 ? static_cast<const uint16_t*>(zero.data_ptr()) : nullptr, y.data_ptr<float>()};
  if (a.rows) run(a, vector && has_avx2());
  return y;
}

bool woq_has_avx2() { return has_avx2(); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("woq_linear", &woq_linear, "weight-streaming linear (packed fp32/bf16/int8/int4 weights)");
  m.def("has_avx2", &woq_has_avx2, "whether the AVX2+FMA path can run on this CPU");
}
