// W8A8 products on x86-64 CPUs with AVX-512 VNNI (batchrun.kernels.cpu_w8a8; models/w8a8.py's "own" kernel).
//
// batchrun_cpu::w8a8_quantize(x [M, K] bf16/f32, inv_smooth [K] f32 or empty, group, rotate) -> (u8 [M, K] uint8,
//                            sx [M, K / group] f32)
//   per group of `group` columns of a row (0 or K: the whole row): v = x * inv_smooth (with rotate: then times
//   the normalized 64 x 64 Hadamard matrix per block of 64, a fast Walsh-Hadamard transform in registers),
//   sx = max|v| / 127 (at least 1e-30), code round(v / sx) stored + 128 as uint8: models/w8a8.py
//   quantize_rows' arithmetic in the same order (float division, ties to even), so the codes are its codes + 128.
// batchrun_cpu::w8a8_gemm(u8 [M, K], sx [M, G], wp [blocks, K/4, 16, 4] int8, offset [blocks, G, 16] int32,
//                         scales [blocks, G, 16] f32, n, bf16_out) -> [M, n] (bf16 or f32), G groups along K
//   One group (per-row activations, per-channel weights): y[m, j] = (float(sum_k (u8[m, k] - 128) w[j, k]) *
//   scales[j]) * sx[m], as the int_mm path computes it: one VPDPBUSD multiplies 4 unsigned activation bytes by
//   4 signed weight bytes for 16 outputs and adds into 16 int32 sums, which start at offset[j] = -128 *
//   sum_k w[j, k]: that takes the shift by 128 off. So the result equals torch._int_mm's path bit for bit
//   (float32, and its rounding to bfloat16). G groups (llama.cpp's Q8_0 x Q8_0 form): each group's int32 sums,
//   started at that group's offset, fold into float32 ones as y += (float(sum_g) * sx[m, g]) * scales[g, j],
//   g in order (a multiply and an FMA each: models/w8a8.py's float path rounds the product and sum apart).
//   A tile of MR rows x NB blocks keeps its int32 sums in registers; a grouped tile's float32 sums sit in
//   registers too up to MRG rows, and in an L1 array above. Threads take (block group, row chunk) items as the
//   bf16 kernel does. The grouped form runs at ~85% of the one-group kernel's rate on Zen 5 (its fold: a
//   convert, a multiply and an FMA per 16 VPDPBUSD, and the L1 round trip); with its float sums in registers
//   (3-row tiles, too few loads shared) it ran at ~72%.
// Both ops refuse to run without AVX-512 VNNI (w8a8_supported() says): models/w8a8.py then keeps torch's kernels.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include "vec.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define BR_VNNI_X86 1
#endif

namespace {

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

constexpr int NB = 4;   // blocks of 16 outputs per tile
constexpr int MR = 6;   // rows per tile: 24 int32 accumulators + 4 weight vectors + 1 broadcast
constexpr int MRG = 3;  // grouped tiles up to this: 12 int32 + 12 float32 sums + 4 weight vectors in registers

bool detect() {
#ifdef BR_VNNI_X86
  if (isa_cap_from_env() < 2) return false;   // $BATCHRUN_TEST_MAX_ISA below AVX-512 (vec.h)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}
bool supported() {
  static const bool ok = detect();
  return ok;
}

#ifdef BR_VNNI_X86
#define BR_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

#include "cpu_w8a8_quantize.h"   // load16, hadamard64, quantize_rows: the activations' pass

BR_VNNI_TARGET inline __m256i to_bf16(__m512 f) {  // round to nearest even, as torch converts finite floats
  const __m512i b = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16));
}

struct Gemm {
  const uint8_t* x;
  int64_t K, KP, M, blocks, n, ng;   // ng groups along K (1: per-row activations, per-channel weights)
  const int8_t* wp;
  const int32_t* offset;
  const float* sw;
  const float* sx;
  void* out;
  bool bf16;
};

// acc[r][b] += the products of quads [p0, p1) of rows r with blocks b: one VPDPBUSD per (r, b, quad)
template <int R, int B>
BR_VNNI_TARGET __attribute__((always_inline)) inline void accumulate(__v16si (&acc)[R][B],
                                                                     const uint8_t* __restrict__ x0, int64_t K,
                                                                     const int8_t* __restrict__ w0, int64_t KP,
                                                                     int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    __m512i w[B];
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) w[b] = _mm512_loadu_si512(w0 + (b * KP + p) * 64);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      __builtin_memcpy(&quad, x0 + r * K + 4 * p, 4);
      const __m512i xv = _mm512_set1_epi32(quad);
#pragma GCC unroll 8
      for (int b = 0; b < B; ++b) acc[r][b] = (__v16si)_mm512_dpbusd_epi32((__m512i)acc[r][b], xv, w[b]);
    }
  }
}

