// Writing a step's new K/V rows into the paged caches on CPU (batchrun.kernels.cpu_attention builds it into one
// library with the attention op, whose reader of these rows is cpu_attention.cpp).
//
// batchrun_cpu::store_kv(k, v [T, Hkv, D], k_cache, v_cache, slot_mapping [T] int64, k_scale, v_scale): row t
// goes to slot slot_mapping[t] (block * bs + offset; negative: padding, skipped). The caches hold k's dtype (a
// copy), float8 (x * (1 / scale), the reciprocal rounded to float, saturated to the format's largest finite
// value, rounded to nearest even) or int8 rows [N, bs, Hkv, D + 2 * ceil(D / 32)] of codes and float16 group
// scales, each bit for bit as kernels/kv_quant.py's references write them.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "vec.h"
#include "ops.h"

#ifdef BR_X86_DISPATCH
#include <immintrin.h>
#endif

namespace {

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

// one row of D values as float8: x * inv (float), saturated to +-max (NaN stays NaN), rounded to nearest even
template <typename S, typename F8>
void quantize_row(const S* BR_RESTRICT src, F8* BR_RESTRICT dst, int64_t D, float inv) {
  const float mx = static_cast<float>(std::numeric_limits<F8>::max());
  for (int64_t d = 0; d < D; ++d) {
    const float x = to_f(src[d]) * inv;
    dst[d] = F8(x > mx ? mx : x < -mx ? -mx : x);
  }
}
// one row of D values as an int8 cache row: per group of 32, s = float16(min(max|x| / 127, 65504)), codes
// nearbyint(x * (1 / float(s))) clamped to +-127 (0 where s is 0), then the scales (kernels/kv_quant.py)
template <typename S>
void quantize_row(const S* BR_RESTRICT src, int8_t* BR_RESTRICT dst, int64_t D) {
  char* sp = reinterpret_cast<char*>(dst + D);
  for (int64_t g0 = 0; g0 < D; g0 += I8_GROUP, sp += 2) {
    const int64_t g1 = std::min<int64_t>(D, g0 + I8_GROUP);
    float amax = 0.0f;
    for (int64_t d = g0; d < g1; ++d) amax = std::max(amax, std::fabs(to_f(src[d])));
    const c10::Half h(std::min(amax / 127.0f, 65504.0f));
    const float sf = to_f(h), inv = sf > 0.0f ? 1.0f / sf : 0.0f;
    for (int64_t d = g0; d < g1; ++d)
      dst[d] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, std::nearbyint(to_f(src[d]) * inv))));
    std::memcpy(sp, &h, 2);
  }
}
#ifdef BR_X86_DISPATCH
// quantize_row's int8 form, 32 values at a time with AVX-512 (the same bytes: max, the float16 scale, then
// i8_codes); a head_dim that is not a multiple of 32 takes the scalar loop
#define BR_I8_STORE __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
template <typename S>
BR_I8_STORE BR_INLINE __m512 load16_f(const S* p) {
  if constexpr (std::is_same_v<S, float>) return _mm512_loadu_ps(p);
  else if constexpr (std::is_same_v<S, c10::Half>) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  else return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
// 16 codes: x * inv clamped to +-127 (in float, so an infinity saturates as the scalar loop does), rounded by
// VCVTPS2DQ (MXCSR's mode: to nearest even)
BR_I8_STORE BR_INLINE __m128i i8_codes(__m512 x, __m512 inv) {
  const __m512 y = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(x, inv), _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
  return _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(y));
}
template <typename S>
BR_I8_STORE void quantize_row_i8_avx512(const S* BR_RESTRICT src, int8_t* BR_RESTRICT dst, int64_t D) {
  if (D % I8_GROUP != 0) return quantize_row(src, dst, D);
  char* sp = reinterpret_cast<char*>(dst + D);
  for (int64_t g0 = 0; g0 < D; g0 += I8_GROUP, sp += 2) {
    const __m512 a = load16_f(src + g0), b = load16_f(src + g0 + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const c10::Half h(std::min(amax / 127.0f, 65504.0f));
    const float sf = to_f(h), inv = sf > 0.0f ? 1.0f / sf : 0.0f;
    const __m512 vi = _mm512_set1_ps(inv);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + g0), i8_codes(a, vi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + g0 + 16), i8_codes(b, vi));
    std::memcpy(sp, &h, 2);
  }
}
#endif
// an int8 cache row by the widest code this CPU runs
template <typename S>
void quantize_row_i8(const S* BR_RESTRICT src, int8_t* BR_RESTRICT dst, int64_t D) {
#ifdef BR_X86_DISPATCH
  if (best_isa() >= 2) return quantize_row_i8_avx512(src, dst, D);
#endif
  quantize_row(src, dst, D);
}

template <typename C>
void quantize_row_any(ScalarType st, const char* src, char* dst, int64_t D, float inv) {
  C* out = reinterpret_cast<C*>(dst);
  if (st == ScalarType::Float) quantize_row(reinterpret_cast<const float*>(src), out, D, inv);
  else if (st == ScalarType::BFloat16) quantize_row(reinterpret_cast<const c10::BFloat16*>(src), out, D, inv);
  else quantize_row(reinterpret_cast<const c10::Half*>(src), out, D, inv);
}

void quantize_row_i8_any(ScalarType st, const char* src, char* dst, int64_t D) {
  int8_t* out = reinterpret_cast<int8_t*>(dst);
  if (st == ScalarType::Float) quantize_row_i8(reinterpret_cast<const float*>(src), out, D);
  else if (st == ScalarType::BFloat16) quantize_row_i8(reinterpret_cast<const c10::BFloat16*>(src), out, D);
  else quantize_row_i8(reinterpret_cast<const c10::Half*>(src), out, D);
}

