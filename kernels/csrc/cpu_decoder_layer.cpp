// A whole decoder layer of a Llama-family model (no q/k/v bias, no q/k norms) in bfloat16 on CPU, in one call
// (batchrun.kernels.cpu_decoder_layer): the library's ops in the order and with the arguments of
// models/cpu_fused.py's pre_attention -> store_kv + paged_attention -> post_attention, so its results are
// bit-identical to that path. What it saves is the ~15 Python-level calls per layer between them, the largest
// cost of a small model's decode step at batch 1 after the weights' bytes.
//
// batchrun_cpu::decoder_layer(h(a!) [T, H], ln1_w [H], qkv_wp, o_wp, ln2_w [H], gate_up_wp, down_wp,
//     kv_caches(b!) [L, 2, N, bs, Hkv, D], layer, cos_sin [P, D] float32, positions [T] int64,
//     slot_mapping [T] int64, query_start_loc [B+1], seq_lens [B], block_tables [B, W] int32,
//     num_heads, eps, scale, sliding_window, k_scale, v_scale, sdpa_from, w8a8, w8a8_rotate) -> ()
//
// Each projection weight is cpu_gemm.pack()ed ([n/16, K/2, 16, 2] or [n/64, K/2, 4, 16, 2]), oneDNN-packed, or a
// plain [n, K] tensor: the form models/kernel_choice.py measured fastest for this step's rows; or, with
// quantization w8a8, int8 cpu_w8a8.pack()ed ([n/16, K/4, 16, 4], n a multiple of 16), whose offset, scales and
// inv_smooth (empty: none) come in w8a8, three per projection in the order qkv, o, gate_up, down; with w8a8_rotate
// the inputs of those whose K 64 divides are rotated per block of 64 (models/w8a8.py rotates). h is the residual stream
// and becomes the layer's output in place; layer `layer`'s K/V of this step go into kv_caches.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace {

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

// a tensor over memory the caller keeps alive (a view without a dispatcher call)
Tensor over(void* data, const Tensor& like, ScalarType dtype, torch::headeronly::IntHeaderOnlyArrayRef sizes,
            torch::headeronly::IntHeaderOnlyArrayRef strides) {
  return torch::stable::from_blob(data, sizes, strides, like.device(), dtype);
}

// h += y over contiguous bfloat16 rows: each sum in float, rounded once, as torch's bfloat16 add
void add_(const Tensor& h, const Tensor& y) {
  const int64_t n = h.numel();
  auto* hp = static_cast<c10::BFloat16*>(h.data_ptr());
  const auto* yp = static_cast<const c10::BFloat16*>(y.data_ptr());
  auto body = [&](int64_t i0, int64_t i1) {
    int64_t i = i0;
    for (; i + 16 <= i1; i += 16) vstore_bf16<16>(hp + i, vload_bf16<16>(hp + i) + vload_bf16<16>(yp + i));
    for (; i < i1; ++i) hp[i] = c10::BFloat16(to_f(hp[i]) + to_f(yp[i]));
  };
  if (n < (1 << 16)) body(0, n);
  else torch::stable::parallel_for(0, n, 1 << 14, body);
}

// Ask for the K/V lines this step's attention will read (each sequence's keys in the window) while the qkv
// projection streams its weights, when they are few enough to wait in L2 (a decode step at a small batch):
// the previous layers' weights have pushed them out, and the attention would otherwise meet DRAM latency
// in its serial part (at batch 1: 15 -> 11 us of a ~180 us layer, Zen 4). Blocks of contiguous rows only.
// A hint: entries the attention would refuse are skipped here and refused there.
constexpr int64_t kPrefetchKvBytes = 256 << 10;
void prefetch_kv(const char* k, const char* v, int64_t block_bytes, int64_t bs, int64_t N, const Tensor& seq_lens,
                 const Tensor& block_tables, int64_t window) {
  if (!seq_lens.is_contiguous() || seq_lens.dim() != 1) return;
  const int64_t B = std::min(seq_lens.size(0), block_tables.size(0)), W = block_tables.size(1);
  const int64_t bts0 = block_tables.stride(0), bts1 = block_tables.stride(1);
  const auto* lens = static_cast<const int32_t*>(seq_lens.data_ptr());
  const auto* bt = static_cast<const int32_t*>(block_tables.data_ptr());
  auto first_block = [&](int64_t b) { return window > 0 ? std::max<int64_t>(0, lens[b] - window) / bs : 0; };
  auto end_block = [&](int64_t b) { return std::min<int64_t>(W, (lens[b] + bs - 1) / bs); };
  int64_t nblocks = 0;   // a large batch stops counting as soon as it is over the budget
  for (int64_t b = 0; b < B; ++b) {
    nblocks += std::max<int64_t>(0, end_block(b) - first_block(b));
    if (2 * nblocks * block_bytes > kPrefetchKvBytes) return;
  }
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = first_block(b); j < end_block(b); ++j) {
      const int64_t blk = bt[b * bts0 + j * bts1];
      if (blk < 0 || blk >= N) continue;
      const int64_t off = blk * block_bytes;
      for (int64_t c = 0; c < block_bytes; c += 64) {
        __builtin_prefetch(k + off + c, 0, 2);
        __builtin_prefetch(v + off + c, 0, 2);
      }
    }
}