// rows [m0, m0 + R) x blocks [b0, b0 + B) of the output
template <int R, int B, bool BF16>
BR_VNNI_TARGET inline void tile(const uint8_t* __restrict__ x0, int64_t K, const int8_t* __restrict__ w0, int64_t KP,
                                const int32_t* __restrict__ offset, const float* __restrict__ sw,
                                const float* __restrict__ sx, void* __restrict__ out, int64_t n, int64_t col0) {
  // int32 x 16 sums, fully unrolled below, so these stay in registers. As __m512i (two int64 x 8 views of
  // the builtin's int32 x 16) GCC 12 also kept each in memory, a store and three moves per VPDPBUSD.
  __v16si acc[R][B];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) acc[r][b] = (__v16si)_mm512_loadu_si512(offset + col0 + b * 16);   // the shift off
  accumulate<R, B>(acc, x0, K, w0, KP, 0, KP);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m512 sr = _mm512_set1_ps(sx[r]);
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) {
      const int64_t col = col0 + b * 16, left = n - col;
      const __mmask16 m = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
      const __m512 f = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps((__m512i)acc[r][b]), _mm512_loadu_ps(sw + col)),
                                     sr);
      if (BF16) _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + r * n + col, m, to_bf16(f));
      else _mm512_mask_storeu_ps(static_cast<float*>(out) + r * n + col, m, f);
    }
  }
}

// a grouped tile's float32 sums: in registers up to MRG rows; above, in an L1 array (24 of them do not fit
// beside 24 int32 sums, and GCC's own spills of a register array ran ~10% slower than these loads and stores)
template <int R, int B, bool InRegs>
struct FloatSums {
  __m512 v[R][B];
  BR_VNNI_TARGET __attribute__((always_inline)) __m512 get(int r, int b) const { return v[r][b]; }
  BR_VNNI_TARGET __attribute__((always_inline)) void put(int r, int b, __m512 x) { v[r][b] = x; }
};
template <int R, int B>
struct FloatSums<R, B, false> {
  alignas(64) float v[R][B][16];
  BR_VNNI_TARGET __attribute__((always_inline)) __m512 get(int r, int b) const { return _mm512_load_ps(v[r][b]); }
  BR_VNNI_TARGET __attribute__((always_inline)) void put(int r, int b, __m512 x) { _mm512_store_ps(v[r][b], x); }
};

// the same rows x blocks with ng groups of KP / ng quads along K: sx is [rows, ng] from m0; offset and sw
// are [blocks, ng, 16] from block col0 / 16, so one tile's are contiguous
template <int R, int B, bool BF16>
BR_VNNI_TARGET inline void tile_grouped(const uint8_t* __restrict__ x0, int64_t K, const int8_t* __restrict__ w0,
                                        int64_t KP, int64_t ng, const int32_t* __restrict__ offset,
                                        const float* __restrict__ sw, const float* __restrict__ sx,
                                        void* __restrict__ out, int64_t n, int64_t col0) {
  const int64_t GP = KP / ng;
  FloatSums<R, B, (R <= MRG)> accf;
  for (int64_t g = 0; g < ng; ++g) {
    __v16si acc[R][B];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int b = 0; b < B; ++b) acc[r][b] = (__v16si)_mm512_loadu_si512(offset + (b * ng + g) * 16);  // the shift off
    accumulate<R, B>(acc, x0, K, w0, KP, g * GP, (g + 1) * GP);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 sr = _mm512_set1_ps(sx[r * ng + g]);
#pragma GCC unroll 8
      for (int b = 0; b < B; ++b) {
        const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps((__m512i)acc[r][b]), sr);
        const __m512 s = _mm512_loadu_ps(sw + (b * ng + g) * 16);
        accf.put(r, b, g ? _mm512_fmadd_ps(f, s, accf.get(r, b)) : _mm512_mul_ps(f, s));
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) {
      const int64_t col = col0 + b * 16, left = n - col;
      const __mmask16 m = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
      const __m512 f = accf.get(r, b);
      if (BF16) _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + r * n + col, m, to_bf16(f));
      else _mm512_mask_storeu_ps(static_cast<float*>(out) + r * n + col, m, f);
    }
}

