// A sparse MoE layer in one call over packed experts, grouped by expert (as llama.cpp's mul_mat_id and vLLM's fused
// MoE group them): for x [T, H] fp32,
//   p = softmax(x R^T) (fp32);  the top k experts of each token, weights p / sum(top-k p) when normalised;
//   y_t = sum_{e in top-k(t)} w_te down_e(silu(gate_e x_t) * up_e x_t)  [+ sigmoid(g . x_t) shared(x_t)].
// Each expert's rows (the tokens routed to it, in token order) form one group, multiplied by the expert's packed
// gate|up ([E, 2I, H] stacked) and down ([E, H, I]) weights on woq.cpp's kernels, so each chosen expert's weights
// stream once however many of the rows chose it; the shared expert is one more group over every token. One team of
// threads runs the whole layer: the router's dot products, the routing (one thread), the rows gathered and rounded
// to int8, every (group, block of 16 outputs) of gate|up, the SwiGLU and its rounding, every block of down, and the
// weighted sum per token (in ascending expert order, as clover.ops.woq.moe_reference adds them), with a barrier
// between steps. Blocks are taken dynamically: a prompt's groups differ in rows.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <vector>

#include "woq.h"

using namespace woq_kernel;

namespace {

// One stacked projection's tensors and its per-expert strides.
struct Stack {
  const uint8_t* w;
  const uint16_t *scale, *zero;
  int64_t w_stride, s_stride, kind, out, group;  // strides in bytes (w) and fp16 elements (scale, zero)
};

Stack stack_of(const ExpertArgs& p, int64_t experts, int64_t in_features, const char* name) {
  const auto &w = std::get<0>(p), &s = std::get<1>(p), &z = std::get<2>(p);
  const int64_t kind = std::get<3>(p), out = std::get<4>(p), group = std::get<5>(p);
  TORCH_CHECK(w.is_contiguous() && s.is_contiguous() && z.is_contiguous(), name, ": packed tensors must be contiguous");
  TORCH_CHECK(w.dim() >= 1 && w.size(0) == experts, name, ": packed weights must be stacked [", experts, ", ...]");
  const int64_t blocks = (out + NB - 1) / NB;
  const int64_t bytes = kind == F32 ? 4 : kind == BF16 ? 2 : kind == INT8 ? 1 : 0;  // per weight; int4 half a byte
  TORCH_CHECK(kind >= F32 && kind <= INT4, name, ": unknown weight format ", kind);
  const int64_t per_expert = kind == INT4 ? blocks * in_features * NB / 2 : blocks * in_features * NB * bytes;
  TORCH_CHECK(w.numel() * w.element_size() == experts * per_expert, name, ": packed weights do not match ", experts,
              " experts of [", out, ", ", in_features, "]");
  int64_t s_stride = 0;
  if (kind >= INT8) {
    TORCH_CHECK(group > 0 && group % 8 == 0 && in_features % group == 0, name,
                ": group size must be a multiple of 8 dividing ", in_features);
    s_stride = blocks * (in_features / group) * NB;
    TORCH_CHECK(s.numel() * s.element_size() == experts * s_stride * 2 &&
                    (kind == INT8 || z.numel() * z.element_size() == experts * s_stride * 2),
                name, ": packed scales do not match the weights");
  }
  return Stack{static_cast<const uint8_t*>(w.data_ptr()), kind >= INT8 ? static_cast<const uint16_t*>(s.data_ptr())
                                                                         : nullptr,
               kind == INT4 ? static_cast<const uint16_t*>(z.data_ptr()) : nullptr, per_expert, s_stride, kind, out,
               group};
}

// Expert e's product of `rows` rows: x [rows, K] -> y [rows, stack.out].
Args args_of(const Stack& st, int64_t e, int64_t K, const float* x, int64_t rows, float* y) {
  return Args{x, rows, K, st.out, (st.out + NB - 1) / NB, 256, st.group, st.kind, st.w + e * st.w_stride,
              st.scale ? st.scale + e * st.s_stride : nullptr, st.zero ? st.zero + e * st.s_stride : nullptr, y};
}

// One group of rows: an expert's (or the shared expert's) two products and their activation codes.
struct Group {
  Args up, down;
  Acts up_codes, down_codes;
  int64_t first, rows, inter;  // its first slot, rows, and the expert's intermediate size I
  float* hidden;               // silu(gate) * up, [rows, I]
};

float silu(float v) { return v / (1.f + std::exp(-v)); }

}  // namespace

