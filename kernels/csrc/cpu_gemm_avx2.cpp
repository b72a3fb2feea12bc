// bf16_linear's kernels for x86-64 CPUs with AVX2 + FMA but no native bf16 arithmetic (cpu_gemm.cpp picks
// them at run time): out [M, n] bf16 = x [M, K] bf16 @ w.T, w packed as [n/16, K/2, 16, 2] (cpu_gemm.pack).
//
// A 32-bit lane of the packed layout is (even k, odd k) of one output: a shift and a mask make the two float
// vectors of 8 outputs' weights. Two paths, by the number of rows:
// - few rows (a decode step): bandwidth-bound. Each block of 16 outputs is one sequential stream, widened in
//   registers and used once per row; threads claim runs of blocks and prefetch ahead of the stream.
// - many rows (prefill, large decode batches): compute-bound. A thread widens a block's weights for KC
//   inputs once into a float panel (16 KiB, L1) and runs a 4-row x 16-output register tile over a chunk of
//   MC rows with it, so the widening is paid once per MC rows and the inner loop is two loads, four
//   broadcasts and eight FMAs: ~90% of the FMA peak where the first path reached ~80% (Zen 1, measured).
// Float accumulation, one rounding to bfloat16 (nearest even, as c10::BFloat16(float)) at the end: only the
// order of the float sums differs from the reference F.linear.
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_gemm_avx2.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

namespace {

#define BR_AVX2_TARGET __attribute__((target("avx2,fma")))
constexpr int64_t kPrefetchAhead = 512;  // bf16 elements (1 KiB) ahead of the weight stream: best of 256-2048
constexpr int64_t KC = 256;               // inputs per weight panel: 256 x 16 floats = 16 KiB
constexpr int64_t MC = 128;               // rows per chunk: their KC-wide slice of x stays in L2
constexpr int64_t kManyRows = 24;         // from here the panel path wins (measured crossover 16-24 rows)

// 16 packed bf16 (8 outputs x (even k, odd k)) -> the 8 outputs' even-k and odd-k weights as floats
BR_AVX2_TARGET inline __m256 even_half(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
BR_AVX2_TARGET inline __m256 odd_half(__m256i v) {
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// 8 floats -> bfloat16 bits in the low half of each 32-bit lane: round to nearest even, NaN -> 0x7fc0
BR_AVX2_TARGET inline __m256i round_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
}

// 16 floats -> bfloat16 (as c10::BFloat16(float)); the first `left` outputs stored
BR_AVX2_TARGET inline void store_bf16(__m256 lo, __m256 hi, uint16_t* out, int64_t left) {
  // packus interleaves the 128-bit lanes: [lo 0-3, hi 0-3, lo 4-7, hi 4-7] -> reorder to 0-15
  const __m256i v = _mm256_permute4x64_epi64(_mm256_packus_epi32(round_bf16(lo), round_bf16(hi)), 0xd8);
  if (left >= 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), v);
  } else {
    alignas(32) uint16_t t[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(t), v);
    std::copy(t, t + left, out);
  }
}

// ---- few rows: one block of 16 outputs x R <= 4 rows over all of K, straight from the packed weights ----

