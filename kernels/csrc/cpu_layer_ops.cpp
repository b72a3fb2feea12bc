// The elementwise parts of a decoder layer on CPU, one call each where the torch reference makes 4 to 17
// (batchrun.kernels.cpu_layer_ops; built into one library with the attention op).
//
// batchrun_cpu::rms_norm(x [T, H], w [H], eps) -> [T, H]
// batchrun_cpu::add_rms_norm(x [T, H], residual(a!) [T, H], w [H], eps) -> [T, H]: residual += x, then its norm
// batchrun_cpu::rope_(q(a!) [T, Hq, D], k(b!) [T, Hkv, D], cos_sin [P, D] float32, positions [T] int64) -> ()
//     rotate-half RoPE in place; cos_sin row p holds cos (first D/2) and sin (last D/2) of position p
// batchrun_cpu::silu_mul(gate_up [T, 2I]) -> [T, I]: silu(gate) * up
//
// Each rounds to the activation dtype exactly where its torch reference does (after every torch op). Only
// the norm's float sum (another order) and our exp differ from torch, by a few float32 ulp: float32 results
// are within ~1e-6 relative, bfloat16 ones bit-identical unless such a difference meets a rounding boundary.
// float32 and bfloat16; rows may be strided, the last dimension is contiguous. No FMA contraction in this
// file: the reference rounds every product.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "vec.h"
#include "ops.h"

