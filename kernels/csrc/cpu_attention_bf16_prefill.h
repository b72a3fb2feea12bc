// Prefill and chunked-prefill paged attention for bfloat16 q and caches on AVX-512 BF16 CPUs (included by
// cpu_attention.cpp after cpu_attention_bf16.h, whose helpers it uses). One work item: R > 8 query rows (a
// chunk of a sequence's query tokens x the query heads of one KV head) against a span of keys, 16 keys a tile.
//
// Both products run on VDPBF16PS (two bfloat16 products per float lane, twice the float FMA's work per
// instruction). Scores: the tile's K is transposed once into 32-bit pairs (as the decode path does in
// registers) and stored, then every block of 8 rows reads it, broadcasting q's pairs. p @ V: the tile's V rows
// are interleaved in key pairs once (store_pairs; pv_tile is shared with decode) and each row's
// probabilities, rounded to bfloat16 as torch's CPU flash attention and llama.cpp round them for this
// product, are broadcast a pair at a time. Scores, the softmax's max and sum and the accumulator stay in
// float. Row blocks whose queries all sit before the tile (the causal diagonal) skip it.
#pragma once

#ifdef BR_X86_DISPATCH
namespace {

// p rounded up to a 64-byte boundary (whole-vector scratch: a split vector store costs a second line)
inline __m512i* align64(void* p) {
  return reinterpret_cast<__m512i*>((reinterpret_cast<uintptr_t>(p) + 63) & ~static_cast<uintptr_t>(63));
}

// Rows [r0, r0 + NR) against the tile: scores, online softmax; p (bf16) into pb, the running max m, the
// per-lane sums ls [R][16] and this tile's rescale alpha. qb: the item's q rows [R][DT / 2] as bf16 pairs
// (one base address for the broadcasts); pos: each row's position.
template <int DT, int NR>
BR_BF16_ATTN BR_INLINE void prefill_scores(const uint32_t* qb, const int* pos, int r0, const __m512i* kt, int n,
                                           int k0, bool need_mask, int window, float scale, float* m, float* alpha,
                                           float* ls, uint16_t* pb) {
  const uint32_t* qp = qb + r0 * (DT / 2);
  __m512 s[NR];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) s[r] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int p = 0; p < DT / 2; ++p) {
    const __m512bh col = (__m512bh)_mm512_loadu_si512(kt + p);
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r)
      s[r] = _mm512_dpbf16_ps(s[r], col, (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[r * (DT / 2) + p])));
  }
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i kpos = _mm512_add_epi32(iota, _mm512_set1_epi32(k0));
  const __m512 ninf = _mm512_set1_ps(NEG_INF), vscale = _mm512_set1_ps(scale);
  alignas(64) float mold[16] = {};
  float ms[NR];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) {
    __m512 x = s[r];
    if (need_mask) {  // past the span, causal, window: -inf
      __mmask16 ok = _mm512_cmplt_epi32_mask(iota, _mm512_set1_epi32(n));
      ok &= _mm512_cmple_epi32_mask(kpos, _mm512_set1_epi32(pos[r0 + r]));
      ok &= _mm512_cmpgt_epi32_mask(kpos, _mm512_set1_epi32(pos[r0 + r] - window));
      x = _mm512_mask_mov_ps(ninf, ok, x);
    }
    s[r] = x;
    // the scale is positive, so the scaled scores' max is the scaled max
    const float mx = std::max(m[r0 + r], _mm512_reduce_max_ps(x) * scale);
    ms[r] = mx == NEG_INF ? 0.0f : mx;  // nothing visible yet: every weight is 0
    mold[r] = m[r0 + r] - ms[r];
    m[r0 + r] = mx;
  }
  alignas(64) float al[16];  // the rows' rescale factors, one vector exp for the block
  _mm512_store_ps(al, exp_for_bf16(_mm512_load_ps(mold)));
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) {
    const int rr = r0 + r;
    const __m512 pr = exp_for_bf16(_mm512_fmsub_ps(s[r], vscale, _mm512_set1_ps(ms[r])));
    float* l = ls + rr * 16;
    _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), _mm512_set1_ps(al[r]), pr));
    alpha[rr] = al[r];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + rr * 16), (__m256i)_mm512_cvtneps_pbh(pr));
  }
}

