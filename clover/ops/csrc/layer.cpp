// A Llama-form decoder layer over packed weights (woq.cpp's kernels), in one call from Python:
//
//   x = rms_norm(h) w1;  [q | k | v] = x Wqkv^T;  q, k = RoPE(q, k);  k, v -> the cache at [past, past + T)
//   a = softmax(q K^T / sqrt(D) + mask) V  (each query head reads kv head  head / (heads / kv_heads))
//   h = h + a Wo^T;  x = rms_norm(h) w2;  [g | u] = x Wgu^T;  h = h + (silu(g) * u) Wdown^T
//
// Why: a decoding step of a small model runs ~45 small ops per layer; on a CPU each costs 3-40 us of dispatch
// and allocation in eager PyTorch, more than the weights take to stream at one token. Here the linear layers are
// woq.cpp's kernels and the rest are plain loops over the rows. The attention of a few query rows (a block step)
// is a loop over the keys with a max-subtracted softmax; more rows (a prefill) go to
// at::scaled_dot_product_attention, whose tiled GEMMs pay off there.
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

torch::Tensor linear(const PackedArgs& p, const torch::Tensor& x, int64_t chunk, bool vector) {
  return woq_linear(x, std::get<0>(p), std::get<1>(p), std::get<2>(p), std::get<3>(p), std::get<4>(p),
                    std::get<5>(p), chunk, vector, std::get<6>(p), std::get<7>(p));
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

// out [D] = sum_s p_s v_s / sum_s p_s, p_s = exp(q.k_s / sqrt(D) - max), over the visible keys s < S.
template <typename Visible>
void attend_row(const float* q, const float* keys, int64_t key_stride, const float* values, int64_t value_stride,
                int64_t S, int64_t D, float scale, Visible visible, float* scores, float* out, bool vector) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t s = 0; s < S; ++s) {
    scores[s] = visible(s) ? woq_dot(q, keys + s * key_stride, D, vector) * scale
                           : -std::numeric_limits<float>::infinity();
    top = std::max(top, scores[s]);
  }
  std::fill(out, out + D, 0.f);
  float total = 0.f;
  for (int64_t s = 0; s < S; ++s) {
    if (scores[s] == -std::numeric_limits<float>::infinity()) continue;
    const float p = std::exp(scores[s] - top);
    total += p;
    const float* v = values + s * value_stride;
    for (int64_t d = 0; d < D; ++d) out[d] += p * v[d];
  }
  const float inv = 1.f / total;  // every row sees at least its own key (clover.model.layout.attention_mask)
  for (int64_t d = 0; d < D; ++d) out[d] *= inv;
}

}  // namespace

// h [N, T, hidden] fp32 -> the layer's output (a new tensor). cos / signed_sin [N, 1, T, rd] fp32; the cache
// buffers [N, kv_heads, capacity >= past + T, D] fp32 (written at [past, past + T): the caller commits what it
// keeps); mask: bool [N, 1, T, past + T] (True = may attend, any strides), or none with `is_causal` (then past
// is 0) or every key visible.
torch::Tensor decoder_layer(torch::Tensor h, torch::Tensor norm1, torch::Tensor norm2, double eps,
                            const PackedArgs& qkv, const PackedArgs& o, const PackedArgs& gate_up,
                            const PackedArgs& down, torch::Tensor cos, torch::Tensor signed_sin,
                            torch::Tensor k_cache, torch::Tensor v_cache, int64_t past,
                            c10::optional<torch::Tensor> mask, bool is_causal, int64_t heads, int64_t kv_heads,
                            int64_t head_dim, int64_t chunk, bool vector) {
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

  auto proj = linear(qkv, rms_norm(h, norm1, feps, vector), chunk, vector);  // [N, T, qw + 2 kw]
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
    // one task per (row, head): threads only where the keys make it worth a wake-up
    const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, S * D));
    at::parallel_for(0, N * T * heads, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(S);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t n = i / (T * heads), t = (i / heads) % T, hd = i % heads, j = hd / group;
        const float* q = pp + (n * T + t) * (qw + 2 * kw) + hd * D;
        const float *keys = kc + n * ks0 + j * ks1, *values = vc + n * vs0 + j * vs1;
        float* out = ap + (n * T + t) * qw + hd * D;
        if (mp) {
          const bool* m = mp + n * ms0 + t * ms2;
          attend_row(q, keys, ks2, values, vs2, S, D, scale, [&](int64_t s) { return m[s * ms3]; }, scores.data(),
                     out, vector);
        } else {
          const int64_t last = is_causal ? past + t : S - 1;
          attend_row(q, keys, ks2, values, vs2, S, D, scale, [&](int64_t s) { return s <= last; }, scores.data(),
                     out, vector);
        }
      }
    });
  }

  auto out = h + linear(o, att, chunk, vector);
  auto gu = linear(gate_up, rms_norm(out, norm2, feps, vector), chunk, vector);  // [N, T, 2 I]
  const int64_t I = gu.size(-1) / 2, rows = N * T;
  auto act = torch::empty({N, T, I}, h.options());
  const float* g = gu.data_ptr<float>();
  float* a = act.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < I; ++i) {
      const float x = g[r * 2 * I + i];
      a[r * I + i] = x / (1.f + std::exp(-x)) * g[r * 2 * I + I + i];
    }
  out.add_(linear(down, act, chunk, vector));
  return out;
}
