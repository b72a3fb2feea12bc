// bfloat16 projections on x86-64 CPUs (AVX-512 BF16, or AVX2 + FMA) from a weight packed once at load
// (batchrun.kernels.cpu_gemm).
//
// batchrun_cpu::bf16_linear(x [M, K] bf16, wp, n) -> [M, n] bf16 = x @ w.T
//
// wp holds w [n, K] in pairs along K, in one of two layouts (cpu_gemm.pack picks one):
//   blocks  [ceil(n/16), K/2, 16, 2]: wp[b, p, j, t] = w[16 b + j, 2 p + t] (rows past n are zero)
//   groups  [n/64, K/2, 4, 16, 2]:    wp[g, p, b, j, t] = w[64 g + 16 b + j, 2 p + t] (AVX-512 BF16, n % 64 == 0)
// AVX-512 BF16: one VDPBF16PS multiplies a broadcast pair of x by 16 output rows' pairs and adds into 16
// float accumulators, so a tile of MR rows x NB blocks of 16 outputs keeps MR x NB accumulators in registers
// and reads each weight vector once for all MR rows. The groups layout puts the four blocks a tile reads
// side by side, so a thread reads its weights as one sequential stream instead of four interleaved ones: at
// one row (memory-bound; Zen 4, measured) 8-26% faster with one thread, with two 5-14% where the host's
// memory bandwidth leaves room and on a par where it is the limit; no slower at 16 or 64 rows. AVX2 + FMA
// (machines without native bf16 arithmetic, where torch's bf16 GEMM converts everything and runs several
// times slower than float32): the kernels of cpu_gemm_avx2.cpp, on the blocks layout. Threads claim runs of
// output blocks: at one row (a decode step at batch 1) every weight byte is read once, in a few sequential
// streams per thread, at memory speed; at many rows a thread's blocks stay in L2 while it walks the row
// tiles, and where the outputs make too few groups to balance the threads the rows are split as well
// (576 outputs: 9 groups; 383-414 -> 418-457 GFLOP/s at 64-1600 rows, two threads, Zen 4). Float
// accumulation (products of two bfloat16 are exact in float), one rounding to bfloat16 at the end: only the
// order of the sums differs from torch's F.linear, the reference.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "cpu_gemm_avx2.h"
#include "ops.h"
#include "vec.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define BR_GEMM_X86 1
#endif