#define BR_ROWS_SWITCH(nr, CALL) \
  switch (nr) {                  \
    case 1: CALL(1); break;      \
    case 2: CALL(2); break;      \
    case 3: CALL(3); break;      \
    case 4: CALL(4); break;      \
    case 5: CALL(5); break;      \
    case 6: CALL(6); break;      \
    case 7: CALL(7); break;      \
    default: CALL(8); break;     \
  }

// One work item of R > 8 rows, head_dim DT in {64, 128}. ws: scratch_floats(R, DT) floats, of which this uses
// R (DT + 16 + 2 + 8 + DT / 2 + 1) + 16 DT + 16 (acc, ls, m and alpha, pb, qb, pos; kt and vpair, aligned)
template <int DT>
BR_BF16_ATTN __attribute__((noinline)) void prefill_item_bf16(const Params& P, const Item& it, float* ws) {
  constexpr int NB = DT / 32, NVC = DT / 16;
  const Group& g = P.groups[it.group];
  const int G = P.G, b = g.b, h = g.h, R = (g.t1 - g.t0) * G;
  const int qbeg = P.qsl[b], qlen = P.qsl[b + 1] - qbeg, ctx = P.lens[b];
  const int pos0 = ctx - qlen + g.t0, min_pos = pos0, max_pos = pos0 + g.t1 - g.t0 - 1;
  const uint16_t* q = static_cast<const uint16_t*>(P.q) + static_cast<int64_t>(qbeg) * P.qs0;

  float* acc = ws;                                                  // [R][DT], unpack_pair's order until the end
  float* ls = acc + R * DT;                                         // [R][16] per-lane running sums
  float* m = ls + R * 16;                                           // [R]
  float* alpha = m + R;                                             // [R]
  __m512i* kt = align64(alpha + R);                                 // [DT / 2] K pairs, keys across lanes
  __m512i* vpair = kt + DT / 2;                                     // [8][NVC] V rows interleaved in key pairs
  uint16_t* pb = reinterpret_cast<uint16_t*>(vpair + 8 * NVC);      // [R][16] the tile's p as bf16
  uint32_t* qb = reinterpret_cast<uint32_t*>(pb + R * 16);           // [R][DT / 2] q's rows as bf16 pairs
  int* pos = reinterpret_cast<int*>(qb + R * (DT / 2));              // [R] each row's position
  for (int r = 0; r < R; ++r) {
    const int64_t row = static_cast<int64_t>(g.t0 + r / G) * P.qs0 + static_cast<int64_t>(h * G + r % G) * P.qs1;
    std::memcpy(qb + r * (DT / 2), q + row, DT * 2);
    pos[r] = pos0 + r / G;
  }
  std::fill(acc, acc + R * DT, 0.0f);
  std::fill(ls, ls + R * 16, 0.0f);
  std::fill(m, m + R, NEG_INF);

  const int window = P.window;
  const KvRows<DT> rows_of(P, b, h, ring_of(ws, R, DT));
  const uint16_t* kp[2][16];
  const uint16_t* vp[2][16];
  if (it.k0 < it.k1) rows_of.locate(it.k0, std::min(16, it.k1 - it.k0), kp[0], vp[0], 0);
  int cur = 0;
  for (int k0 = it.k0; k0 < it.k1; k0 += 16, cur ^= 1) {
    const int n = std::min(16, it.k1 - k0);
    const int nn = k0 + 16 < it.k1 ? std::min(16, it.k1 - k0 - 16) : 0;
    if (nn > 0) {  // the next tile's rows, into L2 while this one computes
      rows_of.locate(k0 + 16, nn, kp[cur ^ 1], vp[cur ^ 1], cur ^ 1, std::max(0, std::min(16, it.k1 - k0 - 32)));
      for (int j = 0; j < (rows_of.convert ? 0 : nn); ++j)   // converted rows are in the ring already
        for (int c = 0; c < DT * 2; c += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(kp[cur ^ 1][j]) + c, 0, 1);
          __builtin_prefetch(reinterpret_cast<const char*>(vp[cur ^ 1][j]) + c, 0, 1);
        }
    }
    // K transposed into pairs, V interleaved in key pairs (rows past n are kZeroRow)
#pragma GCC unroll 4
    for (int blk = 0; blk < NB; ++blk) {
      __m512i rows[16], cols[16];
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) rows[j] = _mm512_loadu_si512(kp[cur][j] + blk * 32);
      transpose16(rows, cols);
#pragma GCC unroll 16
      for (int p = 0; p < 16; ++p) _mm512_storeu_si512(kt + blk * 16 + p, cols[p]);
    }
    store_pairs<DT>(vp[cur], vpair);

    const bool need_mask = n < 16 || k0 + n - 1 > min_pos || k0 <= max_pos - window;
    for (int r0 = 0; r0 < R; r0 += 8) {
      const int nr = std::min(8, R - r0);
      if (pos[r0 + nr - 1] < k0) continue;  // these rows' queries all sit before the tile
#define BR_SCORES(NR) \
  prefill_scores<DT, NR>(qb, pos, r0, kt, n, k0, need_mask, window, P.scale, m, alpha, ls, pb)
      BR_ROWS_SWITCH(nr, BR_SCORES)
#undef BR_SCORES
    }
    for (int r0 = 0; r0 < R; r0 += 4) {
      const int nr = std::min(4, R - r0);
      if (pos[r0 + nr - 1] < k0) continue;
      for (int c0 = 0; c0 < NVC; c0 += 4) {
#define BR_PV(NR) pv_tile<DT, NR>(acc, r0, c0, alpha, pb, StoredPairs{vpair, NVC})
        BR_ROWS_SWITCH(nr, BR_PV)
#undef BR_PV
      }
    }
  }

  unpermute_acc(acc, R, DT);
  if (it.slot < 0) {
    c10::BFloat16* out = static_cast<c10::BFloat16*>(P.out);
    for (int r = 0; r < R; ++r) {
      const int t = g.t0 + r / G, hq = h * G + r % G;
      c10::BFloat16* op = out + static_cast<int64_t>(qbeg + t) * P.os0 + static_cast<int64_t>(hq) * P.os1;
      const float l = _mm512_reduce_add_ps(_mm512_loadu_ps(ls + r * 16));
      store_row(acc + r * DT, l > 0.0f ? P.v_scale / l : 0.0f, op, DT);
    }
  } else {
    float* st = P.part_stats + static_cast<int64_t>(it.slot) * P.max_rows * 2;
    float* pa = P.part_acc + static_cast<int64_t>(it.slot) * P.max_rows * DT;
    for (int r = 0; r < R; ++r) {
      st[2 * r] = m[r];
      st[2 * r + 1] = _mm512_reduce_add_ps(_mm512_loadu_ps(ls + r * 16));
      std::memcpy(pa + static_cast<int64_t>(r) * DT, acc + r * DT, sizeof(float) * DT);
    }
  }
}
#undef BR_ROWS_SWITCH

// The item on this path when it has more than 8 query rows (true), else false.
template <int DT>
bool prefill_bf16(const Params& P, const Item& it, float* ws) {
  const Group& g = P.groups[it.group];
  if ((g.t1 - g.t0) * P.G <= 8) return false;
  prefill_item_bf16<DT>(P, it, ws);
  return true;
}

}  // namespace

#else
namespace {
template <int DT>
bool prefill_bf16(const Params&, const Item&, float*) { return false; }
}  // namespace
#endif
