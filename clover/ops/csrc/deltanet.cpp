// One Gated DeltaNet decoding step (one committed token per row, its history cached) in one call, after the layer's
// input projections and before its output projection (clover.model.deltanet.GatedDeltaNet, whose module path is the
// reference: tests/model/test_deltanet_step.py). Per row n, with the conv window h [C, K-1] of the previous inputs:
//   c = silu(sum_j w[c, j] [h, m][c, j]  (+ w_right[c, 0] m[c]: the right-context conv's tap 0, a block of one));
//   q, k (per key head) L2-normalised (x / sqrt(|x|^2 + 1e-6)), q scaled by dk^-0.5, shared by Hv / Hk value heads;
//   beta = sigmoid(b);  g = -exp(A_log) softplus(a + dt_bias);
//   S' = S exp(g);  delta = (v - S'^T k) beta;  S'' = S' + k delta^T;  o = S''^T q;
//   y = w_norm * o / rms(o) * silu(z)  (per value head).
// Two passes over each head's state [dk, dv] (decay and read k; write and read q), into a new state tensor: the cache
// may have recorded the old one (CloverCache.mark). With `keep_states` (exact mode's verified drafts, to be partly
// undone) each token's step writes into a slot of its own, so the state after every prefix of the tokens is kept at
// no extra pass: undoing the rejected ones picks a slot (CloverCache.rewind) instead of stepping the kept ones
// again. Value heads run in parallel.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

float silu(float v) { return v / (1.f + std::exp(-v)); }

float softplus(float v) { return v > 20.f ? v : std::log1p(std::exp(v)); }  // torch's threshold of 20

// The state passes of one head, s and out [dk, dv] (out may be s), vectorised by the compiler per CPU.
__attribute__((target_clones("avx512f", "avx2", "default"))) void head_step(const float* s, float* out,
                                                                          const float* q, const float* k,
                                                                          const float* v, float decay, float beta,
                                                                          int64_t dk, int64_t dv, float* o) {
  std::vector<float> kv(dv, 0.f);
  for (int64_t i = 0; i < dk; ++i) {
    const float* si = s + i * dv;
    float* ti = out + i * dv;
    const float ki = k[i];
    for (int64_t j = 0; j < dv; ++j) {
      const float x = si[j] * decay;
      ti[j] = x;
      kv[j] += x * ki;
    }
  }
  for (int64_t j = 0; j < dv; ++j) kv[j] = (v[j] - kv[j]) * beta;  // delta
  for (int64_t j = 0; j < dv; ++j) o[j] = 0.f;
  for (int64_t i = 0; i < dk; ++i) {
    float* ti = out + i * dv;
    const float ki = k[i], qi = q[i];
    for (int64_t j = 0; j < dv; ++j) {
      const float x = ti[j] + ki * kv[j];
      ti[j] = x;
      o[j] += x * qi;
    }
  }
}

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous(), name, " must be contiguous fp32");
}

}  // namespace