template <int R, int B>
BR_VNNI_TARGET inline void tile_of(const Gemm& g, int64_t m0, int64_t b0) {
  const uint8_t* x0 = g.x + m0 * g.K;
  const int8_t* w0 = g.wp + b0 * g.KP * 64;
  const float* sx = g.sx + m0 * g.ng;
  void* out = g.bf16 ? static_cast<void*>(static_cast<uint16_t*>(g.out) + m0 * g.n)
                     : static_cast<void*>(static_cast<float*>(g.out) + m0 * g.n);
  if (g.ng > 1) {
    const int32_t* og = g.offset + b0 * g.ng * 16;
    const float* sg = g.sw + b0 * g.ng * 16;
    if (g.bf16) tile_grouped<R, B, true>(x0, g.K, w0, g.KP, g.ng, og, sg, sx, out, g.n, b0 * 16);
    else tile_grouped<R, B, false>(x0, g.K, w0, g.KP, g.ng, og, sg, sx, out, g.n, b0 * 16);
  } else if (g.bf16) {
    tile<R, B, true>(x0, g.K, w0, g.KP, g.offset, g.sw, sx, out, g.n, b0 * 16);
  } else {
    tile<R, B, false>(x0, g.K, w0, g.KP, g.offset, g.sw, sx, out, g.n, b0 * 16);
  }
}

template <int R>
BR_VNNI_TARGET inline void row_tile(const Gemm& g, int64_t m0, int64_t b0, int64_t nb) {
  switch (nb) {
    case 4: return tile_of<R, 4>(g, m0, b0);
    case 3: return tile_of<R, 3>(g, m0, b0);
    case 2: return tile_of<R, 2>(g, m0, b0);
    default: return tile_of<R, 1>(g, m0, b0);
  }
}

// rows [m0, m1) of block group grp: tiles of MR rows, then the rest in one
BR_VNNI_TARGET void run(const Gemm& g, int64_t grp, int64_t m0, int64_t m1) {
  const int64_t b0 = grp * NB, nb = std::min<int64_t>(NB, g.blocks - b0);
  int64_t m = m0;
  for (; m + MR <= m1; m += MR) row_tile<MR>(g, m, b0, nb);
  switch (m1 - m) {
    case 5: row_tile<5>(g, m, b0, nb); break;
    case 4: row_tile<4>(g, m, b0, nb); break;
    case 3: row_tile<3>(g, m, b0, nb); break;
    case 2: row_tile<2>(g, m, b0, nb); break;
    case 1: row_tile<1>(g, m, b0, nb); break;
    default: break;
  }
}
#endif

std::tuple<Tensor, Tensor> w8a8_quantize(Tensor x, Tensor inv_smooth, int64_t group, bool rotate) {
  STD_TORCH_CHECK(supported(), "w8a8_quantize: this CPU has no AVX-512 VNNI");
  const ScalarType st = x.scalar_type();
  STD_TORCH_CHECK(x.is_cpu() && x.dim() == 2 && x.stride(1) == 1 &&
                      (st == ScalarType::BFloat16 || st == ScalarType::Float),
                  "w8a8_quantize: x must be a bfloat16 or float32 [M, K] CPU tensor with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1), G = group > 0 ? group : K;
  STD_TORCH_CHECK(G == K || (G % 16 == 0 && K % G == 0), "w8a8_quantize: group ", group,
                  " must be 0, K or a multiple of 16 dividing K=", K);
  STD_TORCH_CHECK(!rotate || K % 64 == 0, "w8a8_quantize: rotate needs K a multiple of 64, got K=", K);
  const bool smooth = inv_smooth.numel() > 0;
  STD_TORCH_CHECK(!smooth || (inv_smooth.scalar_type() == ScalarType::Float && inv_smooth.is_contiguous() &&
                              inv_smooth.numel() == K),
                  "w8a8_quantize: inv_smooth must be a contiguous float32 [K] tensor (or empty)");
  Tensor u8 = torch::stable::new_empty(x, {M, K}, ScalarType::Byte);
  Tensor sx = torch::stable::new_empty(x, {M, K / G}, ScalarType::Float);
#ifdef BR_VNNI_X86
  const float* inv = smooth ? static_cast<const float*>(inv_smooth.data_ptr()) : nullptr;
  auto body = [&](int64_t r0, int64_t r1) {
    quantize_rows(x.data_ptr(), x.stride(0), st == ScalarType::BFloat16, inv, K, G, rotate,
                  static_cast<uint8_t*>(u8.data_ptr()), static_cast<float*>(sx.data_ptr()), r0, r1);
  };
  if (M * K < (1 << 16)) body(0, M);
  else torch::stable::parallel_for(0, M, std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(K, 1)), body);
#endif
  return std::make_tuple(u8, sx);
}

