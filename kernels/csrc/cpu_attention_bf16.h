// Decode and short-query paged attention for bfloat16 q and caches on AVX-512 BF16 CPUs (included by
// cpu_attention.cpp, whose Params/Group/Item it reads). One work item: up to 8 query rows (a sequence's query
// tokens x the query heads of one KV head) against a span of keys, 16 keys per tile.
//
// Scores: the tile's K rows are transposed in registers as 32-bit bfloat16 pairs (16 x 16 blocks), so that
// each vector holds one pair of all 16 keys; VDPBF16PS then adds q's pair (broadcast) times it into 16 float
// lanes, one key per lane: one instruction per pair and row, no horizontal sums (products of two bfloat16
// are exact in float, as in the reference's float einsum). The softmax runs on those 16 lanes (one vector
// exp per row and tile, the rows' rescale factors in one more; the running sum kept per lane, added up once
// at the end). p @ V runs on VDPBF16PS too: V's rows interleaved in key pairs by two 16-bit unpacks per 32
// dims, p rounded to bfloat16 for this product as torch's CPU flash attention and llama.cpp round it; the
// accumulator stays in float. The generic loops of cpu_attention.cpp spent ~0.5 us per 16-key tile at 4
// query rows (Zen 4) converting tiles into scratch and summing lanes.
//
// Quantized caches (float8, int8) take these paths too: KvRows<KT> converts each tile's K and V rows to
// bfloat16 into a two-tile ring as it locates them (a tile ahead), and the kernels read the ring. Float8
// codes are bfloat16 values exactly (k_scale and v_scale are folded in as on the generic path); an int8
// code times its group's float16 scale is rounded to bfloat16 (2^-9 relative: below the int8 step, 2^-8 of
// the group's largest value).
#pragma once

#ifdef BR_X86_DISPATCH
#include <immintrin.h>

#define BR_BF16_ATTN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

namespace {


inline bool cpu_has_avx512_bf16() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return best_isa() == 2 && __builtin_cpu_supports("avx512bf16");
  }();
  return yes;
}

alignas(64) const uint16_t kZeroRow[128] = {};  // the rows of a short tile past its last key (D <= 128)

// How far ahead a decode item prefetches a bfloat16 cache's rows: 1 tile (the next one, as the kernel reads
// the current one), or 2 (locate also prefetches the tile after the next). A tile's arithmetic takes about as
// long as DRAM takes to answer under load, so one tile ahead leaves the loads waiting. scripts/bench_kv_reads.py
// (engine-shaped caches, 4 KiB pages, Zen 4): two tiles 0.87-0.91x the time at 64 sequences x 300 keys of
// SmolLM2's heads, 0.89-0.94x at 4 x 1,000 keys of 32/8 heads of 128, 0.98-1.05x at 64 x 150 (8/2 heads),
// and 1.05-1.08x at one sequence of 2,000 keys (the prefetches' own cost where one sequential stream is all
// there is). Set by set_kv_prefetch (the bench).
std::atomic<int64_t> kv_prefetch_tiles{2};