// k, v [T, Hkv, D] (a view of the qkv projection is fine) into the caches [N, bs, Hkv, D] at slot_mapping [T]
// int64 (block * bs + offset); a negative slot is padding and skipped. One call stores both. Float8 caches
// take k / k_scale and v / v_scale (see the top of this file), int8 ones codes and group scales ([N, bs, Hkv,
// D + 2 * ceil(D / 32)]); others a copy (the scales must be 1 unless the caches are float8).
void store_kv(Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, Tensor slot_mapping, double k_scale,
              double v_scale) {
  STD_TORCH_CHECK(k.is_cpu() && v.is_cpu() && k_cache.is_cpu() && v_cache.is_cpu() && slot_mapping.is_cpu(),
                  "store_kv: CPU tensors only");
  STD_TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
                  "store_kv: k, v must be [T, Hkv, D] and the caches [N, bs, Hkv, D]");
  const ScalarType st = k.scalar_type(), cst = k_cache.scalar_type();
  const bool e4m3 = cst == ScalarType::Float8_e4m3fn, fp8 = e4m3 || cst == ScalarType::Float8_e5m2;
  const bool i8 = cst == ScalarType::Char;
  STD_TORCH_CHECK(v.scalar_type() == st && v_cache.scalar_type() == cst && (cst == st || fp8 || i8),
                  "store_kv: k and v must share a dtype, and the caches that dtype, float8_e4m3fn / float8_e5m2 "
                  "or int8");
  STD_TORCH_CHECK(st == ScalarType::Float || st == ScalarType::BFloat16 || st == ScalarType::Half || !(fp8 || i8),
                  "store_kv: float8 and int8 caches take float32, bfloat16 or float16 k and v");
  STD_TORCH_CHECK(std::isfinite(k_scale) && k_scale > 0 && std::isfinite(v_scale) && v_scale > 0 &&
                      (fp8 || (k_scale == 1.0 && v_scale == 1.0)),
                  "store_kv: k_scale and v_scale must be positive, and 1 unless the caches are float8");
  const int64_t T = k.size(0), H = k.size(1), D = k.size(2);
  for (int i = 0; i < 3; ++i)
    STD_TORCH_CHECK(v.size(i) == k.size(i), "store_kv: k and v shapes differ");
  for (int i = 0; i < 4; ++i)
    STD_TORCH_CHECK(v_cache.size(i) == k_cache.size(i), "store_kv: k_cache and v_cache shapes differ");
  STD_TORCH_CHECK(k_cache.size(2) == H && k_cache.size(3) == (i8 ? i8_row(D) : D),
                  "store_kv: k, v heads/head_dim differ from the cache");
  STD_TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
                  "store_kv: the head dimension must be contiguous");
  STD_TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == T && slot_mapping.is_contiguous() &&
                      slot_mapping.scalar_type() == ScalarType::Long,
                  "store_kv: slot_mapping must be a contiguous [T] int64 tensor");
  if (T == 0) return;
  const int64_t bs = k_cache.size(1), nslots = k_cache.size(0) * bs;
  const int64_t* slots = static_cast<const int64_t*>(slot_mapping.data_ptr());
  for (int64_t t = 0; t < T; ++t)
    STD_TORCH_CHECK(slots[t] < nslots, "store_kv: slot_mapping[", t, "] = ", slots[t], " is past the cache (",
                    nslots, " slots)");
  const size_t esz = k.element_size(), cesz = k_cache.element_size();
  const float kinv = static_cast<float>(1.0 / k_scale), vinv = static_cast<float>(1.0 / v_scale);
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  const int64_t kc0 = k_cache.stride(0), kc1 = k_cache.stride(1), kc2 = k_cache.stride(2);
  const int64_t vc0 = v_cache.stride(0), vc1 = v_cache.stride(1), vc2 = v_cache.stride(2);
  auto body = [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      const int64_t blk = slot / bs, off = slot % bs;
      for (int64_t h = 0; h < H; ++h) {
        char* kd = kc + (blk * kc0 + off * kc1 + h * kc2) * cesz;
        char* vd = vc + (blk * vc0 + off * vc1 + h * vc2) * cesz;
        const char* ks = kp + (t * ks0 + h * ks1) * esz;
        const char* vs = vp + (t * vs0 + h * vs1) * esz;
        if (i8) {
          quantize_row_i8_any(st, ks, kd, D);
          quantize_row_i8_any(st, vs, vd, D);
        } else if (!fp8) {
          std::memcpy(kd, ks, D * esz);
          std::memcpy(vd, vs, D * esz);
        } else if (e4m3) {
          quantize_row_any<c10::Float8_e4m3fn>(st, ks, kd, D, kinv);
          quantize_row_any<c10::Float8_e4m3fn>(st, vs, vd, D, vinv);
        } else {
          quantize_row_any<c10::Float8_e5m2>(st, ks, kd, D, kinv);
          quantize_row_any<c10::Float8_e5m2>(st, vs, vd, D, vinv);
        }
      }
    }
  };
  if (T * H * D * static_cast<int64_t>(esz) < (1 << 18)) body(0, T);  // small: threads cost more than they save
  else torch::stable::parallel_for(0, T, 64, body);
}

}  // namespace

namespace brcpu {  // for ops composed of these (ops.h)
void store_kv(Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, Tensor slot_mapping, double k_scale,
              double v_scale) {
  ::store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale);
}
}  // namespace brcpu

STABLE_TORCH_LIBRARY_FRAGMENT(batchrun_cpu, m) {
  m.def("store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "float k_scale=1.0, float v_scale=1.0) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(batchrun_cpu, CPU, m) { m.impl("store_kv", TORCH_BOX(&store_kv)); }