// A projection's output rows: cpu_gemm.packed_rows for the own layouts (and cpu_w8a8's, whole blocks of 16),
// size(0) for [n, K] weights
int64_t packed_n(const Tensor& wp) { return wp.dim() >= 4 ? wp.size(0) * (wp.dim() == 5 ? 64 : 16) : wp.size(0); }

// x [T, K] @ w.T by whichever implementation the weight's form says the engine chose for this step's rows
// (models/kernel_choice.py): the own kernel's packed layouts, oneDNN's packed layout (mkldnn
// _linear_pointwise: AMX where the CPU has it), or a plain [n, K] weight through torch's F.linear.
// An int8 weight is W8A8's: its offset, scales and inv_smooth are w8a8[3 i .. 3 i + 2] for projection i.
Tensor project(const Tensor& x, const Tensor& w, int64_t n, const std::vector<Tensor>& w8a8, int i, bool rotate) {
  if (w.scalar_type() == ScalarType::Char) {
    STD_TORCH_CHECK(w8a8.size() == 12, "decoder_layer: an int8 projection needs w8a8's 12 tensors, got ",
                    w8a8.size());
    return brcpu::w8a8_linear(x, w8a8[3 * i + 2], w, w8a8[3 * i], w8a8[3 * i + 1], n, rotate && x.size(1) % 64 == 0);
  }
  if (w.dim() >= 4) return brcpu::bf16_linear(x, w, n);
  if (w.layout() == torch::headeronly::Layout::Mkldnn) {
    std::array<StableIValue, 6> stack{
        torch::stable::detail::from(x), torch::stable::detail::from(w),
        torch::stable::detail::from(std::nullopt), torch::stable::detail::from(std::string("none")),
        torch::stable::detail::from(std::vector<int64_t>{}),
        torch::stable::detail::from(std::optional<std::string>(std::string("")))};
    STABLE_TORCH_ERROR_CODE_CHECK(
        torch_call_dispatcher("mkldnn::_linear_pointwise", "", stack.data(), TORCH_ABI_VERSION));
    return torch::stable::detail::to<Tensor>(stack[0]);
  }
  std::array<StableIValue, 3> stack{torch::stable::detail::from(x), torch::stable::detail::from(w),
                                    torch::stable::detail::from(std::nullopt)};
  STABLE_TORCH_ERROR_CODE_CHECK(torch_call_dispatcher("aten::linear", "", stack.data(), TORCH_ABI_VERSION));
  return torch::stable::detail::to<Tensor>(stack[0]);
}

