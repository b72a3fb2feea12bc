// W8A8's quantizing pass over the activations, on AVX-512 (included by cpu_w8a8.cpp inside its anonymous
// namespace, after BR_VNNI_TARGET): each group of a row scaled by its absmax / 127 and rounded to codes + 128,
// after the SmoothQuant multiply and, with rotate, a Hadamard rotation per block of 64 columns
// (models/w8a8.py quantize_rows and rotate_blocks: the same floats in the same order, so the same codes).
#pragma once

BR_VNNI_TARGET inline __m512 load16(const void* p, bool bf16, __mmask16 m) {
  if (!bf16) return _mm512_maskz_loadu_ps(m, p);
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// A butterfly stage within a vector: lanes whose stage bit is set take partner - self (low - high), the others
// self + partner, as models/w8a8.py rotate_blocks computes a + b and a - b.
BR_VNNI_TARGET inline __m512 butterfly(__m512 x, __m512 partner, __mmask16 high) {
  return _mm512_mask_sub_ps(_mm512_add_ps(x, partner), high, partner, x);
}

// v [64] (four vectors, element 16 i + lane) times the normalized 64 x 64 Hadamard matrix: spans 1, 2, 4, 8
// inside each vector, then 16 and 32 across them, then the exact 1/8 (rotate_blocks' order and roundings).
BR_VNNI_TARGET inline void hadamard64(__m512 (&v)[4]) {
  for (int i = 0; i < 4; ++i) {
    __m512 x = v[i];
    x = butterfly(x, _mm512_permute_ps(x, 0xB1), 0xAAAA);            // span 1: neighbours
    x = butterfly(x, _mm512_permute_ps(x, 0x4E), 0xCCCC);            // span 2
    x = butterfly(x, _mm512_shuffle_f32x4(x, x, 0xB1), 0xF0F0);      // span 4: 128-bit lanes 0<->1, 2<->3
    v[i] = butterfly(x, _mm512_shuffle_f32x4(x, x, 0x4E), 0xFF00);   // span 8: 0<->2, 1<->3
  }
  const __m512 a0 = _mm512_add_ps(v[0], v[1]), a1 = _mm512_sub_ps(v[0], v[1]);   // span 16
  const __m512 a2 = _mm512_add_ps(v[2], v[3]), a3 = _mm512_sub_ps(v[2], v[3]);
  const __m512 eighth = _mm512_set1_ps(0.125f);
  v[0] = _mm512_mul_ps(_mm512_add_ps(a0, a2), eighth);                            // span 32
  v[1] = _mm512_mul_ps(_mm512_add_ps(a1, a3), eighth);
  v[2] = _mm512_mul_ps(_mm512_sub_ps(a0, a2), eighth);
  v[3] = _mm512_mul_ps(_mm512_sub_ps(a1, a3), eighth);
}

// a row's groups of G columns into codes + 128 and their scales
BR_VNNI_TARGET void quantize_row(const char* row, bool bf16, const float* inv, int64_t K, int64_t G, uint8_t* u8,
                                 float* sx) {
  const int64_t esz = bf16 ? 2 : 4, ng = K / G;
  for (int64_t g = 0; g < ng; ++g) {
    const int64_t c0 = g * G, c1 = c0 + G;
    __m512 amax = _mm512_setzero_ps();   // |v| by clearing the sign: one max and one reduction per group
    for (int64_t k = c0; k < c1; k += 16) {
      const __mmask16 m = c1 - k >= 16 ? 0xFFFF : (__mmask16)((1u << (c1 - k)) - 1);
      __m512 v = load16(row + k * esz, bf16, m);
      if (inv) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, inv + k));
      amax = _mm512_max_ps(amax, _mm512_abs_ps(v));   // masked-off lanes load as 0
    }
    float s = _mm512_reduce_max_ps(amax) / 127.0f;
    s = std::max(s, 1e-30f);
    sx[g] = s;
    const __m512 sv = _mm512_set1_ps(s);
    const __m512i shift = _mm512_set1_epi32(128);
    for (int64_t k = c0; k < c1; k += 16) {
      const __mmask16 m = c1 - k >= 16 ? 0xFFFF : (__mmask16)((1u << (c1 - k)) - 1);
      __m512 v = load16(row + k * esz, bf16, m);
      if (inv) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, inv + k));
      const __m512 q = _mm512_roundscale_ps(_mm512_div_ps(v, sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512i c = _mm512_add_epi32(_mm512_cvtps_epi32(q), shift);
      _mm_mask_storeu_epi8(u8 + k, m, _mm512_cvtepi32_epi8(c));
    }
  }
}

// rows [r0, r1) of x; with rotate (K a multiple of 64) each row's x * inv is rotated per block of 64 into a
// float32 row first, which is then quantized as it stands
BR_VNNI_TARGET void quantize_rows(const void* x, int64_t xs, bool bf16, const float* inv, int64_t K, int64_t G,
                                  bool rotate, uint8_t* u8, float* sx, int64_t r0, int64_t r1) {
  const int64_t esz = bf16 ? 2 : 4, ng = K / G;
  std::vector<float> buf(rotate ? K : 0);
  for (int64_t r = r0; r < r1; ++r) {
    const char* row = static_cast<const char*>(x) + r * xs * esz;
    if (!rotate) {
      quantize_row(row, bf16, inv, K, G, u8 + r * K, sx + r * ng);
      continue;
    }
    for (int64_t k0 = 0; k0 < K; k0 += 64) {
      __m512 v[4];
      for (int i = 0; i < 4; ++i) {
        v[i] = load16(row + (k0 + 16 * i) * esz, bf16, 0xFFFF);
        if (inv) v[i] = _mm512_mul_ps(v[i], _mm512_loadu_ps(inv + k0 + 16 * i));
      }
      hadamard64(v);
      for (int i = 0; i < 4; ++i) _mm512_storeu_ps(buf.data() + k0 + 16 * i, v[i]);
    }
    quantize_row(reinterpret_cast<const char*>(buf.data()), false, nullptr, K, G, u8 + r * K, sx + r * ng);
  }
}