// mixed [N, T, C], z [N, T, Hv dv], a and b [N, T, Hv]: T causal tokens per row, stepped in turn (each step the same
// code and bits as a forward of that token alone) -> (y [N, T, Hv dv], new state [N, Hv, dk, dv], new conv window
// [N, C, K-1], states [T, N, Hv, dk, dv]: with `keep_states` the state after each token (the new state is its last
// slot, a view), else empty).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor>
deltanet_step(torch::Tensor mixed, torch::Tensor z, torch::Tensor a, torch::Tensor b, torch::Tensor history,
              torch::Tensor conv_w, c10::optional<torch::Tensor> right_w, torch::Tensor a_log, torch::Tensor dt_bias,
              torch::Tensor norm_w, double norm_eps, torch::Tensor state, int64_t k_heads, int64_t dk, int64_t dv,
              bool keep_states) {
  for (const auto& [t, name] : {std::pair{&mixed, "mixed"}, {&z, "z"}, {&a, "a"}, {&b, "b"}, {&history, "history"},
                                {&conv_w, "conv weight"}, {&a_log, "A_log"}, {&dt_bias, "dt_bias"},
                                {&norm_w, "norm weight"}, {&state, "state"}})
    check_f32(*t, name);
  TORCH_CHECK(mixed.dim() == 3, "mixed must be [N, T, C]");
  const int64_t N = mixed.size(0), T = mixed.size(1), C = mixed.size(2), Hv = state.size(1), K = conv_w.size(-1);
  TORCH_CHECK(state.dim() == 4 && state.size(0) == N && state.size(2) == dk && state.size(3) == dv,
              "state must be [N, Hv, dk, dv]");
  TORCH_CHECK(k_heads > 0 && Hv % k_heads == 0 && C == 2 * k_heads * dk + Hv * dv, "mixed must be [N, T, 2 Hk dk + Hv dv]");
  TORCH_CHECK(K >= 2 && conv_w.numel() == C * K && history.numel() == N * C * (K - 1),
              "conv weight [C, 1, K], history [N, C, K-1]");
  TORCH_CHECK(z.numel() == N * T * Hv * dv && a.numel() == N * T * Hv && b.numel() == N * T * Hv &&
                  norm_w.numel() == dv && a_log.numel() == Hv && dt_bias.numel() == Hv,
              "z [N, T, Hv dv], a and b [N, T, Hv], norm weight [dv], A_log and dt_bias [Hv]");
  if (right_w) {
    check_f32(*right_w, "right conv weight");
    TORCH_CHECK(right_w->numel() == C * K, "right conv weight must be [C, 1, K]");
  }
  auto opts = mixed.options();
  auto y = torch::empty({N, T, Hv * dv}, opts);
  // one slot per token (keep_states) or one slot stepped in place
  auto states = torch::empty({keep_states ? T : 1, N, Hv, dk, dv}, opts);
  auto window = torch::empty({N, C, K - 1}, opts), conv = torch::empty({N, T, C}, opts);
  const float *m = mixed.data_ptr<float>(), *hist = history.data_ptr<float>(), *w = conv_w.data_ptr<float>();
  const float* rw = right_w ? right_w->data_ptr<float>() : nullptr;
  float *cp = conv.data_ptr<float>(), *win = window.data_ptr<float>();
  // per channel: the conv over [history, inputs] (+ tap 0 of the right conv: each token a block of one) and SiLU,
  // then the next window (the last K-1 of [history, inputs])
  at::parallel_for(0, N * C, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = i / C, c = i % C;
      const float* hc = hist + i * (K - 1);
      auto full = [&](int64_t j) { return j < K - 1 ? hc[j] : m[(n * T + j - (K - 1)) * C + c]; };
      for (int64_t t = 0; t < T; ++t) {
        float acc = 0.f;
        for (int64_t j = 0; j < K; ++j) acc += w[c * K + j] * full(t + j);
        const float x = m[(n * T + t) * C + c];
        if (rw) acc += x * rw[c * K];
        cp[(n * T + t) * C + c] = silu(acc);
      }
      for (int64_t j = 0; j < K - 1; ++j) win[i * (K - 1) + j] = full(T + j);
    }
  });
  const int64_t rep = Hv / k_heads, key_dim = k_heads * dk;
  const float qscale = 1.f / std::sqrt(static_cast<float>(dk));
  const float *zp = z.data_ptr<float>(), *ap = a.data_ptr<float>(), *bp = b.data_ptr<float>();
  const float *alog = a_log.data_ptr<float>(), *dt = dt_bias.data_ptr<float>(), *nw = norm_w.data_ptr<float>();
  const float* sp = state.data_ptr<float>();
  float *yp = y.data_ptr<float>(), *osp = states.data_ptr<float>();
  const int64_t slot = N * Hv * dk * dv;  // one token's states
  at::parallel_for(0, N * Hv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(dk), k(dk), v(dv), o(dv);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = i / Hv, h = i % Hv, kh = h / rep;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t nt = n * T + t;  // [N, T, ...] rows
        const float* row = cp + nt * C;
        // q and k of the key head, L2-normalised
        float qq = 0.f, kk = 0.f;
        for (int64_t d = 0; d < dk; ++d) {
          qq += row[kh * dk + d] * row[kh * dk + d];
          kk += row[key_dim + kh * dk + d] * row[key_dim + kh * dk + d];
        }
        const float qn = 1.f / std::sqrt(qq + 1e-6f), kn = 1.f / std::sqrt(kk + 1e-6f);
        for (int64_t d = 0; d < dk; ++d) {
          q[d] = row[kh * dk + d] * qn * qscale;
          k[d] = row[key_dim + kh * dk + d] * kn;
        }
        for (int64_t d = 0; d < dv; ++d) v[d] = row[2 * key_dim + h * dv + d];
        const float g = -std::exp(alog[h]) * softplus(ap[nt * Hv + h] + dt[h]);
        const float beta = 1.f / (1.f + std::exp(-bp[nt * Hv + h]));
        // the first token reads the cached state, the rest the state the token before wrote (the same slot, in
        // place: each element read, then written; or the slot before)
        float* out = osp + (keep_states ? t * slot : 0) + i * dk * dv;
        const float* in = t == 0 ? sp + i * dk * dv : keep_states ? out - slot : out;
        head_step(in, out, q.data(), k.data(), v.data(), std::exp(g), beta, dk, dv, o.data());
        // gated RMSNorm of the head's output
        float ss = 0.f;
        for (int64_t d = 0; d < dv; ++d) ss += o[d] * o[d];
        const float inv = 1.f / std::sqrt(ss / static_cast<float>(dv) + static_cast<float>(norm_eps));
        float* yt = yp + nt * Hv * dv + h * dv;
        for (int64_t d = 0; d < dv; ++d) yt[d] = nw[d] * (o[d] * inv) * silu(zp[nt * Hv * dv + h * dv + d]);
      }
    }
  });
  return {y, states[states.size(0) - 1], window, keep_states ? states : torch::Tensor()};
}