Tensor w8a8_gemm(Tensor u8, Tensor sx, Tensor wp, Tensor offset, Tensor scales, int64_t n, bool bf16_out) {
  STD_TORCH_CHECK(supported(), "w8a8_gemm: this CPU has no AVX-512 VNNI");
  STD_TORCH_CHECK(u8.is_cpu() && u8.scalar_type() == ScalarType::Byte && u8.dim() == 2 && u8.is_contiguous(),
                  "w8a8_gemm: u8 must be a contiguous uint8 [M, K] CPU tensor");
  STD_TORCH_CHECK(wp.scalar_type() == ScalarType::Char && wp.dim() == 4 && wp.size(2) == 16 && wp.size(3) == 4 &&
                      wp.is_contiguous(),
                  "w8a8_gemm: wp must be a contiguous int8 [blocks, K/4, 16, 4] tensor (cpu_w8a8.pack)");
  const int64_t M = u8.size(0), K = u8.size(1), blocks = wp.size(0), KP = wp.size(1);
  STD_TORCH_CHECK(K == 4 * KP, "w8a8_gemm: u8 has K=", K, " but the packed weight ", 4 * KP);
  STD_TORCH_CHECK(n > (blocks - 1) * 16 && n <= blocks * 16, "w8a8_gemm: n=", n, " does not match ", blocks,
                  " blocks of 16");
  const int64_t ng = scales.numel() / std::max<int64_t>(1, blocks * 16);
  STD_TORCH_CHECK(ng >= 1 && KP % ng == 0 && offset.scalar_type() == ScalarType::Int && offset.is_contiguous() &&
                      offset.numel() == ng * blocks * 16 && scales.scalar_type() == ScalarType::Float &&
                      scales.is_contiguous() && scales.numel() == ng * blocks * 16,
                  "w8a8_gemm: offset (int32) and scales (float32) must be contiguous [blocks, G, 16], G groups "
                  "of a multiple of 4 dividing K");
  STD_TORCH_CHECK(sx.scalar_type() == ScalarType::Float && sx.is_contiguous() && sx.numel() == M * ng,
                  "w8a8_gemm: sx must be a contiguous float32 [M, G]");
  Tensor out = torch::stable::new_empty(u8, {M, n}, bf16_out ? ScalarType::BFloat16 : ScalarType::Float);
#ifdef BR_VNNI_X86
  if (M == 0) return out;
  const Gemm g{static_cast<const uint8_t*>(u8.data_ptr()), K, KP, M, blocks, n, ng,
               static_cast<const int8_t*>(wp.data_ptr()), static_cast<const int32_t*>(offset.data_ptr()),
               static_cast<const float*>(scales.data_ptr()), static_cast<const float*>(sx.data_ptr()),
               out.data_ptr(), bf16_out};
  const int64_t groups = (blocks + NB - 1) / NB;
  const int64_t threads = std::max<int64_t>(1, torch::stable::get_num_threads());
  int64_t chunks = 1;        // rows are split only where the groups alone cannot balance the threads
  if (groups < 8 * threads && M >= 4 * MR) chunks = std::min((8 * threads + groups - 1) / groups, M / (2 * MR));
  const int64_t rows = ((M + chunks - 1) / chunks + MR - 1) / MR * MR;
  chunks = (M + rows - 1) / rows;
  auto body = [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t grp = i / chunks, c = i % chunks;
      run(g, grp, c * rows, std::min(M, (c + 1) * rows));
    }
  };
  if (threads == 1 || groups * chunks == 1 || M * n * K < (1 << 18)) body(0, groups * chunks);
  else torch::stable::parallel_for(0, groups * chunks, 1, body);
#endif
  return out;
}

bool w8a8_supported() { return supported(); }

}  // namespace

namespace brcpu {  // for ops composed of these (ops.h)
Tensor w8a8_linear(Tensor x, Tensor inv_smooth, Tensor wp, Tensor offset, Tensor scales, int64_t n, bool rotate) {
  const int64_t ng = scales.numel() / std::max<int64_t>(1, wp.size(0) * 16);   // groups: scales [G, blocks * 16]
  auto [u8, sx] = ::w8a8_quantize(x, inv_smooth, x.size(1) / std::max<int64_t>(1, ng), rotate);
  return ::w8a8_gemm(u8, sx, wp, offset, scales, n, x.scalar_type() == ScalarType::BFloat16);
}
}  // namespace brcpu

STABLE_TORCH_LIBRARY_FRAGMENT(batchrun_cpu, m) {
  m.def("w8a8_quantize(Tensor x, Tensor inv_smooth, int group, bool rotate) -> (Tensor, Tensor)");
  m.def("w8a8_gemm(Tensor u8, Tensor sx, Tensor wp, Tensor offset, Tensor scales, int n, bool bf16_out) -> Tensor");
  m.def("w8a8_supported() -> bool");
}

STABLE_TORCH_LIBRARY_IMPL(batchrun_cpu, CPU, m) {
  m.impl("w8a8_quantize", TORCH_BOX(&w8a8_quantize));
  m.impl("w8a8_gemm", TORCH_BOX(&w8a8_gemm));
}

STABLE_TORCH_LIBRARY_IMPL(batchrun_cpu, CompositeExplicitAutograd, m) {
  m.impl("w8a8_supported", TORCH_BOX(&w8a8_supported));
}