// DT values of a quantized cache row as bfloat16 (see the top of this file)
template <int DT>
BR_BF16_ATTN BR_INLINE void row_to_bf16(const int8_t* src, uint16_t* dst) {
  const char* sp = reinterpret_cast<const char*>(src + DT);  // the groups' float16 scales follow the codes
#pragma GCC unroll 4
  for (int g0 = 0; g0 < DT; g0 += I8_GROUP, sp += 2) {
    c10::Half hs;
    std::memcpy(&hs, sp, 2);
    const __m512 s = _mm512_set1_ps(to_f(hs));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + g0))));
    const __m512 hi = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + g0 + 16))));
    _mm512_storeu_si512(dst + g0, (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, s), _mm512_mul_ps(lo, s)));
  }
}
// the bfloat16 bits of each float8 code's magnitude (codes 0 .. 127): exact, float8 values are bf16 values
template <typename F8>
const uint16_t* fp8_bf16_table() {
  alignas(64) static const struct T {
    uint16_t v[128];
    T() {
      for (int c = 0; c < 128; ++c) {
        F8 x;
        std::memcpy(&x, &c, 1);  // little-endian: the code's byte
        const float f = to_f(x);
        uint32_t u;
        std::memcpy(&u, &f, 4);
        v[c] = static_cast<uint16_t>(u >> 16);
      }
    }
  } table;
  return table.v;
}
// 32 codes at a time: a 128-entry word lookup (two 64-entry VPERMT2W, picked by bit 6), the sign put back
template <int DT, typename F8>
BR_BF16_ATTN BR_INLINE void row_to_bf16(const F8* src, uint16_t* dst) {
  const uint16_t* tab = fp8_bf16_table<F8>();
  const __m512i t0 = _mm512_load_si512(tab), t1 = _mm512_load_si512(tab + 32);
  const __m512i t2 = _mm512_load_si512(tab + 64), t3 = _mm512_load_si512(tab + 96);
#pragma GCC unroll 4
  for (int d = 0; d < DT; d += 32) {
    const __m512i c = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d)));
    const __m512i lo = _mm512_permutex2var_epi16(t0, c, t1), hi = _mm512_permutex2var_epi16(t2, c, t3);
    const __m512i mag = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(c, _mm512_set1_epi16(0x40)), lo, hi);
    const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(c, _mm512_set1_epi16(0x80)), 8);
    _mm512_storeu_si512(dst + d, _mm512_or_si512(mag, sign));
  }
}

// Floats of scratch a quantized cache's ring takes (2 tiles x K, V x 16 rows x DT bfloat16), and where it
// starts in an item's scratch ws: past what scratch_floats reserves for the rest (see scratch_floats)
constexpr int ring_floats(int DT) { return 2 * 2 * 16 * DT / 2; }
inline uint16_t* ring_of(float* ws, int rows, int DT) {
  const uintptr_t p = reinterpret_cast<uintptr_t>(ws + scratch_floats(rows, DT) - ring_floats(DT) - 16);
  return reinterpret_cast<uint16_t*>((p + 63) & ~uintptr_t(63));
}