namespace {

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

enum Op { RMS, ADD_RMS, ROPE, SILU };

struct Args {
  Op op;
  bool bf16;
  const void* x;       // RMS, ADD_RMS: input rows; SILU: gate_up rows
  void* res;           // ADD_RMS: residual rows (updated)
  const void* w;       // RMS, ADD_RMS: weight [H]
  void* out;           // output rows
  int64_t width;       // H (norms), I (silu)
  int64_t xs, rs, os;  // row strides of x, res, out
  float eps;
  void* q;             // ROPE: q, k [T, heads, D]
  void* k;
  int64_t qs0, qs1, ks0, ks1, Hq, Hkv, D;
  const float* cs;     // ROPE: cos_sin [P, D]
  const int64_t* pos;  // ROPE: positions [T]
};

// x rounded to T and back: where the reference holds an intermediate in the activation dtype
template <int V>
BR_INLINE typename VT<V>::f vround(typename VT<V>::f x, float*) { return x; }
template <int V>
BR_INLINE typename VT<V>::f vround(typename VT<V>::f x, c10::BFloat16*) {
  typedef typename VT<V>::u U32;
  const U32 u = reinterpret_cast<const U32&>(x);
  U32 r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  r = (x != x) ? U32{} + 0x7fc00000u : r;
  return reinterpret_cast<const typename VT<V>::f&>(r);
}
BR_INLINE float sround(float x, float*) { return x; }
BR_INLINE float sround(float x, c10::BFloat16*) { return to_f(c10::BFloat16(x)); }
BR_INLINE void sstore(float* p, float x) { *p = x; }
BR_INLINE void sstore(c10::BFloat16* p, float x) { *p = c10::BFloat16(x); }

// y = R(w * R(x * rsqrt(mean(x^2) + eps))), R: round to T (HF's LlamaRMSNorm)
template <typename T, int V>
BR_INLINE void norm_row(const T* BR_RESTRICT x, const T* BR_RESTRICT w, T* BR_RESTRICT y, int64_t H, float eps) {
  typedef typename VT<V>::f F;
  T* tag = nullptr;
  F acc = vsplat<V>(0.0f);
  int64_t i = 0;
  for (; i + V <= H; i += V) {
    const F v = vload_t<V>(x + i);
    acc += v * v;
  }
  float ss = hsum<V>(acc);
  for (; i < H; ++i) ss += to_f(x[i]) * to_f(x[i]);
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
  for (i = 0; i + V <= H; i += V)
    vstore_t<V>(y + i, vload_t<V>(w + i) * vround<V>(vload_t<V>(x + i) * r, tag));
  for (; i < H; ++i) sstore(y + i, to_f(w[i]) * sround(to_f(x[i]) * r, tag));
}

template <typename T, int V>
BR_INLINE void add_row(const T* BR_RESTRICT x, T* BR_RESTRICT res, int64_t H) {
  int64_t i = 0;
  for (; i + V <= H; i += V) vstore_t<V>(res + i, vload_t<V>(res + i) + vload_t<V>(x + i));
  for (; i < H; ++i) sstore(res + i, to_f(res[i]) + to_f(x[i]));
}

// one head: (x1, x2) -> (R(R(x1 c) - R(x2 s)), R(R(x2 c) + R(x1 s))), c and s rounded to T first
template <typename T, int V>
BR_INLINE void rope_head(T* BR_RESTRICT x, const float* BR_RESTRICT cs, int64_t half) {
  typedef typename VT<V>::f F;
  T* tag = nullptr;
  int64_t i = 0;
  for (; i + V <= half; i += V) {
    const F c = vround<V>(vload<V>(cs + i), tag), s = vround<V>(vload<V>(cs + half + i), tag);
    const F x1 = vload_t<V>(x + i), x2 = vload_t<V>(x + half + i);
    const F o1 = vround<V>(x1 * c, tag) - vround<V>(x2 * s, tag);
    const F o2 = vround<V>(x2 * c, tag) + vround<V>(x1 * s, tag);
    vstore_t<V>(x + i, o1);
    vstore_t<V>(x + half + i, o2);
  }
  for (; i < half; ++i) {
    const float c = sround(cs[i], tag), s = sround(cs[half + i], tag);
    const float x1 = to_f(x[i]), x2 = to_f(x[half + i]);
    sstore(x + i, sround(x1 * c, tag) - sround(x2 * s, tag));
    sstore(x + half + i, sround(x2 * c, tag) + sround(x1 * s, tag));
  }
}

// out = R(R(g / (1 + exp(-g))) * u)
template <typename T, int V>
BR_INLINE void silu_row(const T* BR_RESTRICT g, const T* BR_RESTRICT u, T* BR_RESTRICT out, int64_t I) {
  typedef typename VT<V>::f F;
  T* tag = nullptr;
  const F one = vsplat<V>(1.0f);
  int64_t i = 0;
  // four vectors at a time: exp and the division are one long dependency chain per vector; four independent
  // ones overlap (1.55x on Zen 1 at 64 rows; a 4V-wide vector type instead was 2x slower: GCC splits it badly)
  for (; i + 4 * V <= I; i += 4 * V) {
    F gv[4], e[4];
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) gv[k] = vload_t<V>(g + i + k * V);
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) e[k] = vexp<V>(-gv[k]);
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k)
      vstore_t<V>(out + i + k * V, vround<V>(gv[k] / (one + e[k]), tag) * vload_t<V>(u + i + k * V));
  }
  for (; i + V <= I; i += V) {
    const F gv = vload_t<V>(g + i);
    vstore_t<V>(out + i, vround<V>(gv / (one + vexp<V>(-gv)), tag) * vload_t<V>(u + i));
  }
  for (; i < I; ++i) {
    const float gv = to_f(g[i]);
    sstore(out + i, sround(gv / (1.0f + std::exp(-gv)), tag) * to_f(u[i]));
  }
}

template <typename T, int V>
BR_INLINE void run_rows(const Args& a, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    switch (a.op) {
      case ADD_RMS: {
        T* res = static_cast<T*>(a.res) + r * a.rs;
        add_row<T, V>(static_cast<const T*>(a.x) + r * a.xs, res, a.width);
        norm_row<T, V>(res, static_cast<const T*>(a.w), static_cast<T*>(a.out) + r * a.os, a.width, a.eps);
        break;
      }
      case RMS:
        norm_row<T, V>(static_cast<const T*>(a.x) + r * a.xs, static_cast<const T*>(a.w),
                       static_cast<T*>(a.out) + r * a.os, a.width, a.eps);
        break;
      case ROPE: {
        const float* cs = a.cs + a.pos[r] * a.D;
        for (int64_t h = 0; h < a.Hq; ++h) rope_head<T, V>(static_cast<T*>(a.q) + r * a.qs0 + h * a.qs1, cs, a.D / 2);
        for (int64_t h = 0; h < a.Hkv; ++h) rope_head<T, V>(static_cast<T*>(a.k) + r * a.ks0 + h * a.ks1, cs, a.D / 2);
        break;
      }
      case SILU: {
        const T* g = static_cast<const T*>(a.x) + r * a.xs;
        silu_row<T, V>(g, g + a.width, static_cast<T*>(a.out) + r * a.os, a.width);
        break;
      }
    }
  }
}

