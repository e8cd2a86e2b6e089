// What woq.cpp (the weight-streaming linear kernels) and layer.cpp (a decoder layer built on them) share.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <tuple>
#include <vector>

// y = x W^T (+ (x A^T) B', B' as tiles of 16 columns and their index), x [..., K] any float dtype ->
// [..., out_features] in x's dtype (woq.cpp); `passes`: int8 / int4 round x to int8 once or twice (its residual);
// a gated correction (query positions only) adds only to rows r with r % corr_period >= corr_from.
torch::Tensor woq_linear(torch::Tensor input, torch::Tensor w, torch::Tensor scale, torch::Tensor zero, int64_t kind,
                         int64_t out_features, int64_t group, int64_t chunk, bool vector,
                         c10::optional<torch::Tensor> corr_a, c10::optional<torch::Tensor> corr_tiles,
                         c10::optional<torch::Tensor> corr_index, int64_t passes, int64_t corr_period = 1,
                         int64_t corr_from = 0);

bool woq_has_avx2();

// The kernels' inner pieces, for another kernel built on them (moe.cpp: many layers' blocks in one thread team).
namespace woq_kernel {

enum Kind : int64_t { F32 = 0, BF16 = 1, INT8 = 2, INT4 = 3 };
constexpr int NB = 16;  // output columns per block

// One product y[rows, O] = x[rows, K] W^T over packed weights (woq.cpp's header has the layouts).
struct Args {
  const float* x;
  int64_t rows, K, O, blocks, kc_max, group;
  int64_t kind;
  const void* w;
  const uint16_t* hscale;  // [O / 16, K / group, 16] fp16 bits (int8, int4)
  const uint16_t* hzero;
  float* y;
};

// Each row of x quantised to int8 per group of K in `passes` passes (1, or 2: the residual of the first), as
// rows of codes r * passes + p: q [R * P, K]; per row of x and group its step s [R, K / group] (sx, or s2 for two
// passes) and s * sum(Q) [R, K / group] (int4's minimum term; Q = qx, or 254 q1 + q2).
struct Acts {
  int8_t* q;
  float* s;
  float* sum;
  int64_t passes;
  // int8 weights, two passes, AVX2 without VNNI: each row's two digits joined into one 16-bit code, Q = 254 q1 + q2
  // [R, K] (woq.cpp's int_tile_wide_avx2), or none
  int16_t* wide = nullptr;
};

// Row r of a.x into its rows of codes (`res`: a group's scratch for the second pass).
void quantise_row(const Args& a, const Acts& x, int64_t r, bool vector, float* res);
// Every row over block b of 16 output columns: int8 / int4 from the codes, fp32 / bf16 from a.x (`tile`: the
// portable path's [kc_max, 16] scratch, unused where `vector`).
void int_block(const Args& a, const Acts& x, int64_t b, bool vector);
void float_block(const Args& a, int64_t b, float* tile, bool vector);

}  // namespace woq_kernel

// sum_k x[k] w[k] over n floats; `vector`: the AVX2 path (the caller checked woq_has_avx2()).
float woq_dot(const float* x, const float* w, int64_t n, bool vector);

// One packed linear layer, as Python passes it: (qweight, scale, zero, kind, out_features, group, A, B' tiles,
// their index, activation passes) (clover.model.quant.PackedLinear.kernel_args).
using PackedArgs = std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t, int64_t,
                              c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                              c10::optional<torch::Tensor>, int64_t>;

// One decoder layer's weights as Python passes them: its two RMSNorm weights, their epsilon and the four projections
// (qkv, o, gate_up, down) (clover.model.fused.layer_weights).
using LayerWeights = std::tuple<torch::Tensor, torch::Tensor, double, PackedArgs, PackedArgs, PackedArgs, PackedArgs>;

torch::Tensor decoder_layers(torch::Tensor h, const std::vector<LayerWeights>& layers, torch::Tensor cos,
                             torch::Tensor signed_sin, const std::vector<torch::Tensor>& k_caches,
                             const std::vector<torch::Tensor>& v_caches, int64_t past,
                             c10::optional<torch::Tensor> mask, bool is_causal, int64_t heads, int64_t kv_heads,
                             int64_t head_dim, int64_t chunk, bool vector, int64_t gated_from);

// A projection of every expert, stacked: (qweight [E, ...], scale [E, ...], zero [E, ...], kind, out_features,
// group) (clover.model.quant.PackedExperts).
using ExpertArgs = std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t, int64_t>;

// A sparse MoE layer in one call (moe.cpp): router softmax top-k, the chosen experts grouped, the shared expert.
torch::Tensor moe_forward(torch::Tensor x, torch::Tensor router, int64_t top_k, bool normalize,
                          const ExpertArgs& gate_up, const ExpertArgs& down, c10::optional<ExpertArgs> shared_gate_up,
                          c10::optional<ExpertArgs> shared_down, c10::optional<torch::Tensor> shared_gate,
                          int64_t passes, bool vector);

// One Gated DeltaNet decoding step after the input projections (deltanet.cpp).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor>
deltanet_step(torch::Tensor mixed, torch::Tensor z, torch::Tensor a, torch::Tensor b, torch::Tensor history,
              torch::Tensor conv_w, c10::optional<torch::Tensor> right_w, torch::Tensor a_log, torch::Tensor dt_bias,
              torch::Tensor norm_w, double norm_eps, torch::Tensor state, int64_t k_heads, int64_t dk, int64_t dv,
              bool keep_states);
