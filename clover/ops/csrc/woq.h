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
