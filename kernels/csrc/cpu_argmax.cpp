// Greedy sampling's argmax over a step's logits on CPU (batchrun.kernels.cpu_argmax; built into one library
// with the attention op).
//
// batchrun_cpu::argmax_rows(logits [T, V], isa=-1) -> [T] int64: torch.max(logits, dim=-1).indices: the first
// maximal index of each row; a row holding NaN gives its first NaN (torch's max treats NaN as the largest
// value). isa caps the code path (0 baseline, 1 AVX2; -1: the machine's best), for tests.
//
// torch's CPU max over the last dim of bfloat16 logits runs one scalar pass on one thread (~1.3 ms for 64 rows
// of 32,000 on Zen 1): this is one vector pass over each row, rows spread over the threads.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "vec.h"

namespace {

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

// One pass: each lane of NA accumulator sets keeps its largest value and where it first saw it (a strictly
// greater value moves it), so the row's first maximum is the smallest index among the lanes holding the max.
// NA independent sets: the compare-and-blend chain of one set would leave the vector units idle.
template <typename T, int V>
BR_INLINE int64_t argmax_row(const T* BR_RESTRICT x, int64_t n) {
  typedef typename VT<V>::f F;
  typedef typename VT<V>::i I;
  constexpr int NA = 4;
  F mx[NA];
  I at[NA];
  I lane;
  for (int j = 0; j < V; ++j) lane[j] = j;
  F nan{};
  for (int a = 0; a < NA; ++a) {
    mx[a] = vsplat<V>(-std::numeric_limits<float>::infinity());
    at[a] = I{} + static_cast<int32_t>(n);  // past the end: no lane has seen a value yet
  }
  int64_t i = 0;
  for (; i + NA * V <= n; i += NA * V) {
#pragma GCC unroll 4
    for (int a = 0; a < NA; ++a) {
      const F v = vload_t<V>(x + i + a * V);
      const auto gt = v > mx[a];
      mx[a] = gt ? v : mx[a];
      at[a] = gt ? lane + static_cast<int32_t>(i + a * V) : at[a];
      nan = v != v ? vsplat<V>(1.0f) : nan;
    }
  }
  float m = -std::numeric_limits<float>::infinity(), any_nan = 0.0f;
  int64_t best = n;
  for (int a = 0; a < NA; ++a)
    for (int j = 0; j < V; ++j) {
      any_nan += nan[j];
      if (mx[a][j] > m || (mx[a][j] == m && at[a][j] < best)) {
        m = mx[a][j];
        best = at[a][j];
      }
    }
  if (best == n && i > 0) best = 0;  // the vector part was all -inf (or NaN, found below)
  for (; i < n; ++i) {
    const float v = to_f(x[i]);
    any_nan += v != v;
    if (v > m || (best == n && v == m)) {
      m = v;
      best = i;
    }
  }
  if (any_nan != 0.0f)
    for (int64_t k = 0; k < n; ++k)
      if (to_f(x[k]) != to_f(x[k])) return k;
  return best < n ? best : 0;  // best == n: the whole row -inf
}

template <typename T, int V>
BR_INLINE void rows(const T* x, int64_t s0, int64_t n, int64_t* out, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) out[r] = argmax_row<T, V>(x + r * s0, n);
}

template <typename T>
void rows_base(const T* x, int64_t s0, int64_t n, int64_t* out, int64_t r0, int64_t r1) {
  rows<T, 4>(x, s0, n, out, r0, r1);
}
#ifdef BR_X86_DISPATCH
template <typename T>
__attribute__((target("avx2,fma,f16c"))) void rows_avx2(const T* x, int64_t s0, int64_t n, int64_t* out,
                                                         int64_t r0, int64_t r1) {
  rows<T, 8>(x, s0, n, out, r0, r1);
}
#endif

template <typename T>
void run(const Tensor& x, int64_t* out, int64_t isa) {
  const T* p = static_cast<const T*>(x.data_ptr());
  const int64_t T_ = x.size(0), n = x.size(1), s0 = x.stride(0);
  auto body = [&](int64_t r0, int64_t r1) {
#ifdef BR_X86_DISPATCH
    if (isa >= 1) return rows_avx2<T>(p, s0, n, out, r0, r1);
#endif
    rows_base<T>(p, s0, n, out, r0, r1);
  };
  if (T_ * n < (1 << 17)) body(0, T_);  // a few rows: waking the threads costs more than it saves
  else torch::stable::parallel_for(0, T_, 1, body);
}

Tensor argmax_rows(Tensor x, int64_t isa) {
  STD_TORCH_CHECK(x.is_cpu() && x.dim() == 2 && x.size(1) > 0 && x.stride(1) == 1,
                  "argmax_rows: logits must be a CPU [T, V] tensor, V > 0, rows contiguous");
  const ScalarType st = x.scalar_type();
  STD_TORCH_CHECK(st == ScalarType::Float || st == ScalarType::BFloat16, "argmax_rows: float32 or bfloat16 only");
  Tensor out = torch::stable::new_empty(x, {x.size(0)}, ScalarType::Long);
  int64_t* o = static_cast<int64_t*>(out.data_ptr());
  const int64_t use = isa < 0 ? best_isa() : std::min(isa, best_isa());
  if (st == ScalarType::Float) run<float>(x, o, use);
  else run<c10::BFloat16>(x, o, use);
  return out;
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(batchrun_cpu, m) { m.def("argmax_rows(Tensor logits, int isa=-1) -> Tensor"); }

STABLE_TORCH_LIBRARY_IMPL(batchrun_cpu, CPU, m) { m.impl("argmax_rows", TORCH_BOX(&argmax_rows)); }