namespace {

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

constexpr int NB = 4;   // output blocks of 16 per tile: 64 outputs
constexpr int MR = 6;   // rows per tile: 6 x 4 accumulators + 4 weight vectors + 1 broadcast <= 32 zmm

#ifdef BR_GEMM_X86
#define BR_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

// rows [m0, m0 + R) x blocks [b0, b0 + B) of the output; R <= MR, B <= NB; Grouped: the groups layout
// (b0 a multiple of NB, B == NB); NT: the weights by non-temporal loads (64-byte aligned; brgemm::nontemporal)
template <int R, int B, bool Grouped, bool NT>
BR_BF16_TARGET inline void tile(const uint16_t* __restrict__ x, int64_t xs, const uint16_t* __restrict__ wp,
                                int64_t KP, int64_t b0, uint16_t* __restrict__ out, int64_t os, int64_t n) {
  // block b's pair p: blocks layout at (b KP + p) 32, groups layout at (p NB + b) 32 from the tile's start
  __m512 acc[R][B];  // fully unrolled below, so these stay in registers
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  const uint16_t* w0 = wp + b0 * KP * 32;
  for (int64_t p = 0; p < KP; ++p) {
    __m512i w[B];
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) {
      const uint16_t* v = w0 + (Grouped ? p * NB + b : b * KP + p) * 32;
      w[b] = NT ? _mm512_stream_load_si512(const_cast<uint16_t*>(v)) : _mm512_loadu_si512(v);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      __builtin_memcpy(&pair, x + r * xs + 2 * p, 4);
      const __m512i xv = _mm512_set1_epi32(pair);
#pragma GCC unroll 8
      for (int b = 0; b < B; ++b)
        acc[r][b] = _mm512_dpbf16_ps(acc[r][b], (__m512bh)xv, (__m512bh)w[b]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) {
      const int64_t col = (b0 + b) * 16;
      const __m256i v = (__m256i)_mm512_cvtneps_pbh(acc[r][b]);
      const int64_t left = n - col;
      if (left >= 16) _mm256_storeu_si256((__m256i*)(out + r * os + col), v);
      else _mm256_mask_storeu_epi16(out + r * os + col, (__mmask16)((1u << left) - 1), v);
    }
}

template <int R, bool Grouped, bool NT>
BR_BF16_TARGET inline void row_tile(const uint16_t* x, int64_t xs, const uint16_t* wp, int64_t KP, int64_t b0,
                                    int64_t nb, uint16_t* out, int64_t os, int64_t n) {
  if (Grouped) return tile<R, NB, true, NT>(x, xs, wp, KP, b0, out, os, n);
  switch (nb) {
    case 4: return tile<R, 4, false, NT>(x, xs, wp, KP, b0, out, os, n);
    case 3: return tile<R, 3, false, NT>(x, xs, wp, KP, b0, out, os, n);
    case 2: return tile<R, 2, false, NT>(x, xs, wp, KP, b0, out, os, n);
    default: return tile<R, 1, false, NT>(x, xs, wp, KP, b0, out, os, n);
  }
}

// output block groups [g0, g1) (NB blocks each, the last one maybe fewer) for all M rows; NT only where
// M <= MR (one row tile: each weight read once)
template <bool Grouped, bool NT = false>
BR_BF16_TARGET void run_groups(const uint16_t* x, int64_t xs, int64_t M, const uint16_t* wp, int64_t KP,
                               int64_t blocks, uint16_t* out, int64_t os, int64_t n, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t b0 = g * NB, nb = std::min<int64_t>(NB, blocks - b0);
    int64_t m = 0;
    for (; m + MR <= M; m += MR) row_tile<MR, Grouped, NT>(x + m * xs, xs, wp, KP, b0, nb, out + m * os, os, n);
    const uint16_t* xr = x + m * xs;
    uint16_t* o = out + m * os;
    switch (M - m) {
      case 5: row_tile<5, Grouped, NT>(xr, xs, wp, KP, b0, nb, o, os, n); break;
      case 4: row_tile<4, Grouped, NT>(xr, xs, wp, KP, b0, nb, o, os, n); break;
      case 3: row_tile<3, Grouped, NT>(xr, xs, wp, KP, b0, nb, o, os, n); break;
      case 2: row_tile<2, Grouped, NT>(xr, xs, wp, KP, b0, nb, o, os, n); break;
      case 1: row_tile<1, Grouped, NT>(xr, xs, wp, KP, b0, nb, o, os, n); break;
      default: break;
    }
  }
}
#endif

enum Isa { NONE = 0, AVX2 = 1, AVX512_BF16 = 2 };

int detect() {
#ifdef BR_GEMM_X86
  const int64_t cap = isa_cap_from_env();     // $BATCHRUN_TEST_MAX_ISA (vec.h)
  if (cap == 0) return NONE;
  const bool avx2_only = cap == 1;
  __builtin_cpu_init();
  if (!avx2_only && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16"))
    return AVX512_BF16;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return AVX2;
#endif
  return NONE;
}
std::atomic<int64_t> isa_cap{AVX512_BF16};  // tests lower it to run the AVX2 path on an AVX-512 machine
int isa() {  // checked on every call: detected once
  static const int best = detect();
  return static_cast<int>(std::min<int64_t>(best, isa_cap.load(std::memory_order_relaxed)));
}
bool supported() { return isa() != NONE; }

Tensor bf16_linear(Tensor x, Tensor wp, int64_t n) {
  const int use = isa();
  STD_TORCH_CHECK(use != NONE, "bf16_linear: this CPU has neither AVX-512 BF16 nor AVX2 with FMA");
  STD_TORCH_CHECK(x.is_cpu() && wp.is_cpu() && x.scalar_type() == ScalarType::BFloat16 &&
                      wp.scalar_type() == ScalarType::BFloat16,
                  "bf16_linear: bfloat16 CPU tensors only");
  STD_TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "bf16_linear: x must be [M, K] with contiguous rows");
  const bool grouped = wp.dim() == 5;
  STD_TORCH_CHECK(wp.is_contiguous() && ((wp.dim() == 4 && wp.size(2) == 16 && wp.size(3) == 2) ||
                                         (grouped && wp.size(2) == NB && wp.size(3) == 16 && wp.size(4) == 2)),
                  "bf16_linear: wp must be a contiguous [blocks, K/2, 16, 2] or [groups, K/2, 4, 16, 2] "
                  "(cpu_gemm.pack)");
  STD_TORCH_CHECK(!grouped || use == AVX512_BF16, "bf16_linear: wp is in the AVX-512 BF16 groups layout and "
                  "this call runs the AVX2 kernel: pack the weight again (cpu_gemm.pack) under the same ISA");
  const int64_t M = x.size(0), K = x.size(1), blocks = wp.size(0) * (grouped ? NB : 1), KP = wp.size(1);
  STD_TORCH_CHECK(K == 2 * KP, "bf16_linear: x has K=", K, " but the packed weight ", 2 * KP);
  STD_TORCH_CHECK(n > (blocks - 1) * 16 && n <= blocks * 16, "bf16_linear: n=", n, " does not match ", blocks,
                  " blocks of 16");
  Tensor out = torch::stable::new_empty(x, {M, n});
#ifdef BR_GEMM_X86
  if (M == 0) return out;
  const uint16_t* xp = static_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* w = static_cast<const uint16_t*>(wp.data_ptr());
  uint16_t* o = static_cast<uint16_t*>(out.data_ptr());
  const int64_t xs = x.stride(0), os = out.stride(0), groups = (blocks + NB - 1) / NB;
  if (use == AVX2) {
    brgemm::avx2_linear(xp, xs, M, K, w, blocks, o, os, n);
    return out;
  }
  // work items: (group, chunk of rows), group-major; rows are split only where the groups alone are too few
  // to balance the threads (a hidden size of 576 is 9 groups: one thread took 5 of them, the other 4)
  const int64_t threads = std::max<int64_t>(1, torch::stable::get_num_threads());
  int64_t chunks = 1;
  if (groups < 8 * threads && M >= 4 * MR)
    chunks = std::min((8 * threads + groups - 1) / groups, M / (2 * MR));
  const int64_t per = (M + chunks - 1) / chunks, rows = (per + MR - 1) / MR * MR;  // whole row tiles
  chunks = (M + rows - 1) / rows;
  // a product of one row tile reads each weight once: by non-temporal loads where brgemm::nontemporal says
  const bool nt = M <= MR && brgemm::streams_weights(w);
  auto body = [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1;) {
      const int64_t g = i / chunks, c0 = i % chunks, c1 = std::min(chunks, c0 + (i1 - i));
      const int64_t m0 = c0 * rows, m1 = std::min(M, c1 * rows);
      const uint16_t* xr = xp + m0 * xs;
      uint16_t* orow = o + m0 * os;
      if (grouped && nt) run_groups<true, true>(xr, xs, m1 - m0, w, KP, blocks, orow, os, n, g, g + 1);
      else if (grouped) run_groups<true>(xr, xs, m1 - m0, w, KP, blocks, orow, os, n, g, g + 1);
      else if (nt) run_groups<false, true>(xr, xs, m1 - m0, w, KP, blocks, orow, os, n, g, g + 1);
      else run_groups<false>(xr, xs, m1 - m0, w, KP, blocks, orow, os, n, g, g + 1);
      i += c1 - c0;
    }
  };
  if (brgemm::one_thread(blocks, M, K)) body(0, groups * chunks);
  else brgemm::parallel_runs(groups * chunks, body);
#endif
  return out;
}