// x: the rows widened to float, even inputs then odd ones ([2, KP] a row, row stride xs), so each broadcast
// is one load (moving a scalar from an integer register to a vector one is slow on Zen). At one or two rows
// the even and odd products go to separate accumulators (four short dependency chains a row, not two long).
template <int R, bool NT>
BR_AVX2_TARGET inline void stream_tile(const float* __restrict__ x, int64_t xs, const uint16_t* __restrict__ wp,
                                       int64_t KP, int64_t b, uint16_t* __restrict__ out, int64_t os, int64_t n) {
  constexpr int A = R <= 2 ? 4 : 2;
  __m256 acc[R][A];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int a = 0; a < A; ++a) acc[r][a] = _mm256_setzero_ps();
  const uint16_t* w = wp + b * KP * 32;
  for (int64_t p = 0; p < KP; ++p) {
    // one stream a thread: the hardware prefetcher alone keeps too few lines in flight to reach memory speed
    // (Zen 1, two threads: 11-13 GB/s without this, 15-17 with it)
    // (NT: to L1 only, and non-temporal loads: cpu_gemm_avx2.h's brgemm::nontemporal)
    _mm_prefetch(reinterpret_cast<const char*>(w + p * 32 + kPrefetchAhead), NT ? _MM_HINT_NTA : _MM_HINT_T0);
    const __m256i* wv = reinterpret_cast<const __m256i*>(w + p * 32);
    const __m256i v0 = NT ? _mm256_stream_load_si256(wv) : _mm256_loadu_si256(wv);               // outputs 0..7
    const __m256i v1 = NT ? _mm256_stream_load_si256(wv + 1) : _mm256_loadu_si256(wv + 1);       // outputs 8..15
    const __m256 e0 = even_half(v0), o0 = odd_half(v0), e1 = even_half(v1), o1 = odd_half(v1);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 be = _mm256_broadcast_ss(x + r * xs + p), bo = _mm256_broadcast_ss(x + r * xs + KP + p);
      if constexpr (A == 4) {
        acc[r][0] = _mm256_fmadd_ps(be, e0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(be, e1, acc[r][1]);
        acc[r][2] = _mm256_fmadd_ps(bo, o0, acc[r][2]);
        acc[r][3] = _mm256_fmadd_ps(bo, o1, acc[r][3]);
      } else {
        acc[r][0] = _mm256_fmadd_ps(bo, o0, _mm256_fmadd_ps(be, e0, acc[r][0]));
        acc[r][1] = _mm256_fmadd_ps(bo, o1, _mm256_fmadd_ps(be, e1, acc[r][1]));
      }
    }
  }
  const int64_t left = std::min<int64_t>(16, n - b * 16);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    if constexpr (A == 4)
      store_bf16(_mm256_add_ps(acc[r][0], acc[r][2]), _mm256_add_ps(acc[r][1], acc[r][3]), out + r * os + b * 16, left);
    else
      store_bf16(acc[r][0], acc[r][1], out + r * os + b * 16, left);
  }
}

// x [M, K] bfloat16 (row stride xs) -> xf [M, 2, KP] float: even inputs, then odd ones
void widen_split(const uint16_t* x, int64_t xs, int64_t M, int64_t KP, float* xf) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t p = 0; p < KP; ++p) {
      uint32_t pair;
      __builtin_memcpy(&pair, x + m * xs + 2 * p, 4);
      const uint32_t even = pair << 16, odd = pair & 0xffff0000u;
      __builtin_memcpy(xf + m * 2 * KP + p, &even, 4);
      __builtin_memcpy(xf + m * 2 * KP + KP + p, &odd, 4);
    }
}

template <bool NT>
BR_AVX2_TARGET void stream_blocks(const float* x, int64_t M, const uint16_t* wp, int64_t KP, uint16_t* out,
                                  int64_t os, int64_t n, int64_t b0, int64_t b1) {
  const int64_t xs = 2 * KP;
  for (int64_t b = b0; b < b1; ++b) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) stream_tile<4, NT>(x + m * xs, xs, wp, KP, b, out + m * os, os, n);
    const float* xr = x + m * xs;
    uint16_t* o = out + m * os;
    switch (M - m) {
      case 3: stream_tile<3, NT>(xr, xs, wp, KP, b, o, os, n); break;
      case 2: stream_tile<2, NT>(xr, xs, wp, KP, b, o, os, n); break;
      case 1: stream_tile<1, NT>(xr, xs, wp, KP, b, o, os, n); break;
      default: break;
    }
  }
}

// ---- many rows: float weight panels, 4 x 16 register tiles ----

// block b's weights for inputs [k0, k0 + kc) (k0, kc even) -> panel [kc, 16] float
BR_AVX2_TARGET inline void widen_panel(const uint16_t* wp, int64_t KP, int64_t b, int64_t k0, int64_t kc,
                                       float* __restrict__ panel) {
  const uint16_t* w = wp + b * KP * 32 + (k0 / 2) * 32;
  for (int64_t p = 0; p < kc / 2; ++p) {
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32 + 16));
    float* d = panel + p * 32;
    _mm256_store_ps(d, even_half(v0));       // input 2p, outputs 0..7
    _mm256_store_ps(d + 8, even_half(v1));   // input 2p, outputs 8..15
    _mm256_store_ps(d + 16, odd_half(v0));   // input 2p + 1
    _mm256_store_ps(d + 24, odd_half(v1));
  }
}