void rows_base(const Args& a, int64_t r0, int64_t r1) {
  a.bf16 ? run_rows<c10::BFloat16, 4>(a, r0, r1) : run_rows<float, 4>(a, r0, r1);
}
#ifdef BR_X86_DISPATCH
__attribute__((target("avx2,fma,f16c"))) void rows_avx2(const Args& a, int64_t r0, int64_t r1) {
  a.bf16 ? run_rows<c10::BFloat16, 8>(a, r0, r1) : run_rows<float, 8>(a, r0, r1);
}
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,prefer-vector-width=512"))) void
rows_avx512(const Args& a, int64_t r0, int64_t r1) {
  a.bf16 ? run_rows<c10::BFloat16, 16>(a, r0, r1) : run_rows<float, 16>(a, r0, r1);
}
#endif

std::atomic<int64_t> max_isa{2};  // tests lower it to reach the AVX2 and baseline code on an AVX-512 machine

// rows in parallel when there is enough work (elements per row x rows) to pay for waking the threads
void run(const Args& a, int64_t rows, int64_t per_row) {
  if (rows == 0) return;
  const int64_t isa = std::min(best_isa(), max_isa.load());
  auto body = [&](int64_t r0, int64_t r1) {
#ifdef BR_X86_DISPATCH
    if (isa == 2) return rows_avx512(a, r0, r1);
    if (isa == 1) return rows_avx2(a, r0, r1);
#endif
    rows_base(a, r0, r1);
  };
  if (rows * per_row < (1 << 15)) body(0, rows);
  else torch::stable::parallel_for(0, rows, std::max<int64_t>(1, (1 << 13) / per_row), body);
}

void check_dtype(const Tensor& t, const char* op) {
  STD_TORCH_CHECK(t.is_cpu(), op, ": CPU tensors only");
  STD_TORCH_CHECK(t.scalar_type() == ScalarType::Float || t.scalar_type() == ScalarType::BFloat16, op,
                  ": float32 or bfloat16 only");
}

void check_rows(const Tensor& t, const Tensor& ref, const char* op) {
  check_dtype(t, op);
  STD_TORCH_CHECK(t.scalar_type() == ref.scalar_type(), op, ": dtypes differ");
  STD_TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, op, ": [rows, width] with contiguous rows expected");
}

Tensor norm(const Tensor& x, Tensor* res, const Tensor& w, double eps, Op op, const char* name) {
  check_rows(x, x, name);
  STD_TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous() &&
                      w.scalar_type() == x.scalar_type(), name, ": weight must be a contiguous [H] of x's dtype");
  Tensor out = torch::stable::new_empty(x, {x.size(0), x.size(1)});
  Args a{};
  a.op = op;
  a.bf16 = x.scalar_type() == ScalarType::BFloat16;
  a.x = x.data_ptr();
  a.xs = x.stride(0);
  if (res) {
    check_rows(*res, x, name);
    STD_TORCH_CHECK(res->size(0) == x.size(0) && res->size(1) == x.size(1), name, ": residual shape differs");
    a.res = res->data_ptr();
    a.rs = res->stride(0);
  }
  a.w = w.data_ptr();
  a.out = out.data_ptr();
  a.os = out.stride(0);
  a.width = x.size(1);
  a.eps = static_cast<float>(eps);
  run(a, x.size(0), x.size(1));
  return out;
}

Tensor rms_norm(Tensor x, Tensor w, double eps) { return norm(x, nullptr, w, eps, RMS, "rms_norm"); }

Tensor add_rms_norm(Tensor x, Tensor residual, Tensor w, double eps) {
  return norm(x, &residual, w, eps, ADD_RMS, "add_rms_norm");
}

