// A Llama-form decoder layer over packed weights (woq.cpp's kernels), in one call from Python:
//
//   x = rms_norm(h) w1;  [q | k | v] = x Wqkv^T;  q, k = RoPE(q, k);  k, v -> the cache at [past, past + T)
//   a = softmax(q K^T / sqrt(D) + mask) V  (each query head reads kv head  head / (heads / kv_heads))
//   h = h + a Wo^T;  x = rms_norm(h) w2;  [g | u] = x Wgu^T;  h = h + (silu(g) * u) Wdown^T
//
// Why: a decoding step of a small model runs ~45 small ops per layer; on a CPU each costs 3-40 us of dispatch
// and allocation in eager PyTorch, more than the weights take to stream at one token. Here the linear layers are
// woq.cpp's kernels and the rest are plain loops over the rows. The attention of a few query rows (a block step)
// is a loop over the keys with a max-subtracted softmax, the queries of a kv head reading each key once; more rows
// (a prefill) go to at::scaled_dot_product_attention, whose tiled GEMMs pay off there.
//
// clover.model.modeling.DecoderLayer's module path is the reference this must equal (tests/model/test_fused_layer.py).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "woq.h"

namespace {

constexpr int64_t LOOP_ROWS = 32;  // query rows up to which attention runs as loops (a block step), else SDPA
constexpr int64_t MAX_ROTARY = 1024;
constexpr int64_t KEY_CHUNK = 64;  // keys (values) per chunk of the loops' attention: 16 KiB of fp32 at D = 64, in L1

// x [N, T, F]; a gated adapter's correction acts from position `gated_from` of each row's T tokens on (0: all)
torch::Tensor linear(const PackedArgs& p, const torch::Tensor& x, int64_t chunk, bool vector, int64_t gated_from) {
  return woq_linear(x, std::get<0>(p), std::get<1>(p), std::get<2>(p), std::get<3>(p), std::get<4>(p),
                    std::get<5>(p), chunk, vector, std::get<6>(p), std::get<7>(p), std::get<8>(p), std::get<9>(p),
                    x.size(1), gated_from);
}

// y = (x / sqrt(mean(x^2) + eps)) * w per row, in F.rms_norm's order
torch::Tensor rms_norm(const torch::Tensor& h, const torch::Tensor& w, float eps, bool vector) {
  auto y = torch::empty_like(h);
  const int64_t D = h.size(-1), rows = h.numel() / D;
  const float *x = h.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * D;
    const float inv = 1.f / std::sqrt(woq_dot(xr, xr, D, vector) / static_cast<float>(D) + eps);
    for (int64_t d = 0; d < D; ++d) yp[r * D + d] = xr[d] * inv * wp[d];
  }
  return y;
}

// Rotate-half RoPE of the first rd channels in place: x[d] cos[d] + x[(d + rd/2) mod rd] ssin[d], ssin = [-sin|sin]
// (clover.model.rope.apply_rotary).
void rope(float* x, const float* cos, const float* ssin, int64_t rd) {
  float out[MAX_ROTARY];
  const int64_t half = rd / 2;
  for (int64_t d = 0; d < rd; ++d) out[d] = x[d] * cos[d] + x[(d + half) % rd] * ssin[d];
  std::copy(out, out + rd, x);
}

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define LAYER_X86 1

