// paged_attention's second implementation for a fresh prompt chunk (its queries are its whole context: no
// cached prefix, no sliding window, K/V in q's dtype): the sequence's K/V blocks copied into one contiguous
// [ctx, Hkv, D] buffer, then torch's own scaled_dot_product_attention (causal, GQA), whose CPU flash kernel
// runs on oneDNN brgemm (AMX tiles where the CPU has them). models/attention_choice.py times it against the
// own kernel on the model's head shapes and sets the query length from which paged_attention hands such
// sequences here (its sdpa_from argument). The copy is O(ctx) against attention's O(ctx^2).
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <optional>

#include "ops.h"

namespace brcpu {

using torch::headeronly::ScalarType;

void sdpa_fresh(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, int64_t row0, int64_t ctx,
                const int32_t* blocks, double scale, Tensor& out) {
  const int64_t Hq = q.size(1), D = q.size(2), bs = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t esz = q.element_size(), row = Hkv * D * esz;
  // K and V of the sequence, token-major: [2, ctx, Hkv, D]
  Tensor kv = torch::stable::new_empty(q, {2, ctx, Hkv, D});
  char* dst = static_cast<char*>(kv.data_ptr());
  const Tensor* caches[2] = {&k_cache, &v_cache};
  for (int c = 0; c < 2; ++c) {
    const Tensor& cache = *caches[c];
    const char* base = static_cast<const char*>(cache.data_ptr());
    const int64_t s0 = cache.stride(0) * esz, s1 = cache.stride(1) * esz, s2 = cache.stride(2) * esz;
    for (int64_t j = 0; j < ctx; ++j) {
      const char* src = base + blocks[j / bs] * s0 + (j % bs) * s1;
      char* d = dst + (c * ctx + j) * row;
      if (s2 == D * esz) std::memcpy(d, src, row);
      else
        for (int64_t h = 0; h < Hkv; ++h) std::memcpy(d + h * D * esz, src + h * s2, D * esz);
    }
  }
  const ScalarType st = q.scalar_type();
  char* qp = static_cast<char*>(q.data_ptr()) + row0 * q.stride(0) * esz;
  // [1, H, ctx, D] views: q's rows, and the two halves of kv
  const auto dev = q.device();
  Tensor qv = torch::stable::from_blob(qp, {1, Hq, ctx, D}, {ctx * q.stride(0), q.stride(1), q.stride(0), 1}, dev, st);
  Tensor kt = torch::stable::from_blob(dst, {1, Hkv, ctx, D}, {ctx * Hkv * D, D, Hkv * D, 1}, dev, st);
  Tensor vt = torch::stable::from_blob(dst + ctx * row, {1, Hkv, ctx, D}, {ctx * Hkv * D, D, Hkv * D, 1}, dev, st);
  std::array<StableIValue, 8> stack{
      torch::stable::detail::from(qv), torch::stable::detail::from(kt), torch::stable::detail::from(vt),
      torch::stable::detail::from(std::nullopt), torch::stable::detail::from(0.0),
      torch::stable::detail::from(true), torch::stable::detail::from(std::optional<double>(scale)),
      torch::stable::detail::from(true)};
  STABLE_TORCH_ERROR_CODE_CHECK(
      torch_call_dispatcher("aten::scaled_dot_product_attention", "", stack.data(), TORCH_ABI_VERSION));
  Tensor o = torch::stable::detail::to<Tensor>(stack[0]);                    // [1, Hq, ctx, D]
  const char* op = static_cast<const char*>(o.data_ptr());
  char* outp = static_cast<char*>(out.data_ptr());
  const int64_t os1 = o.stride(1) * esz, os2 = o.stride(2) * esz;
  for (int64_t t = 0; t < ctx; ++t)
    for (int64_t h = 0; h < Hq; ++h)
      std::memcpy(outp + ((row0 + t) * out.stride(0) + h * out.stride(1)) * esz, op + h * os1 + t * os2, D * esz);
}

}  // namespace brcpu