// Where one sequence's K and V rows of one KV head lie: locate() fills the row pointers of keys [k0, k0 + n)
// of a 16-key tile, kZeroRow past n (block ids were checked against the cache before the parallel region).
// A quantized cache (P.kv: float8 or int8, a run-time choice per tile, so these paths are compiled once per
// head_dim) has its rows converted into ring slot `slot`, the pointers aimed there, and the raw rows of the
// `after` keys of the tile after this one prefetched here (for a bf16 cache the kernels prefetch the next
// tile's rows themselves; converted rows are in the ring, just written).
template <int DT>
struct KvRows {
  const int32_t* table;
  int bs;
  const char* k;  // the caches, offset to the head
  const char* v;
  int64_t ks0, ks1, vs0, vs1;  // byte strides
  uint16_t* ring;  // [2][2][16][DT] when converting
  KvType kind;     // KV_SAME: bfloat16
  int raw_bytes;   // one row's bytes in the cache
  bool convert;
  bool far;        // locate prefetches the tile after the next one (a quantized cache always does)
  bool straddles;  // a row may straddle cache lines
  KvRows(const Params& P, int b, int h, uint16_t* ring_, bool far_ = false)
      : table(P.bt + static_cast<int64_t>(b) * P.bts0), bs(P.bs), ring(ring_), kind(P.kv),
        raw_bytes(P.kv == KV_I8 ? static_cast<int>(i8_row(DT)) : P.kv == KV_SAME ? 2 * DT : DT),
        convert(P.kv != KV_SAME) {
    const int64_t esz = P.kv == KV_SAME ? 2 : 1;
    k = static_cast<const char*>(P.k) + static_cast<int64_t>(h) * P.ks2 * esz;
    v = static_cast<const char*>(P.v) + static_cast<int64_t>(h) * P.vs2 * esz;
    ks0 = P.ks0 * esz, ks1 = P.ks1 * esz, vs0 = P.vs0 * esz, vs1 = P.vs1 * esz;
    far = convert || far_;
    const auto line = [](int64_t x) { return x % 64 == 0; };
    straddles = !(line(raw_bytes) && line(reinterpret_cast<uintptr_t>(k)) && line(reinterpret_cast<uintptr_t>(v)) &&
                  line(ks0) && line(ks1) && line(vs0) && line(vs1));
  }
  BR_BF16_ATTN BR_INLINE void to_bf16(const char* src, uint16_t* dst) const {
    if (kind == KV_I8) row_to_bf16<DT>(reinterpret_cast<const int8_t*>(src), dst);
    else if (kind == KV_E4M3) row_to_bf16<DT>(reinterpret_cast<const c10::Float8_e4m3fn*>(src), dst);
    else row_to_bf16<DT>(reinterpret_cast<const c10::Float8_e5m2*>(src), dst);
  }
  BR_BF16_ATTN BR_INLINE void locate(int k0, int n, const uint16_t** kr, const uint16_t** vr, int slot,
                                     int after = 0) const {
    int bi = k0 / bs, off = k0 - bi * bs;
    int64_t blk = table[bi];
    if (far) {
      int pbi = (k0 + 16) / bs, poff = k0 + 16 - pbi * bs;
      for (int j = 0; j < after; ++j, ++poff) {
        if (poff == bs) {
          ++pbi;
          poff = 0;
        }
        const int64_t pblk = table[pbi];
        const char* kq = k + pblk * ks0 + poff * ks1;
        const char* vq = v + pblk * vs0 + poff * vs1;
        for (int c = 0; c < raw_bytes; c += 64) {
          __builtin_prefetch(kq + c, 0, 1);
          __builtin_prefetch(vq + c, 0, 1);
        }
        if (straddles) {
          __builtin_prefetch(kq + raw_bytes - 1, 0, 1);  // a row may straddle a line
          __builtin_prefetch(vq + raw_bytes - 1, 0, 1);
        }
      }
    }
    for (int j = 0; j < 16; ++j, ++off) {
      if (j >= n) {
        kr[j] = vr[j] = kZeroRow;
        continue;
      }
      if (off == bs) {
        blk = table[++bi];
        off = 0;
      }
      const char* kq = k + blk * ks0 + off * ks1;
      const char* vq = v + blk * vs0 + off * vs1;
      if (convert) {
        uint16_t* kd = ring + ((slot * 2) * 16 + j) * DT;
        uint16_t* vd = kd + 16 * DT;
        to_bf16(kq, kd);
        to_bf16(vq, vd);
        kr[j] = kd;
        vr[j] = vd;
      } else {
        kr[j] = reinterpret_cast<const uint16_t*>(kq);
        vr[j] = reinterpret_cast<const uint16_t*>(vq);
      }
    }
  }
};

// in[j] lane l -> out[l] lane j, 32-bit elements
BR_BF16_ATTN BR_INLINE void transpose16(const __m512i* in, __m512i* out) {
  __m512i t[16], u[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(in[i], in[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(in[i], in[i + 1]);
  }
#pragma GCC unroll 16
  for (int g = 0; g < 16; g += 4) {  // u[g + c], 128-bit lane L: column 4L + c of rows g .. g + 3
    u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    const __m512i v = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), w = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
    const __m512i w2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
    out[c] = _mm512_shuffle_i32x4(v, v2, 0x88);
    out[4 + c] = _mm512_shuffle_i32x4(w, w2, 0x88);
    out[8 + c] = _mm512_shuffle_i32x4(v, v2, 0xdd);
    out[12 + c] = _mm512_shuffle_i32x4(w, w2, 0xdd);
  }
}

// exp(x) for x <= 0 (-inf included: 0) to ~4e-5 relative, enough for p that is rounded to bfloat16 (2^-9)
// next: 2^(x log2 e) = 2^n 2^f, |f| <= 1/2, 2^f by its degree-4 Taylor polynomial; exp(0) is exactly 1
BR_BF16_ATTN BR_INLINE __m512 exp_for_bf16(__m512 x) {
  const __m512 y = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-110.0f)), _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_set1_ps(9.6181291076284772e-03f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910072e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);  // 2^n below -149: 0
}

