// The library's ops as C++ functions, for ops that compose others in one call (cpu_decoder_layer.cpp): each
// is the registered op of the same name (checks included), defined in its own file.
#pragma once

#include <torch/csrc/stable/tensor.h>

#include <cstdint>

namespace brcpu {

using torch::stable::Tensor;

Tensor rms_norm(Tensor x, Tensor w, double eps);                                     // cpu_layer_ops.cpp
Tensor add_rms_norm(Tensor x, Tensor residual, Tensor w, double eps);
void rope_(Tensor q, Tensor k, Tensor cos_sin, Tensor positions);
Tensor silu_mul(Tensor gate_up);
Tensor bf16_linear(Tensor x, Tensor wp, int64_t n);                                  // cpu_gemm.cpp
// x quantized per row (times inv_smooth where it is not empty), then the int8 product: cpu_w8a8.linear
Tensor w8a8_linear(Tensor x, Tensor inv_smooth, Tensor wp, Tensor offset, Tensor scales, int64_t n,
                   bool rotate);  // cpu_w8a8.cpp
Tensor paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_start_loc, Tensor seq_lens,
                       Tensor block_tables, double scale, int64_t sliding_window, int64_t isa, double k_scale,
                       double v_scale, int64_t sdpa_from);                            // cpu_attention.cpp
// a fresh prompt chunk (queries = its whole context, rows row0 .. row0 + ctx of q) by torch's SDPA into out
void sdpa_fresh(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, int64_t row0, int64_t ctx,
                const int32_t* blocks, double scale, Tensor& out);                  // cpu_attention_sdpa.cpp
void store_kv(Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, Tensor slot_mapping, double k_scale,
              double v_scale);

}  // namespace brcpu