void decoder_layer(Tensor h, Tensor ln1_w, Tensor qkv_wp, Tensor o_wp, Tensor ln2_w, Tensor gate_up_wp,
                   Tensor down_wp, Tensor kv_caches, int64_t layer, Tensor cos_sin, Tensor positions,
                   Tensor slot_mapping, Tensor query_start_loc, Tensor seq_lens, Tensor block_tables,
                   int64_t num_heads, double eps, double scale, int64_t sliding_window, double k_scale,
                   double v_scale, int64_t sdpa_from, std::vector<Tensor> w8a8, bool w8a8_rotate) {
  STD_TORCH_CHECK(h.is_cpu() && h.scalar_type() == ScalarType::BFloat16 && h.dim() == 2 && h.is_contiguous(),
                  "decoder_layer: h must be a contiguous bfloat16 [T, H] CPU tensor");
  STD_TORCH_CHECK(kv_caches.is_cpu() && kv_caches.dim() == 6 && kv_caches.size(1) == 2 && kv_caches.stride(5) == 1,
                  "decoder_layer: kv_caches must be [L, 2, N, bs, Hkv, D] with a contiguous head dimension");
  STD_TORCH_CHECK(layer >= 0 && layer < kv_caches.size(0), "decoder_layer: layer ", layer, " is not one of ",
                  kv_caches.size(0));
  // an int8 cache's rows hold D codes and 2 bytes per 32 of them (kernels/kv_quant.py): D + 2 * ceil(D / 32)
  const bool i8 = kv_caches.scalar_type() == ScalarType::Char;
  const int64_t T = h.size(0), H = h.size(1), Hkv = kv_caches.size(4), RW = kv_caches.size(5);
  const int64_t D = i8 ? i8_head_dim(RW) : RW;
  const int64_t q_size = num_heads * D, kv_size = Hkv * D, W = q_size + 2 * kv_size;
  STD_TORCH_CHECK(packed_n(qkv_wp) == W && packed_n(o_wp) == H && packed_n(down_wp) == H,
                  "decoder_layer: the packed weights do not match ", num_heads, " heads, ", Hkv,
                  " KV heads of ", D, " and hidden ", H);

  // this layer's caches: views of kv_caches[layer, 0] and [layer, 1]
  const ScalarType kvt = kv_caches.scalar_type();
  const int64_t esz = kv_caches.element_size();
  char* kv = static_cast<char*>(kv_caches.data_ptr()) + layer * kv_caches.stride(0) * esz;
  const int64_t N = kv_caches.size(2), bs = kv_caches.size(3);
  const int64_t cs2 = kv_caches.stride(2), cs3 = kv_caches.stride(3), cs4 = kv_caches.stride(4);
  Tensor k_cache = over(kv, kv_caches, kvt, {N, bs, Hkv, RW}, {cs2, cs3, cs4, 1});
  Tensor v_cache = over(kv + kv_caches.stride(1) * esz, kv_caches, kvt, {N, bs, Hkv, RW}, {cs2, cs3, cs4, 1});

  if (seq_lens.scalar_type() == ScalarType::Int && block_tables.scalar_type() == ScalarType::Int &&
      block_tables.dim() == 2 && cs3 == Hkv * RW && cs4 == RW)
    prefetch_kv(kv, kv + kv_caches.stride(1) * esz, cs2 * esz, bs, N, seq_lens, block_tables, sliding_window);

  // input norm -> qkv projection -> RoPE of q and k in place -> K/V stored -> paged attention
  Tensor qkv = project(brcpu::rms_norm(h, ln1_w, eps), qkv_wp, W, w8a8, 0, w8a8_rotate);          // [T, W]
  auto* p = static_cast<c10::BFloat16*>(qkv.data_ptr());
  Tensor q = over(p, h, ScalarType::BFloat16, {T, num_heads, D}, {W, D, 1});
  Tensor k = over(p + q_size, h, ScalarType::BFloat16, {T, Hkv, D}, {W, D, 1});
  Tensor v = over(p + q_size + kv_size, h, ScalarType::BFloat16, {T, Hkv, D}, {W, D, 1});
  brcpu::rope_(q, k, cos_sin, positions);
  brcpu::store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale);
  Tensor o = brcpu::paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
                                    sliding_window, -1, k_scale, v_scale,
                                    sdpa_from);                  // [T, Hq, D]

  // o_proj added into h, its norm -> gate/up -> SwiGLU -> down, added into h
  Tensor o2 = over(o.data_ptr(), h, ScalarType::BFloat16, {T, q_size}, {q_size, 1});
  Tensor x = brcpu::add_rms_norm(project(o2, o_wp, H, w8a8, 1, w8a8_rotate), h, ln2_w, eps);
  Tensor act = brcpu::silu_mul(project(x, gate_up_wp, packed_n(gate_up_wp), w8a8, 2, w8a8_rotate));
  add_(h, project(act, down_wp, H, w8a8, 3, w8a8_rotate));
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(batchrun_cpu, m) {
  m.def("decoder_layer(Tensor(a!) h, Tensor ln1_w, Tensor qkv_wp, Tensor o_wp, Tensor ln2_w, Tensor gate_up_wp, "
        "Tensor down_wp, Tensor(b!) kv_caches, int layer, Tensor cos_sin, Tensor positions, Tensor slot_mapping, "
        "Tensor query_start_loc, Tensor seq_lens, Tensor block_tables, int num_heads, float eps, float scale, "
        "int sliding_window, float k_scale, float v_scale, int sdpa_from, Tensor[] w8a8, bool w8a8_rotate) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(batchrun_cpu, CPU, m) { m.impl("decoder_layer", TORCH_BOX(&decoder_layer)); }
// a oneDNN-packed weight among the arguments makes the dispatcher pick this key
STABLE_TORCH_LIBRARY_IMPL(batchrun_cpu, MkldnnCPU, m) { m.impl("decoder_layer", TORCH_BOX(&decoder_layer)); }