// Pair j of the tile's V rows (keys 2j, 2j + 1) interleaved for VDPBF16PS, dims [16 c0, 16 c0 + 64): 16-bit
// unpacks, so v[0] (v[1]) holds dims 16 c0 + {0-3, 8-11, 16-19, 24-27} ({4-7, ...}) of both rows and v[2], v[3]
// the next 32 likewise: accumulators built on them are permuted so until unpermute_acc.
BR_BF16_ATTN BR_INLINE void unpack_pair(const uint16_t* const* vrow, int j, int c0, __m512i* v) {
  const __m512i x0 = _mm512_loadu_si512(vrow[2 * j] + c0 * 16), y0 = _mm512_loadu_si512(vrow[2 * j + 1] + c0 * 16);
  const __m512i x1 = _mm512_loadu_si512(vrow[2 * j] + c0 * 16 + 32);
  const __m512i y1 = _mm512_loadu_si512(vrow[2 * j + 1] + c0 * 16 + 32);
  v[0] = _mm512_unpacklo_epi16(x0, y0);
  v[1] = _mm512_unpackhi_epi16(x0, y0);
  v[2] = _mm512_unpacklo_epi16(x1, y1);
  v[3] = _mm512_unpackhi_epi16(x1, y1);
}

// pv_tile's source of V pairs when few rows use them (decode): unpacked from the rows as they are used, the
// next tile's rows prefetched along the way (nn of them; 0: none)
struct PairsFromRows {
  const uint16_t* const* vrow;
  const uint16_t* const* vnext;
  int nn, row_bytes;
  BR_BF16_ATTN BR_INLINE void operator()(int j, int c0, __m512i* v) const {
    if (c0 == 0)
      for (int i = 2 * j; i < 2 * j + 2 && i < nn; ++i)
        for (int b = 0; b < row_bytes; b += 64) __builtin_prefetch(reinterpret_cast<const char*>(vnext[i]) + b, 0, 1);
    unpack_pair(vrow, j, c0, v);
  }
};

// ... and when many rows do (prefill): unpacked once per tile into vpair [8][DT / 16] (store_pairs)
struct StoredPairs {
  const __m512i* vpair;
  int nvc;  // DT / 16
  BR_BF16_ATTN BR_INLINE void operator()(int j, int c0, __m512i* v) const {
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) v[c] = _mm512_load_si512(vpair + j * nvc + c0 + c);
  }
};
template <int DT>
BR_BF16_ATTN BR_INLINE void store_pairs(const uint16_t* const* vrow, __m512i* vpair) {
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j)
#pragma GCC unroll 2
    for (int c0 = 0; c0 < DT / 16; c0 += 4) {
      __m512i v[4];
      unpack_pair(vrow, j, c0, v);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) _mm512_store_si512(vpair + j * (DT / 16) + c0 + c, v[c]);
    }
}

// acc rows [r0, r0 + NR) x float vectors [c0, c0 + 4) = acc * alpha + p @ V over the tile's 8 key pairs,
// taken from pairs (PairsFromRows or StoredPairs); pb: each row's 16 p as bf16
template <int DT, int NR, typename Pairs>
BR_BF16_ATTN BR_INLINE void pv_tile(float* acc, int r0, int c0, const float* alpha, const uint16_t* pb,
                                    const Pairs& pairs) {
  __m512 a[NR][4];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c)
      a[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (r0 + r) * DT + (c0 + c) * 16), _mm512_set1_ps(alpha[r0 + r]));
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    __m512i v[4];
    pairs(j, c0, v);
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      int32_t pp;
      std::memcpy(&pp, pb + (r0 + r) * 16 + 2 * j, sizeof pp);
      const __m512bh p2 = (__m512bh)_mm512_set1_epi32(pp);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], (__m512bh)v[c], p2);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + (r0 + r) * DT + (c0 + c) * 16, a[r][c]);
}

// accumulator rows [R][DT] built on unpack_pair's pairs back in dimension order
BR_BF16_ATTN BR_INLINE void unpermute_acc(float* acc, int R, int DT) {
  const __m512i lo = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i hi = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  for (int i = 0; i < R * DT; i += 32) {
    const __m512 a = _mm512_loadu_ps(acc + i), b = _mm512_loadu_ps(acc + i + 16);
    _mm512_storeu_ps(acc + i, _mm512_permutex2var_ps(a, lo, b));
    _mm512_storeu_ps(acc + i + 16, _mm512_permutex2var_ps(a, hi, b));
  }
}