bool bf16_linear_supported() { return supported(); }

// the highest ISA the kernel may use (1 AVX2, 2 AVX-512 BF16; capped by the machine's); returns the old cap
int64_t set_gemm_isa(int64_t cap) { return isa_cap.exchange(cap); }
int64_t gemm_isa() { return isa(); }
// how a product of a few rows loads the weights: 0 ordinary loads, 1 non-temporal; returns the old mode
int64_t set_weight_loads(int64_t mode) { return brgemm::nontemporal.exchange(mode != 0); }
int64_t weight_loads() { return brgemm::nontemporal.load(); }

}  // namespace

namespace brcpu {  // for ops composed of these (ops.h)
Tensor bf16_linear(Tensor x, Tensor wp, int64_t n) { return ::bf16_linear(x, wp, n); }
}  // namespace brcpu

STABLE_TORCH_LIBRARY_FRAGMENT(batchrun_cpu, m) {
  m.def("bf16_linear(Tensor x, Tensor wp, int n) -> Tensor");
  m.def("bf16_linear_supported() -> bool");
  m.def("set_gemm_isa(int isa) -> int");
  m.def("gemm_isa() -> int");
  m.def("set_weight_loads(int mode) -> int");
  m.def("weight_loads() -> int");
}

STABLE_TORCH_LIBRARY_IMPL(batchrun_cpu, CPU, m) { m.impl("bf16_linear", TORCH_BOX(&bf16_linear)); }

STABLE_TORCH_LIBRARY_IMPL(batchrun_cpu, CompositeExplicitAutograd, m) {
  m.impl("bf16_linear_supported", TORCH_BOX(&bf16_linear_supported));
  m.impl("set_gemm_isa", TORCH_BOX(&set_gemm_isa));
  m.impl("gemm_isa", TORCH_BOX(&gemm_isa));
  m.impl("set_weight_loads", TORCH_BOX(&set_weight_loads));
  m.impl("weight_loads", TORCH_BOX(&weight_loads));
}