void rope_(Tensor q, Tensor k, Tensor cos_sin, Tensor positions) {
  check_dtype(q, "rope_");
  STD_TORCH_CHECK(k.scalar_type() == q.scalar_type(), "rope_: q and k dtypes differ");
  STD_TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2) &&
                      q.stride(2) == 1 && k.stride(2) == 1 && q.size(2) % 2 == 0,
                  "rope_: q [T, Hq, D], k [T, Hkv, D] with the same T and an even, contiguous D expected");
  const int64_t T = q.size(0), D = q.size(2);
  STD_TORCH_CHECK(cos_sin.is_cpu() && cos_sin.scalar_type() == ScalarType::Float && cos_sin.dim() == 2 &&
                      cos_sin.size(1) == D && cos_sin.is_contiguous(),
                  "rope_: cos_sin must be a contiguous float32 [positions, D]");
  STD_TORCH_CHECK(positions.is_cpu() && positions.scalar_type() == ScalarType::Long && positions.dim() == 1 &&
                      positions.size(0) == T && positions.is_contiguous(),
                  "rope_: positions must be a contiguous int64 [T]");
  const int64_t* pos = static_cast<const int64_t*>(positions.data_ptr());
  for (int64_t t = 0; t < T; ++t)
    STD_TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_sin.size(0), "rope_: positions[", t, "] = ", pos[t],
                    " is outside the RoPE table (", cos_sin.size(0), " positions)");
  Args a{};
  a.op = ROPE;
  a.bf16 = q.scalar_type() == ScalarType::BFloat16;
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.qs0 = q.stride(0);
  a.qs1 = q.stride(1);
  a.ks0 = k.stride(0);
  a.ks1 = k.stride(1);
  a.Hq = q.size(1);
  a.Hkv = k.size(1);
  a.D = D;
  a.cs = static_cast<const float*>(cos_sin.data_ptr());
  a.pos = pos;
  run(a, T, (a.Hq + a.Hkv) * D);
}

Tensor silu_mul(Tensor gate_up) {
  check_rows(gate_up, gate_up, "silu_mul");
  STD_TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: gate_up's width must be even ([gate; up])");
  const int64_t I = gate_up.size(1) / 2;
  Tensor out = torch::stable::new_empty(gate_up, {gate_up.size(0), I});
  Args a{};
  a.op = SILU;
  a.bf16 = gate_up.scalar_type() == ScalarType::BFloat16;
  a.x = gate_up.data_ptr();
  a.xs = gate_up.stride(0);
  a.out = out.data_ptr();
  a.os = out.stride(0);
  a.width = I;
  run(a, gate_up.size(0), 2 * I);
  return out;
}

// the highest ISA these ops may use (0 baseline, 1 AVX2, 2 AVX-512; capped by the machine's); returns the old cap
int64_t set_layer_ops_isa(int64_t isa) { return max_isa.exchange(isa); }

}  // namespace

namespace brcpu {  // for ops composed of these (ops.h)
Tensor rms_norm(Tensor x, Tensor w, double eps) { return ::rms_norm(x, w, eps); }
Tensor add_rms_norm(Tensor x, Tensor residual, Tensor w, double eps) { return ::add_rms_norm(x, residual, w, eps); }
void rope_(Tensor q, Tensor k, Tensor cos_sin, Tensor positions) { ::rope_(q, k, cos_sin, positions); }
Tensor silu_mul(Tensor gate_up) { return ::silu_mul(gate_up); }
}  // namespace brcpu

STABLE_TORCH_LIBRARY_FRAGMENT(batchrun_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor w, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) q, Tensor(b!) k, Tensor cos_sin, Tensor positions) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("set_layer_ops_isa(int isa) -> int");
}

STABLE_TORCH_LIBRARY_IMPL(batchrun_cpu, CPU, m) {
  m.impl("rms_norm", TORCH_BOX(&rms_norm));
  m.impl("add_rms_norm", TORCH_BOX(&add_rms_norm));
  m.impl("rope_", TORCH_BOX(&rope_));
  m.impl("silu_mul", TORCH_BOX(&silu_mul));
}

STABLE_TORCH_LIBRARY_IMPL(batchrun_cpu, CompositeExplicitAutograd, m) {
  m.impl("set_layer_ops_isa", TORCH_BOX(&set_layer_ops_isa));
}