// One work item (R query rows, head_dim DT in {64, 128}); ws: scratch of at least R x (DT + 8) floats.
template <int DT, int R>
BR_BF16_ATTN __attribute__((noinline)) void decode_item_bf16(const Params& P, const Item& it, float* ws) {
  constexpr int NB = DT / 32;    // 16 x 16 blocks of 32-bit pairs per K row
  constexpr int NVC = DT / 16;   // float vectors per row
  constexpr int A = R <= 4 ? 2 : 1;  // score accumulators per row: two chains hide VDPBF16PS's latency
  const Group& g = P.groups[it.group];
  const int G = P.G, b = g.b, h = g.h;
  const int qbeg = P.qsl[b], qlen = P.qsl[b + 1] - qbeg, ctx = P.lens[b];
  const uint16_t* q = static_cast<const uint16_t*>(P.q);
  const uint32_t* qp[R];  // each row's q as bfloat16 pairs
  int pos[R];
  int min_pos = 1 << 30, max_pos = -1;
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const int t = g.t0 + r / G, hq = h * G + r % G;
    qp[r] = reinterpret_cast<const uint32_t*>(q + static_cast<int64_t>(qbeg + t) * P.qs0 +
                                              static_cast<int64_t>(hq) * P.qs1);
    pos[r] = ctx - qlen + t;
    min_pos = std::min(min_pos, pos[r]);
    max_pos = std::max(max_pos, pos[r]);
  }
  float* acc = ws;                                             // [R][DT], unpack_pair's order until the end
  uint16_t* pb = reinterpret_cast<uint16_t*>(acc + R * DT);    // [R][16] the tile's p as bf16
  std::fill(acc, acc + R * DT, 0.0f);
  float m[R];
  alignas(64) float alpha[16];
  __m512 lsum[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    m[r] = NEG_INF;
    lsum[r] = _mm512_setzero_ps();
  }

  const int window = P.window;
  const KvRows<DT> rows_of(P, b, h, ring_of(ws, R, DT), kv_prefetch_tiles.load(std::memory_order_relaxed) > 1);
  const uint16_t* kp[2][16];
  const uint16_t* vp[2][16];
  const int row_bytes = DT * 2;
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 scale = _mm512_set1_ps(P.scale), ninf = _mm512_set1_ps(NEG_INF);
  if (it.k0 < it.k1) rows_of.locate(it.k0, std::min(16, it.k1 - it.k0), kp[0], vp[0], 0);
  int cur = 0;
  for (int k0 = it.k0; k0 < it.k1; k0 += 16, cur ^= 1) {
    const int n = std::min(16, it.k1 - k0);
    const int nn = k0 + 16 < it.k1 ? std::min(16, it.k1 - k0 - 16) : 0;
    const int after = std::max(0, std::min(16, it.k1 - k0 - 32));     // keys of the tile after the next
    if (nn > 0) rows_of.locate(k0 + 16, nn, kp[cur ^ 1], vp[cur ^ 1], cur ^ 1, after);
    const int pf = rows_of.convert ? 0 : nn;                           // next tile's rows to prefetch here

    // scores: lane j of s[r] is q_r . k_j
    __m512 s[R][A];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int a = 0; a < A; ++a) s[r][a] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int blk = 0; blk < NB; ++blk) {
      __m512i rows[16], cols[16];
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
        if (blk == 0 && j < pf)  // the next tile's K row
          for (int c = 0; c < row_bytes; c += 64)
            __builtin_prefetch(reinterpret_cast<const char*>(kp[cur ^ 1][j]) + c, 0, 1);
        rows[j] = _mm512_loadu_si512(kp[cur][j] + blk * 32);
      }
      transpose16(rows, cols);