// exp of 8 floats: e^x = 2^n e^r, n = round(x log2 e), r = x - n ln 2 (ln 2 split in two for exactness), e^r by
// a degree-7 polynomial (Cephes' expf coefficients): within 2 ulp of std::exp over [-87, 88]; below, ~0.
__attribute__((target("avx2,fma"))) __m256 exp_avx2(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365478515625f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// q . k_{s..s+7} for 8 keys `ks` floats apart (D a multiple of 8): eight accumulators, then one transposing
// reduction (hadd) for all eight instead of eight horizontal sums.
__attribute__((target("avx2,fma"))) __m256 dot8_avx2(const float* q, const float* k, int64_t ks, int64_t D) {
  __m256 a[8];
  for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + i * ks + d), a[i]);
  }
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// attend_rows' AVX2 form (D a multiple of 8) for `nq` query rows that read the same keys and values (the query heads
// of one kv head, at every row of a block step): each chunk of KEY_CHUNK keys (16 KiB of fp32 at D = 64) is read
// from memory once and scored against every query while it is in L1, then each value chunk is summed into every
// query's output likewise. A query's arithmetic is fixed by the keys it sees, not by S or the other queries: keys
// are scored 8 at a time from key 0 (the last, partial eight from a zero-padded copy), softmax sums run in 8 lanes
// over the keys rounded up to 8 (exactly 0 where a key is unseen or absent), out = sum_s p_s v_s in the order of s
// (the accumulators carried between chunks in `acc`). So a block step's row computes what the same token fed
// alone computes, bit for bit.
template <typename Visible>
__attribute__((target("avx2,fma"))) void attend_rows_avx2(const float* const* qs, float* const* outs, int64_t nq,
                                                         const float* keys, int64_t key_stride, const float* values,
                                                         int64_t value_stride, int64_t S, int64_t D, float scale,
                                                         Visible visible, float* scores, float* acc) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t whole = S - S % 8, padded = whole + (S % 8 ? 8 : 0);  // scores' row stride
  std::vector<float> tail(8 * D, 0.f);  // the keys past `whole`, then zeros
  for (int64_t s = whole; s < S; ++s)
    std::copy(keys + s * key_stride, keys + s * key_stride + D, &tail[(s - whole) * D]);
  for (int64_t s0 = 0; s0 < padded; s0 += KEY_CHUNK)
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t s = s0; s < std::min(padded, s0 + KEY_CHUNK); s += 8) {
        const __m256 dots = s < whole ? dot8_avx2(qs[i], keys + s * key_stride, key_stride, D)
                                      : dot8_avx2(qs[i], tail.data(), D, D);
        _mm256_storeu_ps(scores + i * padded + s, _mm256_mul_ps(dots, _mm256_set1_ps(scale)));
      }
  for (int64_t i = 0; i < nq; ++i) {
    float* sc = scores + i * padded;
    float top = ninf;
    for (int64_t s = 0; s < padded; ++s) {
      if (s >= S || !visible(i, s)) sc[s] = ninf;
      top = std::max(top, sc[s]);
    }
    const __m256 topv = _mm256_set1_ps(top), ninfv = _mm256_set1_ps(ninf);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t s = 0; s < padded; s += 8) {  // p = exp(score - max), exactly 0 where masked
      const __m256 x = _mm256_loadu_ps(sc + s);
      const __m256 p = _mm256_and_ps(exp_avx2(_mm256_sub_ps(x, topv)), _mm256_cmp_ps(x, ninfv, _CMP_NEQ_OQ));
      _mm256_storeu_ps(sc + s, p);
      sum = _mm256_add_ps(sum, p);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, sum);
    const float total = lanes[0] + lanes[1] + lanes[2] + lanes[3] + lanes[4] + lanes[5] + lanes[6] + lanes[7];
    acc[i] = 1.f / total;  // every row sees at least its own key (clover.model.layout.attention_mask)
  }
  // out = sum_s p_s v_s / total: per 64 channels (8 registers) and chunk of values, every query in turn, its
  // accumulators carried between chunks in `acc` (so each value row is read once per chunk, in order); then the
  // channels past the last 64, 8 at a time
  float* carry = acc + nq;  // [nq, 64]
  for (int64_t d = 0; d < D; d += 64) {
    const int64_t width = std::min<int64_t>(64, D - d);
    std::fill(carry, carry + nq * 64, 0.f);
    for (int64_t s0 = 0; s0 < S; s0 += KEY_CHUNK) {
      const int64_t s1 = std::min(S, s0 + KEY_CHUNK);
      for (int64_t i = 0; i < nq; ++i) {
        const float* p = scores + i * padded;
        float* c = carry + i * 64;
        if (width == 64) {
          __m256 a[8];
#pragma GCC unroll 8
          for (int u = 0; u < 8; ++u) a[u] = _mm256_loadu_ps(c + 8 * u);
          for (int64_t s = s0; s < s1; ++s) {
            const __m256 ps = _mm256_set1_ps(p[s]);
            const float* v = values + s * value_stride + d;
#pragma GCC unroll 8
            for (int u = 0; u < 8; ++u) a[u] = _mm256_fmadd_ps(ps, _mm256_loadu_ps(v + 8 * u), a[u]);
          }
#pragma GCC unroll 8
          for (int u = 0; u < 8; ++u) _mm256_storeu_ps(c + 8 * u, a[u]);
        } else {
          for (int64_t e = 0; e < width; e += 8) {
            __m256 a = _mm256_loadu_ps(c + e);
            for (int64_t s = s0; s < s1; ++s)
              a = _mm256_fmadd_ps(_mm256_set1_ps(p[s]), _mm256_loadu_ps(values + s * value_stride + d + e), a);
            _mm256_storeu_ps(c + e, a);
          }
        }
      }
    }
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t e = 0; e < width; e += 8)
        _mm256_storeu_ps(outs[i] + d + e, _mm256_mul_ps(_mm256_loadu_ps(carry + i * 64 + e), _mm256_set1_ps(acc[i])));
  }
}