// R <= 4 rows of x (float, row stride xs, already offset to k0) x the panel's kc inputs, added to the partial
// sums `part` [R, 16] (zeros when first); the last chunk of K rounds into out instead
template <int R>
BR_AVX2_TARGET inline void panel_tile(const float* __restrict__ x, int64_t xs, int64_t kc,
                                      const float* __restrict__ panel, float* __restrict__ part, bool first,
                                      bool last, uint16_t* __restrict__ out, int64_t os, int64_t left) {
  __m256 a0[R], a1[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    a0[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(part + r * 16);
    a1[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(part + r * 16 + 8);
  }
#pragma GCC unroll 2
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 w0 = _mm256_load_ps(panel + k * 16), w1 = _mm256_load_ps(panel + k * 16 + 8);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * xs + k);
      a0[r] = _mm256_fmadd_ps(xv, w0, a0[r]);
      a1[r] = _mm256_fmadd_ps(xv, w1, a1[r]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    if (last) {
      store_bf16(a0[r], a1[r], out + r * os, left);
    } else {
      _mm256_storeu_ps(part + r * 16, a0[r]);
      _mm256_storeu_ps(part + r * 16 + 8, a1[r]);
    }
  }
}

// output blocks [b0, b1) for all M rows; x widened in natural order ([M, K] float)
BR_AVX2_TARGET void panel_blocks(const float* x, int64_t M, int64_t K, const uint16_t* wp, uint16_t* out,
                                 int64_t os, int64_t n, int64_t b0, int64_t b1) {
  alignas(32) float panel[KC * 16];
  alignas(32) float part[MC * 16];
  const int64_t KP = K / 2;
  for (int64_t m0 = 0; m0 < M; m0 += MC) {
    const int64_t m1 = std::min(M, m0 + MC);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t left = std::min<int64_t>(16, n - b * 16);
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = std::min(KC, K - k0);
        const bool first = k0 == 0, last = k0 + kc == K;
        widen_panel(wp, KP, b, k0, kc, panel);
        int64_t m = m0;
        for (; m + 4 <= m1; m += 4)
          panel_tile<4>(x + m * K + k0, K, kc, panel, part + (m - m0) * 16, first, last, out + m * os + b * 16, os, left);
        for (; m < m1; ++m)
          panel_tile<1>(x + m * K + k0, K, kc, panel, part + (m - m0) * 16, first, last, out + m * os + b * 16, os, left);
      }
    }
  }
}

// x [M, K] bfloat16 (row stride xs) -> xf [M, K] float, rows [m0, m1)
void widen_rows(const uint16_t* x, int64_t xs, int64_t K, float* xf, int64_t m0, int64_t m1) {
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t k = 0; k < K; ++k) {
      const uint32_t u = static_cast<uint32_t>(x[m * xs + k]) << 16;
      __builtin_memcpy(xf + m * K + k, &u, 4);
    }
}

}  // namespace

namespace brgemm {

void avx2_linear(const uint16_t* x, int64_t xs, int64_t M, int64_t K, const uint16_t* wp, int64_t blocks,
                 uint16_t* out, int64_t os, int64_t n) {
  const int64_t KP = K / 2;
  std::vector<float> xf(static_cast<size_t>(M * K));
  if (M < kManyRows) {
    widen_split(x, xs, M, KP, xf.data());
    const bool nt = M <= 4 && streams_weights(wp);   // one tile of <= 4 rows reads each weight once
    auto body = [&](int64_t b0, int64_t b1) {
      if (nt) stream_blocks<true>(xf.data(), M, wp, KP, out, os, n, b0, b1);
      else stream_blocks<false>(xf.data(), M, wp, KP, out, os, n, b0, b1);
    };
    if (one_thread(blocks, M, K)) body(0, blocks);
    else parallel_runs(blocks, body);
    return;
  }
  torch::stable::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) { widen_rows(x, xs, K, xf.data(), m0, m1); });
  parallel_runs(blocks, [&](int64_t b0, int64_t b1) { panel_blocks(xf.data(), M, K, wp, out, os, n, b0, b1); });
}

}  // namespace brgemm

#else

namespace brgemm {
void avx2_linear(const uint16_t*, int64_t, int64_t, int64_t, const uint16_t*, int64_t, uint16_t*, int64_t, int64_t) {}
}  // namespace brgemm

#endif