#pragma GCC unroll 16
      for (int p = 0; p < 16; ++p)
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
          s[r][p % A] = _mm512_dpbf16_ps(s[r][p % A], (__m512bh)cols[p],
                                         (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[r][blk * 16 + p])));
    }

    // online softmax over the tile's 16 lanes; masked lanes (past the span, causal, window) are -inf
    const bool need_mask = n < 16 || k0 + n - 1 > min_pos || k0 <= max_pos - window;
    const __m512i kpos = _mm512_add_epi32(iota, _mm512_set1_epi32(k0));
    alignas(64) float mold[16] = {};
    float ms[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m512 x = s[r][0];
      if constexpr (A == 2) x = _mm512_add_ps(x, s[r][1]);
      if (need_mask) {
        __mmask16 ok = _mm512_cmplt_epi32_mask(iota, _mm512_set1_epi32(n));
        ok &= _mm512_cmple_epi32_mask(kpos, _mm512_set1_epi32(pos[r]));
        ok &= _mm512_cmpgt_epi32_mask(kpos, _mm512_set1_epi32(pos[r] - window));
        x = _mm512_mask_mov_ps(ninf, ok, x);
      }
      s[r][0] = x;
      const float mx = std::max(m[r], _mm512_reduce_max_ps(x) * P.scale);  // scale > 0: the max of the scaled
      ms[r] = mx == NEG_INF ? 0.0f : mx;  // nothing visible yet: every weight is 0
      mold[r] = m[r] - ms[r];
      m[r] = mx;
    }
    _mm512_store_ps(alpha, exp_for_bf16(_mm512_load_ps(mold)));  // the rows' rescale factors, one vector exp
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 pr = exp_for_bf16(_mm512_fmsub_ps(s[r][0], scale, _mm512_set1_ps(ms[r])));
      lsum[r] = _mm512_fmadd_ps(lsum[r], _mm512_set1_ps(alpha[r]), pr);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + r * 16), (__m256i)_mm512_cvtneps_pbh(pr));
    }

    // acc = acc * alpha + p @ V, at most 4 rows x 4 vectors in registers at a time
    constexpr int NR0 = R < 4 ? R : 4, NR1 = R - NR0;
#pragma GCC unroll 2
    for (int c0 = 0; c0 < NVC; c0 += 4) {
      pv_tile<DT, NR0>(acc, 0, c0, alpha, pb, PairsFromRows{vp[cur], vp[cur ^ 1], pf, row_bytes});
      if constexpr (NR1 > 0) pv_tile<DT, NR1>(acc, NR0, c0, alpha, pb, PairsFromRows{vp[cur], vp[cur ^ 1], 0, row_bytes});
    }
  }
  unpermute_acc(acc, R, DT);

  if (it.slot < 0) {
    c10::BFloat16* out = static_cast<c10::BFloat16*>(P.out);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int t = g.t0 + r / G, hq = h * G + r % G;
      c10::BFloat16* op = out + static_cast<int64_t>(qbeg + t) * P.os0 + static_cast<int64_t>(hq) * P.os1;
      const float l = _mm512_reduce_add_ps(lsum[r]);
      store_row(acc + r * DT, l > 0.0f ? P.v_scale / l : 0.0f, op, DT);
    }
  } else {
    float* st = P.part_stats + static_cast<int64_t>(it.slot) * P.max_rows * 2;
    float* pa = P.part_acc + static_cast<int64_t>(it.slot) * P.max_rows * DT;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      st[2 * r] = m[r];
      st[2 * r + 1] = _mm512_reduce_add_ps(lsum[r]);
      std::memcpy(pa + static_cast<int64_t>(r) * DT, acc + r * DT, sizeof(float) * DT);
    }
  }
}

// The item on this path when it has at most 8 query rows (true), else false: the generic loops take it.
template <int DT>
bool decode_bf16(const Params& P, const Item& it, float* ws) {
  const Group& g = P.groups[it.group];
  switch ((g.t1 - g.t0) * P.G) {
    case 1: decode_item_bf16<DT, 1>(P, it, ws); return true;
    case 2: decode_item_bf16<DT, 2>(P, it, ws); return true;
    case 3: decode_item_bf16<DT, 3>(P, it, ws); return true;
    case 4: decode_item_bf16<DT, 4>(P, it, ws); return true;
    case 5: decode_item_bf16<DT, 5>(P, it, ws); return true;
    case 6: decode_item_bf16<DT, 6>(P, it, ws); return true;
    case 7: decode_item_bf16<DT, 7>(P, it, ws); return true;
    case 8: decode_item_bf16<DT, 8>(P, it, ws); return true;
    default: return false;
  }
}

}  // namespace

#else
namespace {
template <int DT>
bool decode_bf16(const Params&, const Item&, float*) { return false; }
inline bool cpu_has_avx512_bf16() { return false; }
}  // namespace
#endif