// silu(g) * u = g / (1 + e^-g) * u over n floats
__attribute__((target("avx2,fma"))) void swiglu_avx2(const float* g, const float* u, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), x));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e)),
                                            _mm256_loadu_ps(u + i)));
  }
  for (; i < n; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}
#endif

// out_i [D] = sum_s p_s v_s / sum_s p_s, p_s = exp(q_i.k_s / sqrt(D) - max), over the keys s < S that query i
// sees (visible(i, s)), for `nq` queries reading the same keys and values. `scores`: nq * (S rounded up to 8)
// floats; `acc`: nq * 65 (each query's 1 / sum, then its 64 accumulators).
template <typename Visible>
void attend_rows(const float* const* qs, float* const* outs, int64_t nq, const float* keys, int64_t key_stride,
                 const float* values, int64_t value_stride, int64_t S, int64_t D, float scale, Visible visible,
                 float* scores, float* acc, bool vector) {
#ifdef LAYER_X86
  if (vector && D % 8 == 0)
    return attend_rows_avx2(qs, outs, nq, keys, key_stride, values, value_stride, S, D, scale, visible, scores, acc);
#endif
  for (int64_t i = 0; i < nq; ++i) {
    float *sc = scores + i * S, *out = outs[i];
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t s = 0; s < S; ++s) {
      sc[s] = visible(i, s) ? woq_dot(qs[i], keys + s * key_stride, D, vector) * scale
                            : -std::numeric_limits<float>::infinity();
      top = std::max(top, sc[s]);
    }
    std::fill(out, out + D, 0.f);
    float total = 0.f;
    for (int64_t s = 0; s < S; ++s) {
      if (sc[s] == -std::numeric_limits<float>::infinity()) continue;
      const float p = std::exp(sc[s] - top);
      total += p;
      const float* v = values + s * value_stride;
      for (int64_t d = 0; d < D; ++d) out[d] += p * v[d];
    }
    const float inv = 1.f / total;  // every row sees at least its own key (clover.model.layout.attention_mask)
    for (int64_t d = 0; d < D; ++d) out[d] *= inv;
  }
}

}  // namespace