torch::Tensor moe_forward(torch::Tensor input, torch::Tensor router, int64_t top_k, bool normalize,
                          const ExpertArgs& gate_up, const ExpertArgs& down, c10::optional<ExpertArgs> shared_gate_up,
                          c10::optional<ExpertArgs> shared_down, c10::optional<torch::Tensor> shared_gate,
                          int64_t passes, bool vector) {
  TORCH_CHECK(input.dim() == 2 && input.scalar_type() == torch::kFloat && input.is_contiguous(),
              "x must be contiguous fp32 [tokens, hidden]");
  TORCH_CHECK(router.dim() == 2 && router.scalar_type() == torch::kFloat && router.is_contiguous() &&
                  router.size(1) == input.size(1),
              "the router must be contiguous fp32 [experts, hidden]");
  TORCH_CHECK(passes == 1 || passes == 2, "activation passes must be 1 or 2, got ", passes);
  const int64_t T = input.size(0), H = input.size(1), E = router.size(0);
  TORCH_CHECK(top_k >= 1 && top_k <= E, "top_k must be in [1, ", E, "], got ", top_k);
  const Stack up = stack_of(gate_up, E, H, "gate_up");
  TORCH_CHECK(up.out % 2 == 0, "gate_up must have 2 I outputs");
  const int64_t I = up.out / 2;
  const Stack dn = stack_of(down, E, I, "down");
  TORCH_CHECK(dn.out == H, "down must have ", H, " outputs");
  TORCH_CHECK(dn.kind == up.kind && (up.kind < INT8 || dn.group == up.group),
              "gate_up and down must share their format and group size");
  const bool shared = shared_gate_up.has_value();
  TORCH_CHECK(shared == shared_down.has_value() && shared == shared_gate.has_value(),
              "the shared expert needs gate_up, down and its gate");
  Stack sup{}, sdn{};
  int64_t Is = 0;
  const float* gate_w = nullptr;
  if (shared) {
    sup = stack_of(*shared_gate_up, 1, H, "shared gate_up");
    Is = sup.out / 2;
    TORCH_CHECK(sup.out % 2 == 0, "the shared gate_up must have 2 I outputs");
    sdn = stack_of(*shared_down, 1, Is, "shared down");
    TORCH_CHECK(sdn.out == H, "the shared down must have ", H, " outputs");
    TORCH_CHECK(sup.kind == up.kind && sdn.kind == up.kind && (up.kind < INT8 || (sup.group == up.group &&
                                                                                  sdn.group == up.group)),
                "the shared expert must share the experts' format and group size");
    TORCH_CHECK(shared_gate->scalar_type() == torch::kFloat && shared_gate->is_contiguous() &&
                    shared_gate->numel() == H, "the shared expert's gate must be fp32 [", H, "]");
    gate_w = shared_gate->data_ptr<float>();
  }
  vector = vector && woq_has_avx2();
  auto out = torch::empty({T, H}, input.options());
  if (T == 0) return out;
  const float* x = input.data_ptr<float>();
  const float* rw = router.data_ptr<float>();
  float* y = out.data_ptr<float>();

  // Slots: the routed rows grouped by expert, then (with a shared expert) every token once more.
  const int64_t routed = T * top_k, slots = routed + (shared ? T : 0);
  const int64_t hidden_size = routed * I + (shared ? T * Is : 0);
  std::vector<float> logits(T * E), weight(routed), gates(shared ? T : 0), xs(slots * H);
  std::vector<float> up_out(2 * hidden_size), hidden(hidden_size), down_out(slots * H);
  std::vector<int64_t> token_of(slots), slot_of(routed), group_of(slots);  // slot_of: token t's j-th choice
  const bool ints = up.kind >= INT8;
  const int64_t gh = ints ? H / up.group : 0;
  std::vector<int8_t> codes_x(ints ? slots * passes * H : 0), codes_h(ints ? hidden_size * passes : 0);
  std::vector<float> steps_x(ints ? 2 * slots * gh : 0), steps_h(ints ? 2 * hidden_size / dn.group : 0);
  std::vector<Group> groups;
  groups.reserve(E + 1);
  std::vector<std::pair<int64_t, int64_t>> up_units, down_units;  // (group, block)
  const int64_t threads = at::in_parallel_region() ? 1 : std::min<int64_t>(at::get_num_threads(), 64);

#ifdef _OPENMP
#pragma omp parallel num_threads(threads) if (threads > 1)
#endif
  {
    // the portable path's fp32 / bf16 tile
    std::vector<float> tile(!vector && !ints ? 256 * NB : 0), res(ints ? std::max(up.group, dn.group) : 0);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (int64_t i = 0; i < T * E; ++i) logits[i] = woq_dot(x + (i / E) * H, rw + (i % E) * H, H, vector);
    if (shared) {
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
      for (int64_t t = 0; t < T; ++t) gates[t] = 1.f / (1.f + std::exp(-woq_dot(x + t * H, gate_w, H, vector)));
    }
#ifdef _OPENMP
#pragma omp single
#endif
    {
      // softmax, top-k (ties to the lower expert), the weights; then the slots by expert and token
      std::vector<int64_t> chosen(routed), count(E, 0), order(E);
      std::vector<float> p(E);
      for (int64_t t = 0; t < T; ++t) {
        const float* l = logits.data() + t * E;
        const float peak = *std::max_element(l, l + E);
        float total = 0.f;
        for (int64_t e = 0; e < E; ++e) total += p[e] = std::exp(l[e] - peak);
        for (int64_t e = 0; e < E; ++e) p[e] /= total;
        std::iota(order.begin(), order.end(), 0);
        std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                          [&](int64_t a, int64_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
        float sum = 0.f;
        for (int64_t j = 0; j < top_k; ++j) sum += p[order[j]];
        // each token's choices in ascending expert order: the order the combine adds them in
        std::sort(order.begin(), order.begin() + top_k);
        for (int64_t j = 0; j < top_k; ++j) {
          chosen[t * top_k + j] = order[j];
          weight[t * top_k + j] = normalize ? p[order[j]] / sum : p[order[j]];
          ++count[order[j]];
        }
      }
      std::vector<int64_t> next(E, 0);
      int64_t slot = 0, inter = 0;
      for (int64_t e = 0; e < E; ++e) {
        next[e] = slot;
        if (count[e] == 0) continue;
        float* h = hidden.data() + inter;
        Group g{args_of(up, e, H, xs.data() + slot * H, count[e], up_out.data() + 2 * inter),
                args_of(dn, e, I, h, count[e], down_out.data() + slot * H), {}, {}, slot, count[e], I, h};
        if (ints) {
          g.up_codes = Acts{codes_x.data() + slot * passes * H, steps_x.data() + slot * gh,
                            steps_x.data() + (slots + slot) * gh, passes};
          const int64_t gi = inter / dn.group, total_h = hidden_size / dn.group;
          g.down_codes = Acts{codes_h.data() + inter * passes, steps_h.data() + gi, steps_h.data() + total_h + gi,
                              passes};
        }
        groups.push_back(g);
        slot += count[e], inter += count[e] * I;
      }
      for (int64_t t = 0; t < T; ++t)
        for (int64_t j = 0; j < top_k; ++j) {
          const int64_t s = next[chosen[t * top_k + j]]++;
          token_of[s] = t, slot_of[t * top_k + j] = s;
        }
      if (shared) {
        float* h = hidden.data() + inter;
        Group g{args_of(sup, 0, H, xs.data() + slot * H, T, up_out.data() + 2 * inter),
                args_of(sdn, 0, Is, h, T, down_out.data() + slot * H), {}, {}, slot, T, Is, h};
        if (ints) {
          g.up_codes = Acts{codes_x.data() + slot * passes * H, steps_x.data() + slot * gh,
                            steps_x.data() + (slots + slot) * gh, passes};
          const int64_t gi = inter / dn.group, total_h = hidden_size / dn.group;
          g.down_codes = Acts{codes_h.data() + inter * passes, steps_h.data() + gi, steps_h.data() + total_h + gi,
                              passes};
        }
        groups.push_back(g);
        for (int64_t t = 0; t < T; ++t) token_of[slot + t] = t;
      }
      for (int64_t gi = 0; gi < static_cast<int64_t>(groups.size()); ++gi) {
        for (int64_t s = groups[gi].first; s < groups[gi].first + groups[gi].rows; ++s) group_of[s] = gi;
        for (int64_t b = 0; b < groups[gi].up.blocks; ++b) up_units.emplace_back(gi, b);
        for (int64_t b = 0; b < groups[gi].down.blocks; ++b) down_units.emplace_back(gi, b);
      }
    }
    // each slot's row of x, and its activation codes for gate|up
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (int64_t s = 0; s < slots; ++s) {
      std::memcpy(xs.data() + s * H, x + token_of[s] * H, H * sizeof(float));
      const Group& g = groups[group_of[s]];
      if (ints) quantise_row(g.up, g.up_codes, s - g.first, vector, res.data());
    }
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 4)
#endif
    for (int64_t u = 0; u < static_cast<int64_t>(up_units.size()); ++u) {
      const Group& g = groups[up_units[u].first];
      ints ? int_block(g.up, g.up_codes, up_units[u].second, vector)
           : float_block(g.up, up_units[u].second, tile.data(), vector);
    }
    // silu(gate) * up per slot (gate's I outputs, then up's), and its codes for down
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (int64_t s = 0; s < slots; ++s) {
      const Group& g = groups[group_of[s]];
      const int64_t r = s - g.first;
      const float* gu = g.up.y + r * 2 * g.inter;
      float* h = g.hidden + r * g.inter;
      for (int64_t i = 0; i < g.inter; ++i) h[i] = silu(gu[i]) * gu[g.inter + i];
      if (ints) quantise_row(g.down, g.down_codes, r, vector, res.data());
    }
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 4)
#endif
    for (int64_t u = 0; u < static_cast<int64_t>(down_units.size()); ++u) {
      const Group& g = groups[down_units[u].first];
      ints ? int_block(g.down, g.down_codes, down_units[u].second, vector)
           : float_block(g.down, down_units[u].second, tile.data(), vector);
    }
    // y_t = sum_j w_tj down_j (ascending expert) [+ gate_t shared_t]
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (int64_t t = 0; t < T; ++t) {
      float* yt = y + t * H;
      std::fill(yt, yt + H, 0.f);
      for (int64_t j = 0; j < top_k; ++j) {
        const float w = weight[t * top_k + j];
        const float* d = down_out.data() + slot_of[t * top_k + j] * H;
        for (int64_t k = 0; k < H; ++k) yt[k] += d[k] * w;
      }
      if (shared) {
        const float* d = down_out.data() + (routed + t) * H;
        for (int64_t k = 0; k < H; ++k) yt[k] += gates[t] * d[k];
      }
    }
  }
  return out;
}
