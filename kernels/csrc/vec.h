// Shared by batchrun's CPU ops: portable vector helpers (GCC/Clang vector extensions), element conversions
// and the run-time ISA choice. Each op compiles its kernel per ISA with function target attributes.
#pragma once

#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Float8_e4m3fn.h>
#include <torch/headeronly/util/Float8_e5m2.h>
#include <torch/headeronly/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#if defined(__GNUC__) || defined(__clang__)
#define BR_INLINE inline __attribute__((always_inline))
#define BR_RESTRICT __restrict__
#else
#define BR_INLINE inline
#define BR_RESTRICT
#endif

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define BR_X86_DISPATCH 1
#endif

namespace {

// ---- element conversions ----
BR_INLINE float to_f(float x) { return x; }
BR_INLINE float to_f(c10::BFloat16 x) {
  uint32_t u = uint32_t(x.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
BR_INLINE float to_f(c10::Half x) { return static_cast<float>(x); }
BR_INLINE float to_f(c10::Float8_e4m3fn x) { return static_cast<float>(x); }
BR_INLINE float to_f(c10::Float8_e5m2 x) { return static_cast<float>(x); }

template <typename T>
constexpr bool is_fp8 = std::is_same_v<T, c10::Float8_e4m3fn> || std::is_same_v<T, c10::Float8_e5m2>;

// an int8 KV cache row (kernels/kv_quant.py): head_dim codes, then a float16 scale per group of I8_GROUP
constexpr int I8_GROUP = 32;
inline int64_t i8_row(int64_t D) { return D + 2 * ((D + I8_GROUP - 1) / I8_GROUP); }
inline int64_t i8_head_dim(int64_t row) { return row - 2 * ((row + I8_GROUP + 1) / (I8_GROUP + 2)); }

// ---- vectors: GCC/Clang vector extensions of V floats, V = 16 (AVX-512: one zmm), 8 (AVX2: one ymm) or 4
// (SSE, NEON): one register each, so the accumulators below stay in registers on every ISA ----
template <int V>
struct VT {
  typedef float f __attribute__((vector_size(4 * V)));
  typedef int32_t i __attribute__((vector_size(4 * V)));
  typedef uint32_t u __attribute__((vector_size(4 * V)));
  typedef uint16_t h __attribute__((vector_size(2 * V)));  // V bfloat16 bit patterns
  typedef uint8_t b __attribute__((vector_size(V)));       // V float8 bit patterns
  typedef int8_t c __attribute__((vector_size(V)));        // V int8 codes
  typedef int16_t s __attribute__((vector_size(2 * V)));
};
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
typedef float vf2 __attribute__((vector_size(8)));

template <int V>
BR_INLINE typename VT<V>::f vload(const float* p) {
  typename VT<V>::f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <int V>
BR_INLINE void vstore(float* p, typename VT<V>::f v) { std::memcpy(p, &v, sizeof v); }
template <int V>
BR_INLINE typename VT<V>::f vsplat(float x) { return typename VT<V>::f{} + x; }
template <int V>
BR_INLINE typename VT<V>::f vmax(typename VT<V>::f a, typename VT<V>::f b) { return a > b ? a : b; }

BR_INLINE float hsum4(vf4 b) {
  const vf4 c = b + __builtin_shufflevector(b, b, 2, 3, 0, 1);
  return c[0] + c[1];
}
template <int V>
BR_INLINE float hsum(typename VT<V>::f v) {
  if constexpr (V == 16) {
    const vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    return hsum4(__builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7));
  } else if constexpr (V == 8) {
    return hsum4(__builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7));
  } else {
    return hsum4(v);
  }
}

// exp(x) = 2^(x log2 e) = 2^n 2^f, n an integer, |f| <= 1/2: returns 2^f (degree-7 Taylor polynomial,
// truncation error < 1e-8 relative) and n, for x in [-87, 89]
template <int V>
BR_INLINE typename VT<V>::f vexp_parts(typename VT<V>::f x, typename VT<V>::i& n_out) {
  typedef typename VT<V>::f F;
  const F y = x * 1.44269504088896341f;
  const F n = (y + 12582912.0f) - 12582912.0f;  // round to nearest (no -ffast-math, so not folded)
  const F f = y - n;
  F p = vsplat<V>(1.5252733804059841e-05f);
  p = p * f + 1.5403530393381606e-04f;
  p = p * f + 1.3333558146428443e-03f;
  p = p * f + 9.6181291076284772e-03f;
  p = p * f + 5.5504108664821580e-02f;
  p = p * f + 2.4022650695910072e-01f;
  p = p * f + 6.9314718055994531e-01f;
  p = p * f + 1.0f;
  n_out = __builtin_convertvector(n, typename VT<V>::i);
  return p;
}

// p * 2^n by adding n to p's exponent field (p in [0.7, 1.5], so the result stays normal for n >= -125)
template <int V>
BR_INLINE typename VT<V>::f vscale2(typename VT<V>::f p, typename VT<V>::i n) {
  typedef typename VT<V>::i I;
  const I bits = reinterpret_cast<const I&>(p) + (n << 23);
  return reinterpret_cast<const typename VT<V>::f&>(bits);
}

// exp(x) for x <= 0 (a score less the running max); exactly 0 below -87, so for -inf (masked keys)
template <int V>
BR_INLINE typename VT<V>::f vexp_nonpos(typename VT<V>::f x) {
  typedef typename VT<V>::f F;
  typedef typename VT<V>::i I;
  const F lim = vsplat<V>(-87.0f);
  I n;
  const F p = vexp_parts<V>(x < lim ? lim : x, n);
  return x < lim ? F{} : vscale2<V>(p, n);
}

// V bytes widened to 32-bit lanes (sign- or zero-extended) in two steps: GCC scalarises a direct
// __builtin_convertvector from 8-bit lanes (one VCVTSI2SS or VPINSRD per lane: attention on int8 and float8
// caches measured 2.2-2.5x slower than on bf16), while 8 -> 16 -> 32 bits becomes VPMOVSXBW / VPMOVSXWD.
template <int V>
BR_INLINE typename VT<V>::i widen_i8(const int8_t* p) {
  typename VT<V>::c raw;
  std::memcpy(&raw, p, sizeof raw);
  const typename VT<V>::s w = __builtin_convertvector(raw, typename VT<V>::s);
  return __builtin_convertvector(w, typename VT<V>::i);
}
template <int V>
BR_INLINE typename VT<V>::u widen_u8(const uint8_t* p) {
  typename VT<V>::b raw;
  std::memcpy(&raw, p, sizeof raw);
  const typename VT<V>::h w = __builtin_convertvector(raw, typename VT<V>::h);
  return __builtin_convertvector(w, typename VT<V>::u);
}
// V int8 codes as floats (sign-extended, converted exactly)
template <int V>
BR_INLINE typename VT<V>::f vload_i8(const int8_t* p) {
  return __builtin_convertvector(widen_i8<V>(p), typename VT<V>::f);
}

// V bfloat16 values at p as V floats (a bfloat16 is the top half of a float)
template <int V>
BR_INLINE typename VT<V>::f vload_bf16(const c10::BFloat16* p) {
  typedef typename VT<V>::h U16;
  typedef typename VT<V>::u U32;
  U16 raw;
  std::memcpy(&raw, p, sizeof raw);
  const U32 bits = __builtin_convertvector(raw, U32) << 16;
  return reinterpret_cast<const typename VT<V>::f&>(bits);
}
// V floats rounded to bfloat16 at p: round to nearest even, as c10::BFloat16(float) (NaN -> 0x7fc0)
template <int V>
BR_INLINE void vstore_bf16(c10::BFloat16* p, typename VT<V>::f x) {
  typedef typename VT<V>::h U16;
  typedef typename VT<V>::u U32;
  const U32 u = reinterpret_cast<const U32&>(x);
  U32 r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  r = (x != x) ? U32{} + 0x7fc0u : r;
  const U16 out = __builtin_convertvector(r, U16);
  std::memcpy(p, &out, sizeof out);
}
// V float8 values at p as V floats, exactly, by moving the bit fields (no table, no gather). A normal
// value's exponent is rebased (e4m3: bias 7 -> 127, e5m2: 15 -> 127); a subnormal is its mantissa times
// 2^-9 (e4m3) or 2^-16 (e5m2), converted as an integer (no float denormals, so flush-to-zero modes are moot);
// e4m3fn's 0x7f is NaN, e5m2's top exponent inf/NaN, as in torch.
template <int V>
BR_INLINE typename VT<V>::f vload_fp8(const c10::Float8_e4m3fn* p) {
  typedef typename VT<V>::u U32;
  typedef typename VT<V>::f F;
  const U32 u = widen_u8<V>(reinterpret_cast<const uint8_t*>(p));
  const U32 a = u & 0x7fu;
  const F sub = __builtin_convertvector(a, F) * (1.0f / 512.0f);
  U32 bits = (a >= 8u) ? (a << 20) + (120u << 23) : reinterpret_cast<const U32&>(sub);
  bits = (a == 0x7fu) ? U32{} + 0x7fc00000u : bits;
  bits |= (u & 0x80u) << 24;
  return reinterpret_cast<const F&>(bits);
}
template <int V>
BR_INLINE typename VT<V>::f vload_fp8(const c10::Float8_e5m2* p) {
  typedef typename VT<V>::u U32;
  typedef typename VT<V>::f F;
  const U32 u = widen_u8<V>(reinterpret_cast<const uint8_t*>(p));
  const U32 a = u & 0x7fu;
  const F sub = __builtin_convertvector(a, F) * (1.0f / 65536.0f);
  U32 bits = (a >= 4u) ? (a << 21) + (112u << 23) : reinterpret_cast<const U32&>(sub);
  bits = (a >= 0x7cu) ? (a << 21) | 0x7f800000u : bits;
  bits |= (u & 0x80u) << 24;
  return reinterpret_cast<const F&>(bits);
}

template <int V>
BR_INLINE typename VT<V>::f vload_t(const float* p) { return vload<V>(p); }
template <int V>
BR_INLINE typename VT<V>::f vload_t(const c10::BFloat16* p) { return vload_bf16<V>(p); }
template <int V>
BR_INLINE void vstore_t(float* p, typename VT<V>::f x) { vstore<V>(p, x); }
template <int V>
BR_INLINE void vstore_t(c10::BFloat16* p, typename VT<V>::f x) { vstore_bf16<V>(p, x); }

// exp(x) for any x: 0 below -87; a positive n is applied as 2^(n-1) * 2, so that the top binade is reached
// and past 88.72 the result overflows to inf as expf does (silu(-100) is then -0, as in torch)
template <int V>
BR_INLINE typename VT<V>::f vexp(typename VT<V>::f x) {
  typedef typename VT<V>::f F;
  typedef typename VT<V>::i I;
  const F lo = vsplat<V>(-87.0f), hi = vsplat<V>(89.0f);
  F xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  I n;
  const F p = vexp_parts<V>(xc, n);
  const I up = n > 0;          // -1 (all bits) where n > 0, else 0
  const F r = vscale2<V>(p, n + up) * (up ? vsplat<V>(2.0f) : vsplat<V>(1.0f));
  return x < lo ? F{} : r;
}

// $BATCHRUN_TEST_MAX_ISA ("avx2", "baseline"): the highest level any op of the library may use, so that the
// whole suite can run the paths of a machine without AVX-512 on one that has it; 2 (no cap) when unset
inline int64_t isa_cap_from_env() {
  const char* v = std::getenv("BATCHRUN_TEST_MAX_ISA");
  if (v == nullptr) return 2;
  if (std::strcmp(v, "avx2") == 0) return 1;
  if (std::strcmp(v, "baseline") == 0) return 0;
  return 2;
}

// 0: baseline, 1: AVX2 + FMA, 2: AVX-512 (capped by $BATCHRUN_TEST_MAX_ISA)
inline int64_t detect_isa() {
  int64_t level = 0;
#ifdef BR_X86_DISPATCH
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma"))
    level = 2;
  else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    level = 1;
#endif
  const int64_t cap = isa_cap_from_env();
  return level < cap ? level : cap;
}
// called by every op call (per layer, per step): the machine's answer, detected once
inline int64_t best_isa() {
  static const int64_t isa = detect_isa();
  return isa;
}

}  // namespace