// h [N, T, hidden] fp32 -> the layer's output (a new tensor). cos / signed_sin [N, 1, T, rd] fp32; the cache
// buffers [N, kv_heads, capacity >= past + T, D] fp32 (written at [past, past + T): the caller commits what it
// keeps); mask: bool [N, 1, T, past + T] (True = may attend, any strides), or none with `is_causal` (then past
// is 0) or every key visible.
static torch::Tensor decoder_layer(torch::Tensor h, torch::Tensor norm1, torch::Tensor norm2, double eps,
                                   const PackedArgs& qkv, const PackedArgs& o, const PackedArgs& gate_up,
                                   const PackedArgs& down, torch::Tensor cos, torch::Tensor signed_sin,
                                   torch::Tensor k_cache, torch::Tensor v_cache, int64_t past,
                                   c10::optional<torch::Tensor> mask, bool is_causal, int64_t heads,
                                   int64_t kv_heads, int64_t head_dim, int64_t chunk, bool vector,
                                   int64_t gated_from) {
  TORCH_CHECK(h.dim() == 3 && h.scalar_type() == torch::kFloat && h.is_contiguous(), "h must be fp32 [N, T, hidden]");
  TORCH_CHECK(k_cache.scalar_type() == torch::kFloat && v_cache.scalar_type() == torch::kFloat &&
                  k_cache.stride(3) == 1 && v_cache.stride(3) == 1 && k_cache.size(2) >= past + h.size(1),
              "the cache buffers must be fp32 [N, kv_heads, >= past + T, head_dim] with unit last stride");
  TORCH_CHECK(cos.is_contiguous() && signed_sin.is_contiguous() && cos.size(-1) <= MAX_ROTARY,
              "cos / signed_sin must be contiguous [N, 1, T, rotary_dim <= 1024]");
  vector = vector && woq_has_avx2();
  const int64_t N = h.size(0), T = h.size(1), D = head_dim, rd = cos.size(-1), S = past + T;
  const int64_t qw = heads * D, kw = kv_heads * D, group = heads / kv_heads;
  const float feps = static_cast<float>(eps);

  auto proj = linear(qkv, rms_norm(h, norm1, feps, vector), chunk, vector, gated_from);  // [N, T, qw + 2 kw]
  float* pp = proj.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = signed_sin.data_ptr<float>();
  float *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), ks2 = k_cache.stride(2);
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1), vs2 = v_cache.stride(2);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t t = 0; t < T; ++t) {
      float* row = pp + (n * T + t) * (qw + 2 * kw);
      const float *c = cp + (n * T + t) * rd, *s = sp + (n * T + t) * rd;
      for (int64_t hd = 0; hd < heads + kv_heads; ++hd) rope(row + hd * D, c, s, rd);
      for (int64_t j = 0; j < kv_heads; ++j) {
        std::copy(row + qw + j * D, row + qw + (j + 1) * D, kc + n * ks0 + j * ks1 + (past + t) * ks2);
        std::copy(row + qw + kw + j * D, row + qw + kw + (j + 1) * D, vc + n * vs0 + j * vs1 + (past + t) * vs2);
      }
    }

  torch::Tensor att;
  if (T > LOOP_ROWS) {
    auto q = proj.narrow(2, 0, qw).view({N, T, heads, D}).transpose(1, 2);
    auto keys = k_cache.narrow(2, 0, S), values = v_cache.narrow(2, 0, S);
    att = at::scaled_dot_product_attention(q, keys, values, mask, 0.0, is_causal && !mask.has_value(),
                                           c10::nullopt, kv_heads != heads)
              .transpose(1, 2)
              .reshape({N, T, qw});
  } else {
    att = torch::empty({N, T, qw}, h.options());
    float* ap = att.data_ptr<float>();
    const bool* mp = mask.has_value() ? mask->data_ptr<bool>() : nullptr;
    const int64_t ms0 = mp ? mask->stride(0) : 0, ms2 = mp ? mask->stride(2) : 0, ms3 = mp ? mask->stride(3) : 0;
    TORCH_CHECK(!mp || (mask->scalar_type() == torch::kBool && mask->size(3) == S), "mask must be bool [N, 1, T, S]");
    const float scale = 1.f / std::sqrt(static_cast<float>(D));
    // One task per kv head and row of the batch: its queries (its query heads at every position) read the same
    // keys and values, so they are read once per task, not once per query (measured on 2 AVX2 cores at 4.6k keys:
    // two to eight positions in 0.7-0.8x the time of a task per query, one in 0.9-1.0x, though three tasks share
    // two threads unevenly); threads only where the keys make it worth a wake-up.
    const int64_t queries = T * group;
    const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, S * D * queries));
    at::parallel_for(0, N * kv_heads, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(queries * ((S + 7) / 8 * 8)), acc(queries * 65);
      std::vector<const float*> qs(queries);
      std::vector<float*> outs(queries);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t n = task / kv_heads, j = task % kv_heads;
        for (int64_t i = 0; i < queries; ++i) {  // query i: position t = i / group, head j * group + i % group
          const int64_t t = i / group, hd = j * group + i % group;
          qs[i] = pp + (n * T + t) * (qw + 2 * kw) + hd * D;
          outs[i] = ap + (n * T + t) * qw + hd * D;
        }
        const float *keys = kc + n * ks0 + j * ks1, *values = vc + n * vs0 + j * vs1;
        if (mp) {
          const bool* m = mp + n * ms0;
          attend_rows(qs.data(), outs.data(), queries, keys, ks2, values, vs2, S, D, scale,
                      [&](int64_t i, int64_t s) { return m[i / group * ms2 + s * ms3]; }, scores.data(), acc.data(),
                      vector);
        } else {
          attend_rows(qs.data(), outs.data(), queries, keys, ks2, values, vs2, S, D, scale,
                      [&](int64_t i, int64_t s) { return !is_causal || s <= past + i / group; }, scores.data(),
                      acc.data(), vector);
        }
      }
    });
  }

  auto out = h + linear(o, att, chunk, vector, gated_from);
  auto gu = linear(gate_up, rms_norm(out, norm2, feps, vector), chunk, vector, gated_from);  // [N, T, 2 I]
  const int64_t I = gu.size(-1) / 2, rows = N * T;
  auto act = torch::empty({N, T, I}, h.options());
  const float* g = gu.data_ptr<float>();
  float* a = act.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float *gr = g + r * 2 * I, *ur = gr + I;
    float* ar = a + r * I;
#ifdef LAYER_X86
    if (vector) {
      swiglu_avx2(gr, ur, I, ar);
      continue;
    }
#endif
    for (int64_t i = 0; i < I; ++i) ar[i] = gr[i] / (1.f + std::exp(-gr[i])) * ur[i];
  }
  out.add_(linear(down, act, chunk, vector, gated_from));
  return out;
}

// The layers of a model one after another, each `decoder_layer` (its output the next one's input), in one call
// from Python: a call per layer cost ~10 us of Python dispatch each (a one-token forward of clover-smol's 30
// layers: 9.37 ms, 9.04 in one call). Every layer's cache holds the same `past` positions.
torch::Tensor decoder_layers(torch::Tensor h, const std::vector<LayerWeights>& layers, torch::Tensor cos,
                             torch::Tensor signed_sin, const std::vector<torch::Tensor>& k_caches,
                             const std::vector<torch::Tensor>& v_caches, int64_t past,
                             c10::optional<torch::Tensor> mask, bool is_causal, int64_t heads, int64_t kv_heads,
                             int64_t head_dim, int64_t chunk, bool vector, int64_t gated_from) {
  TORCH_CHECK(k_caches.size() == layers.size() && v_caches.size() == layers.size(),
              "one key and one value buffer per layer: ", layers.size(), " layers, ", k_caches.size(), " and ",
              v_caches.size(), " buffers");
  for (size_t i = 0; i < layers.size(); ++i) {
    const auto& [norm1, norm2, eps, qkv, o, gate_up, down] = layers[i];
    h = decoder_layer(h, norm1, norm2, eps, qkv, o, gate_up, down, cos, signed_sin, k_caches[i], v_caches[i], past,
                      mask, is_causal, heads, kv_heads, head_dim, chunk, vector, gated_from);
  }
  return h;
}
