// Paged attention on CPU that reads K/V blocks in place (batchrun.kernels.cpu_attention builds and loads this).
//
// batchrun_cpu::paged_attention(q [T, Hq, D], k_cache, v_cache [N, bs, Hkv, D], query_start_loc [B+1] int32,
//                           seq_lens [B] int32, block_tables [B, W] int32, scale, sliding_window, isa) -> [T, Hq, D]
//
// The caches hold q's dtype, or float8 (e4m3fn, e5m2: kv_cache_dtype fp8) read as x * k_scale / v_scale: each
// row is converted to float in registers as its tile is loaded, k_scale folded into the query scale and
// v_scale into the output's normalisation. Or int8 (kv_cache_dtype int8): each head's row is D codes then a
// float16 scale per group of 32 values (kernels/kv_quant.py), the cache's last dimension D + 2 * ceil(D / 32);
// read as code x its group's scale. store_kv (cpu_kv_store.cpp) writes both forms.
//
// Sequence b's queries are rows query_start_loc[b] .. query_start_loc[b+1] of q, the last qlen positions of
// its context of seq_lens[b] tokens (query t sits at seq_lens[b] - qlen + t). Causal, GQA, optional sliding
// window (a query at p sees keys j with p - window < j <= p), online softmax in float.
//
// Work is split into groups (sequence, KV head, chunk of query tokens); all query heads of a group share each
// K/V read, and K/V rows are converted to float a tile of 16 keys at a time, the next tile prefetched into L2.
// A group whose key span is long while the batch has too few groups to keep the threads busy is split into
// partitions whose partial results are merged afterwards (flash-decoding). Threads (torch's pool) take work
// items longest first from a shared counter. On CPUs with AVX-512 BF16, bfloat16 items with head_dim 64 or 128
// take cpu_attention_bf16.h's path (up to 8 query rows: decode, verification) or cpu_attention_bf16_prefill.h's
// (more rows) instead (isa level 3).
// The hot loops use GCC/Clang vector extensions (16 floats), and the kernel is compiled for AVX-512, AVX2+FMA
// and the baseline ISA through function target attributes and picked at run time, so one build is portable
// across x86-64 machines (no -march=native).
//
// Built against torch's stable C++ API (torch >= 2.10): its headers are small, so the one-time build is quick.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "vec.h"
#include "ops.h"

namespace {

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

constexpr int PAD = 16;        // head_dim and query rows are padded to a multiple of this in the scratch
constexpr int TK = 16;         // keys per tile
constexpr int JB = 4;          // keys scored together (independent accumulator chains)
constexpr int SMALL_R = 8;     // fewer query rows per group than this: per-key dot products
constexpr int MAX_ROWS = 64;   // query rows (tokens x group size) per group, unless one token's group is larger
constexpr int PART_KEYS = 512; // shortest key span worth a partition of its own
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
enum KvType { KV_SAME = 0, KV_E4M3 = 1, KV_E5M2 = 2, KV_I8 = 3 };  // the caches: q's dtype, float8 or int8

struct Group {
  int b, h, t0, t1, lo, hi;  // sequence, KV head, query tokens [t0, t1) of the sequence, keys [lo, hi)
  int first_item, nparts, slot;  // slot: first partial-result slot when nparts > 1
};

struct Item {
  int group, k0, k1, slot;  // keys [k0, k1); slot < 0: write the output directly
  int64_t cost;
};

struct Params {
  const void* q;
  int64_t qs0, qs1;
  const void* k;
  const void* v;
  int64_t ks0, ks1, ks2, vs0, vs1, vs2;
  void* out;
  int64_t os0, os1;
  const int32_t* qsl;
  const int32_t* lens;
  const int32_t* bt;
  int64_t bts0;
  int64_t nblocks;
  int bs, G, D;
  float scale;
  float v_scale;  // K/V stored as float8: the value scale (k_scale is folded into `scale`); else 1
  int window;  // a huge value when there is no window
  const Group* groups;
  const Item* items;
  int nitems;
  int max_rows;
  float* part_stats;  // [slots, max_rows, 2]: running max, sum
  float* part_acc;    // [slots, max_rows, D]
  bool bf16;          // bfloat16 items take cpu_attention_bf16.h's (<= 8 query rows) or _bf16_prefill.h's path
  KvType kv;          // the caches: those paths convert float8 and int8 rows as they load them
};

template <typename T>
BR_INLINE void load_row(const T* BR_RESTRICT src, float* BR_RESTRICT dst, int D) {
  for (int d = 0; d < D; ++d) dst[d] = to_f(src[d]);
}
// a K or V row as floats: the vector float8 or int8 conversion, else load_row
template <int V, typename KT>
BR_INLINE void load_kv_row(const KT* BR_RESTRICT src, float* BR_RESTRICT dst, int D) {
  if constexpr (std::is_same_v<KT, int8_t>) {
    const char* sp = reinterpret_cast<const char*>(src + D);  // the groups' float16 scales follow the codes
    for (int g0 = 0; g0 < D; g0 += I8_GROUP, sp += 2) {
      c10::Half h;
      std::memcpy(&h, sp, 2);
      const float s = to_f(h);
      const int g1 = std::min(D, g0 + I8_GROUP);
      int d = g0;
      for (; d + V <= g1; d += V) vstore<V>(dst + d, vload_i8<V>(src + d) * s);
      for (; d < g1; ++d) dst[d] = static_cast<float>(src[d]) * s;
    }
  } else if constexpr (is_fp8<KT>) {
    int d = 0;
    for (; d + V <= D; d += V) vstore<V>(dst + d, vload_fp8<V>(src + d));
    for (; d < D; ++d) dst[d] = to_f(src[d]);
  } else {
    load_row(src, dst, D);
  }
}
template <typename T>
BR_INLINE void store_row(const float* BR_RESTRICT src, float mul, T* BR_RESTRICT dst, int D) {
  for (int d = 0; d < D; ++d) dst[d] = static_cast<T>(src[d] * mul);
}

inline int round_up(int x, int m) { return (x + m - 1) / m * m; }

// Floats of per-thread scratch for a group of `rows` query rows (rows and head_dim padded to multiples of 16),
// the last 32 DP + 16 for the bfloat16 paths' ring of converted quantized rows (cpu_attention_bf16.h ring_of)
inline size_t scratch_floats(int rows, int D) {
  const size_t RP = round_up(rows, PAD), DP = round_up(D, PAD);
  return RP * DP + 2 * TK * DP + TK * RP + 4 * RP + RP * DP + 32 * DP + 16;
}

// acc rows [r0, r0 + NR) = acc * alpha + p @ v over a tile, for vectors [c0, c0 + CV) of each row, in registers
template <int V, int NR, int CV>
BR_INLINE void pv_block(float* BR_RESTRICT acc, int DP, int r0, int c0, const float* BR_RESTRICT alpha,
                        const float* BR_RESTRICT s, int RP, const float* BR_RESTRICT vf) {
  typedef typename VT<V>::f F;
  F a[NR][CV];  // fully unrolled loops below keep these in registers (else -O2 leaves them on the stack)
#pragma GCC unroll 8
  for (int x = 0; x < NR; ++x) {
    const F al = vsplat<V>(alpha[r0 + x]);
#pragma GCC unroll 8
    for (int c = 0; c < CV; ++c) a[x][c] = vload<V>(acc + (r0 + x) * DP + (c0 + c) * V) * al;
  }
  for (int j = 0; j < TK; ++j) {
    float p[NR];
#pragma GCC unroll 8
    for (int x = 0; x < NR; ++x) p[x] = s[j * RP + r0 + x];
#pragma GCC unroll 8
    for (int c = 0; c < CV; ++c) {
      const F v = vload<V>(vf + j * DP + (c0 + c) * V);
#pragma GCC unroll 8
      for (int x = 0; x < NR; ++x) a[x][c] += p[x] * v;
    }
  }
#pragma GCC unroll 8
  for (int x = 0; x < NR; ++x)
#pragma GCC unroll 8
    for (int c = 0; c < CV; ++c) vstore<V>(acc + (r0 + x) * DP + (c0 + c) * V, a[x][c]);
}

// One work item: query rows (tokens t0..t1 x the G query heads of KV head h) against keys [k0, k1).
// T: q and output type; KT: the caches' (T, or a float8 type); DT: head_dim when specialised (64, 128), else
// 0; V: floats per vector register.
template <typename T, typename KT, int DT, int V>
BR_INLINE void run_item(const Params& P, const Item& it, float* BR_RESTRICT ws) {
  typedef typename VT<V>::f F;
  const Group& g = P.groups[it.group];
  const int D = DT > 0 ? DT : P.D;
  const int DP = DT > 0 ? DT : round_up(P.D, PAD);  // DT is 64 or 128: already a multiple of 16
  const int NV = DP / V;
  const int G = P.G, b = g.b, h = g.h;
  const int qbeg = P.qsl[b], qlen = P.qsl[b + 1] - qbeg, ctx = P.lens[b];
  const int R = (g.t1 - g.t0) * G;
  const int RP = round_up(R, PAD);
  const bool small = R < SMALL_R;

  float* BR_RESTRICT qs = ws;             // small: [R][DP]; else transposed [D][RP]
  float* BR_RESTRICT kf = qs + RP * DP;   // [TK][DP]
  float* BR_RESTRICT vf = kf + TK * DP;   // [TK][DP]
  float* BR_RESTRICT s = vf + TK * DP;    // [TK][RP]: scores, then probabilities
  float* BR_RESTRICT m = s + TK * RP;     // [RP] running max
  float* BR_RESTRICT l = m + RP;          // [RP] running sum
  float* BR_RESTRICT alpha = l + RP;      // [RP]
  float* BR_RESTRICT posf = alpha + RP;   // [RP] query positions (exact in float below 2^24)
  float* BR_RESTRICT acc = posf + RP;     // [RP][DP]

  const T* q = static_cast<const T*>(P.q);
  const KT* kc = static_cast<const KT*>(P.k);
  const KT* vc = static_cast<const KT*>(P.v);
  const float scale = P.scale;

  // this group's queries, scaled, as float; pad rows and columns are zeros
  std::fill(qs, qs + static_cast<size_t>(RP) * DP, 0.0f);
  std::fill(acc, acc + static_cast<size_t>(RP) * DP, 0.0f);
  std::fill(s, s + TK * RP, 0.0f);
  if (DP != D) {
    std::fill(kf, kf + TK * DP, 0.0f);
    std::fill(vf, vf + TK * DP, 0.0f);
  }
  int min_pos = 0, max_pos = 0;
  for (int r = 0; r < RP; ++r) {
    const int rr = r < R ? r : R - 1;
    const int t = g.t0 + rr / G, hq = h * G + rr % G;
    const int pos = ctx - qlen + t;
    posf[r] = static_cast<float>(pos);
    m[r] = NEG_INF;
    l[r] = 0.0f;
    if (r == 0) min_pos = pos;
    if (r < R) max_pos = pos;
    if (r >= R) continue;
    const T* qp = q + static_cast<int64_t>(qbeg + t) * P.qs0 + static_cast<int64_t>(hq) * P.qs1;
    if (small) {
      for (int d = 0; d < D; ++d) qs[r * DP + d] = to_f(qp[d]) * scale;
    } else {
      for (int d = 0; d < D; ++d) qs[d * RP + r] = to_f(qp[d]) * scale;
    }
  }

  const int32_t* table = P.bt + static_cast<int64_t>(b) * P.bts0;
  const int bs = P.bs;
  const int window = P.window;
  const int64_t koff = static_cast<int64_t>(h) * P.ks2, voff = static_cast<int64_t>(h) * P.vs2;

  // row pointers of a tile's keys and values; the next tile's are found a tile ahead and prefetched (an L2
  // hint: one to L1 measured slower) one row at a time as the current tile's rows are read: a burst of the
  // whole tile's prefetches at once stalls on the load queue: 1.2-1.5x slower per decode tile, one thread
  const KT* kp[2][TK];
  const KT* vp[2][TK];
  auto locate = [&](int k0, int n, const KT** kr, const KT** vr) {
    int bi = k0 / bs, off = k0 - bi * bs;
    int64_t blk = table[bi];  // block ids were checked against the cache size before the parallel region
    for (int j = 0; j < n; ++j, ++off) {
      if (off == bs) {
        blk = table[++bi];
        off = 0;
      }
      kr[j] = kc + blk * P.ks0 + off * P.ks1 + koff;
      vr[j] = vc + blk * P.vs0 + off * P.vs1 + voff;
    }
  };
  const int row_bytes = std::is_same_v<KT, int8_t> ? static_cast<int>(i8_row(D)) : D * static_cast<int>(sizeof(KT));
  if (it.k0 < it.k1) locate(it.k0, std::min(TK, it.k1 - it.k0), kp[0], vp[0]);
  int cur = 0;
  for (int k0 = it.k0; k0 < it.k1; k0 += TK, cur ^= 1) {
    const int n = std::min(TK, it.k1 - k0);
    const int nn = k0 + TK < it.k1 ? std::min(TK, it.k1 - k0 - TK) : 0;  // keys of the next tile
    if (nn > 0) locate(k0 + TK, nn, kp[cur ^ 1], vp[cur ^ 1]);
    // the tile's keys and values, read in place from their blocks, as float
    for (int j = 0; j < n; ++j) {
      if (j < nn)
        for (int c = 0; c < row_bytes; c += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(kp[cur ^ 1][j]) + c, 0, 1);
          __builtin_prefetch(reinterpret_cast<const char*>(vp[cur ^ 1][j]) + c, 0, 1);
        }
      load_kv_row<V>(kp[cur][j], kf + j * DP, D);
      load_kv_row<V>(vp[cur][j], vf + j * DP, D);
    }
    for (int j = n; j < TK; ++j) {  // a short last tile: zeros, masked below
      std::fill(kf + j * DP, kf + (j + 1) * DP, 0.0f);
      std::fill(vf + j * DP, vf + (j + 1) * DP, 0.0f);
    }

    // scores s[j][r] = q_r . k_j (q is scaled)
    if (small) {  // few rows (decode): dot products, one horizontal sum each, JB keys at a time (one
                  // dependency chain at a time left the FMA latency exposed: 1.1-1.4x slower, measured)
      static_assert(TK % JB == 0 && JB == 4, "keys are scored four at a time");
      for (int r = 0; r < R; ++r) {
        const float* qr = qs + r * DP;
        for (int j = 0; j < TK; j += JB) {
          const float* kj = kf + j * DP;
          F a0{}, a1{}, a2{}, a3{};
#pragma GCC unroll 16
          for (int c = 0; c < NV; ++c) {
            const F qv = vload<V>(qr + c * V);
            a0 += qv * vload<V>(kj + c * V);
            a1 += qv * vload<V>(kj + DP + c * V);
            a2 += qv * vload<V>(kj + 2 * DP + c * V);
            a3 += qv * vload<V>(kj + 3 * DP + c * V);
          }
          s[j * RP + r] = hsum<V>(a0);
          s[(j + 1) * RP + r] = hsum<V>(a1);
          s[(j + 2) * RP + r] = hsum<V>(a2);
          s[(j + 3) * RP + r] = hsum<V>(a3);
        }
      }
    } else {  // rows across the vector lanes, no horizontal sums; two row blocks share each key broadcast
      int rb = 0;
      for (; rb + 2 * V <= RP; rb += 2 * V) {
        for (int jb = 0; jb < TK; jb += JB) {
          const float* k0p = kf + jb * DP;
          F a0{}, a1{}, a2{}, a3{}, b0{}, b1{}, b2{}, b3{};
          for (int d = 0; d < D; ++d) {
            const F qa = vload<V>(qs + d * RP + rb), qb = vload<V>(qs + d * RP + rb + V);
            const float x0 = k0p[d], x1 = k0p[DP + d], x2 = k0p[2 * DP + d], x3 = k0p[3 * DP + d];
            a0 += x0 * qa;
            b0 += x0 * qb;
            a1 += x1 * qa;
            b1 += x1 * qb;
            a2 += x2 * qa;
            b2 += x2 * qb;
            a3 += x3 * qa;
            b3 += x3 * qb;
          }
          float* sp = s + jb * RP + rb;
          vstore<V>(sp, a0);
          vstore<V>(sp + V, b0);
          vstore<V>(sp + RP, a1);
          vstore<V>(sp + RP + V, b1);
          vstore<V>(sp + 2 * RP, a2);
          vstore<V>(sp + 2 * RP + V, b2);
          vstore<V>(sp + 3 * RP, a3);
          vstore<V>(sp + 3 * RP + V, b3);
        }
      }
      for (; rb < RP; rb += V) {
        for (int jb = 0; jb < TK; jb += JB) {
          const float* k0p = kf + jb * DP;
          F a0{}, a1{}, a2{}, a3{};
          for (int d = 0; d < D; ++d) {
            const F qv = vload<V>(qs + d * RP + rb);
            a0 += k0p[d] * qv;
            a1 += k0p[DP + d] * qv;
            a2 += k0p[2 * DP + d] * qv;
            a3 += k0p[3 * DP + d] * qv;
          }
          vstore<V>(s + (jb + 0) * RP + rb, a0);
          vstore<V>(s + (jb + 1) * RP + rb, a1);
          vstore<V>(s + (jb + 2) * RP + rb, a2);
          vstore<V>(s + (jb + 3) * RP + rb, a3);
        }
      }
    }
    // mask: causal, window, past the span
    if (n < TK || k0 + n - 1 > min_pos || k0 <= max_pos - window) {
      for (int j = 0; j < TK; ++j) {
        const float kpos = static_cast<float>(k0 + j);
        const bool beyond = j >= n;
        float* sj = s + j * RP;
        for (int r = 0; r < RP; ++r) {
          const bool hide = beyond || kpos > posf[r] || kpos <= posf[r] - static_cast<float>(window);
          sj[r] = hide ? NEG_INF : sj[r];
        }
      }
    }
    // online softmax, rows across the lanes (a decode's few rows fit in one vector)
    const int RU = small ? round_up(R, V) : RP;
    for (int rb = 0; rb < RU; rb += V) {
      const F mold = vload<V>(m + rb);
      F mx = mold;
      for (int j = 0; j < TK; ++j) mx = vmax<V>(mx, vload<V>(s + j * RP + rb));
      const F ms = mx == vsplat<V>(NEG_INF) ? F{} : mx;  // nothing visible yet: every weight is 0
      const F al = vexp_nonpos<V>(mold - ms);
      F sum{};
      for (int j = 0; j < TK; ++j) {
        const F pj = vexp_nonpos<V>(vload<V>(s + j * RP + rb) - ms);
        vstore<V>(s + j * RP + rb, pj);
        sum += pj;
      }
      vstore<V>(l + rb, vload<V>(l + rb) * al + sum);
      vstore<V>(alpha + rb, al);
      vstore<V>(m + rb, mx);
    }
    // acc = acc * alpha + p @ v, a block of rows x vectors in registers (at most 8 accumulators)
    if constexpr (DT > 0) {
      constexpr int NVC = DT / V;
      constexpr int CV = NVC < 8 ? NVC : 8;
      constexpr int NR = NVC <= 4 ? 2 : 1;
      int r = 0;
      for (; r + NR <= R; r += NR)
        for (int c0 = 0; c0 < NVC; c0 += CV) pv_block<V, NR, CV>(acc, DP, r, c0, alpha, s, RP, vf);
      for (; r < R; ++r)
        for (int c0 = 0; c0 < NVC; c0 += CV) pv_block<V, 1, CV>(acc, DP, r, c0, alpha, s, RP, vf);
    } else {
      for (int r = 0; r < R; ++r)
        for (int c0 = 0; c0 < NV; ++c0) pv_block<V, 1, 1>(acc, DP, r, c0, alpha, s, RP, vf);
    }
  }

  if (it.slot < 0) {
    T* out = static_cast<T*>(P.out);
    for (int r = 0; r < R; ++r) {
      const int t = g.t0 + r / G, hq = h * G + r % G;
      T* op = out + static_cast<int64_t>(qbeg + t) * P.os0 + static_cast<int64_t>(hq) * P.os1;
      store_row(acc + r * DP, l[r] > 0.0f ? P.v_scale / l[r] : 0.0f, op, D);
    }
  } else {
    float* st = P.part_stats + static_cast<int64_t>(it.slot) * P.max_rows * 2;
    float* pa = P.part_acc + static_cast<int64_t>(it.slot) * P.max_rows * D;
    for (int r = 0; r < R; ++r) {
      st[2 * r] = m[r];
      st[2 * r + 1] = l[r];
      std::memcpy(pa + static_cast<int64_t>(r) * D, acc + r * DP, sizeof(float) * D);
    }
  }
}

}  // namespace

#include "cpu_attention_bf16.h"
#include "cpu_attention_bf16_prefill.h"

namespace {

template <typename T, typename KT, int DT, int V>
BR_INLINE void work(const Params& P, std::atomic<int>& next, float* ws) {
  for (int i = next.fetch_add(1, std::memory_order_relaxed); i < P.nitems;
       i = next.fetch_add(1, std::memory_order_relaxed)) {
    // bfloat16 q: the caches are bfloat16, float8 or int8, all read by the VDPBF16PS paths
    if constexpr (std::is_same_v<T, c10::BFloat16> && DT > 0 && V == 16)
      if (P.bf16 && (decode_bf16<DT>(P, P.items[i], ws) || prefill_bf16<DT>(P, P.items[i], ws))) continue;
    run_item<T, KT, DT, V>(P, P.items[i], ws);
  }
}

enum Dtype { F32 = 0, BF16 = 1, F16 = 2 };

// head_dim 64 and 128 get their own code (accumulators in registers) when SPEC; others take the generic loops
template <typename T, typename KT, bool SPEC, int V>
BR_INLINE void work_d(const Params& P, std::atomic<int>& next, float* ws) {
  if constexpr (SPEC) {
    if (P.D == 64) return work<T, KT, 64, V>(P, next, ws);
    if (P.D == 128) return work<T, KT, 128, V>(P, next, ws);
  }
  work<T, KT, 0, V>(P, next, ws);
}
template <typename T, bool SPEC, int V>
BR_INLINE void work_kv(const Params& P, KvType kv, std::atomic<int>& next, float* ws) {
  // float32 q over a quantized cache (a reference setting, not a fast one) keeps the generic head_dim: fewer
  // copies of the kernel to compile
  constexpr bool QSPEC = SPEC && !std::is_same_v<T, float>;
  if (kv == KV_E4M3) return work_d<T, c10::Float8_e4m3fn, QSPEC, V>(P, next, ws);
  if (kv == KV_E5M2) return work_d<T, c10::Float8_e5m2, QSPEC, V>(P, next, ws);
  if (kv == KV_I8) return work_d<T, int8_t, QSPEC, V>(P, next, ws);
  work_d<T, T, SPEC, V>(P, next, ws);
}
// Dispatch on q's dtype, the caches' and head_dim; instantiated once per ISA below (float16: generic loops).
template <bool SPEC, int V>
BR_INLINE void dispatch(const Params& P, Dtype dt, KvType kv, std::atomic<int>& next, float* ws) {
  switch (dt) {
    case F32: return work_kv<float, SPEC, V>(P, kv, next, ws);
    case BF16: return work_kv<c10::BFloat16, SPEC, V>(P, kv, next, ws);
    default: return work_kv<c10::Half, false, V>(P, kv, next, ws);
  }
}

#ifdef BR_X86_DISPATCH
// x86-64 machines without AVX2 are rare: the baseline build is the generic one only
void work_base(const Params& P, Dtype dt, KvType kv, std::atomic<int>& next, float* ws) {
  dispatch<false, 4>(P, dt, kv, next, ws);
}
#else
void work_base(const Params& P, Dtype dt, KvType kv, std::atomic<int>& next, float* ws) {
  dispatch<true, 4>(P, dt, kv, next, ws);
}
#endif

#ifdef BR_X86_DISPATCH
__attribute__((target("avx2,fma,f16c"))) void work_avx2(const Params& P, Dtype dt, KvType kv,
                                                         std::atomic<int>& next, float* ws) {
  dispatch<true, 8>(P, dt, kv, next, ws);
}
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,prefer-vector-width=512"))) void
work_avx512(const Params& P, Dtype dt, KvType kv, std::atomic<int>& next, float* ws) {
  dispatch<true, 16>(P, dt, kv, next, ws);
}
#endif

void run_work(const Params& P, Dtype dt, KvType kv, int isa, std::atomic<int>& next, float* ws) {
#ifdef BR_X86_DISPATCH
  if (isa >= 2) return work_avx512(P, dt, kv, next, ws);
  if (isa == 1) return work_avx2(P, dt, kv, next, ws);
#endif
  work_base(P, dt, kv, next, ws);
}

template <typename T>
void merge_group(const Params& P, const Group& g) {
  const int G = P.G, D = P.D, R = (g.t1 - g.t0) * G;
  const int qbeg = P.qsl[g.b];
  T* out = static_cast<T*>(P.out);
  std::vector<float> o(D);
  for (int r = 0; r < R; ++r) {
    float M = NEG_INF;
    for (int p = 0; p < g.nparts; ++p)
      M = std::max(M, P.part_stats[(static_cast<int64_t>(g.slot + p) * P.max_rows + r) * 2]);
    std::fill(o.begin(), o.end(), 0.0f);
    float L = 0.0f;
    for (int p = 0; p < g.nparts; ++p) {
      const int64_t row = static_cast<int64_t>(g.slot + p) * P.max_rows + r;
      const float mp = P.part_stats[row * 2], lp = P.part_stats[row * 2 + 1];
      if (lp == 0.0f) continue;
      const float w = std::exp(mp - M);
      L += w * lp;
      const float* a = P.part_acc + row * D;
      for (int d = 0; d < D; ++d) o[d] += w * a[d];
    }
    const int t = g.t0 + r / G, hq = g.h * G + r % G;
    T* op = out + static_cast<int64_t>(qbeg + t) * P.os0 + static_cast<int64_t>(hq) * P.os1;
    store_row(o.data(), L > 0.0f ? P.v_scale / L : 0.0f, op, D);
  }
}

int64_t attention_isa() { return cpu_has_avx512_bf16() ? 3 : best_isa(); }  // paged_attention's best level

#define BR_CHECK(cond, ...) STD_TORCH_CHECK(cond, "paged_attention: ", __VA_ARGS__)

Tensor paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_start_loc, Tensor seq_lens,
                       Tensor block_tables, double scale, int64_t sliding_window, int64_t isa, double k_scale,
                       double v_scale, int64_t sdpa_from) {
  BR_CHECK(q.is_cpu() && k_cache.is_cpu() && v_cache.is_cpu(), "CPU tensors only");
  BR_CHECK(q.dim() == 3, "q must be [T, Hq, D], got ", q.dim(), " dims");
  BR_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, "k_cache, v_cache must be [num_blocks, block_size, Hkv, D]");
  for (int i = 0; i < 4; ++i)
    BR_CHECK(k_cache.size(i) == v_cache.size(i), "k_cache and v_cache shapes differ");
  const ScalarType st = q.scalar_type();
  BR_CHECK(st == ScalarType::Float || st == ScalarType::BFloat16 || st == ScalarType::Half,
           "dtype must be float32, bfloat16 or float16");
  const ScalarType kst = k_cache.scalar_type();
  const KvType kv = kst == ScalarType::Float8_e4m3fn ? KV_E4M3 : kst == ScalarType::Float8_e5m2 ? KV_E5M2
                    : kst == ScalarType::Char ? KV_I8 : KV_SAME;
  BR_CHECK((kv != KV_SAME || kst == st) && v_cache.scalar_type() == kst,
           "q, k_cache, v_cache dtypes differ (the caches may be float8_e4m3fn, float8_e5m2 or int8 instead)");
  BR_CHECK(std::isfinite(scale) && scale > 0, "scale must be positive, got ", scale);  // max(scale s) = scale max(s)
  BR_CHECK(std::isfinite(k_scale) && k_scale > 0 && std::isfinite(v_scale) && v_scale > 0,
           "k_scale and v_scale must be positive");
  BR_CHECK((kv != KV_SAME && kv != KV_I8) || (k_scale == 1.0 && v_scale == 1.0),
           "k_scale and v_scale apply to float8 caches only");
  BR_CHECK(q.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
           "the head dimension must be contiguous");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t nblocks = k_cache.size(0), bs = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t width = kv == KV_I8 ? i8_row(D) : D;
  BR_CHECK(k_cache.size(3) == width, "head_dim of q (", D, ") and of the cache (", k_cache.size(3), ") differ",
           kv == KV_I8 ? " (an int8 cache's rows are head_dim codes and 2 bytes per 32 of them)" : "");
  BR_CHECK(Hkv > 0 && Hq % Hkv == 0, "num query heads (", Hq, ") must be a multiple of num KV heads (", Hkv, ")");
  BR_CHECK(bs > 0 && D > 0, "empty block_size or head_dim");
  for (const Tensor* t : {&query_start_loc, &seq_lens, &block_tables})
    BR_CHECK(t->is_cpu() && t->scalar_type() == ScalarType::Int,
             "query_start_loc, seq_lens, block_tables must be int32 CPU tensors");
  BR_CHECK(seq_lens.dim() == 1 && seq_lens.is_contiguous(), "seq_lens must be a contiguous [B] tensor");
  const int64_t B = seq_lens.size(0);
  BR_CHECK(query_start_loc.dim() == 1 && query_start_loc.size(0) == B + 1 && query_start_loc.is_contiguous(),
           "query_start_loc must be a contiguous [B + 1] tensor");
  BR_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B &&
               (block_tables.stride(1) == 1 || block_tables.size(1) <= 1),
           "block_tables must be [B, max_blocks] with contiguous rows");
  BR_CHECK(T < (int64_t(1) << 31) && nblocks < (int64_t(1) << 31), "too many tokens or blocks");

  Tensor out = torch::stable::new_empty(q, {T, Hq, D});
  if (T == 0 || B == 0) return out;

  const int32_t* qsl = static_cast<const int32_t*>(query_start_loc.data_ptr());
  const int32_t* lens = static_cast<const int32_t*>(seq_lens.data_ptr());
  const int32_t* bt = static_cast<const int32_t*>(block_tables.data_ptr());
  const int64_t W = block_tables.size(1), bts0 = block_tables.stride(0);
  const int G = static_cast<int>(Hq / Hkv);
  const int window = sliding_window > 0 ? static_cast<int>(std::min<int64_t>(sliding_window, 1 << 30)) : (1 << 30);
  BR_CHECK(qsl[0] == 0 && qsl[B] == T, "query_start_loc must run from 0 to T = ", T, ", got ", qsl[0], " .. ",
           qsl[B]);

  // plan: groups of (sequence, KV head, query chunk); block table entries checked once here
  const int tok_per_group = std::max(1, MAX_ROWS / G);
  std::vector<Group> groups;
  std::vector<int> fresh;
  int max_rows = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int qlen = qsl[b + 1] - qsl[b], ctx = lens[b];
    BR_CHECK(qlen >= 0, "query_start_loc decreases at sequence ", b);
    BR_CHECK(ctx >= qlen, "seq_lens[", b, "] = ", ctx, " is shorter than its ", qlen, " query tokens");
    BR_CHECK(static_cast<int64_t>(ctx) <= W * bs, "seq_lens[", b, "] = ", ctx, " needs more than the ", W,
             " blocks of its block table row");
    if (qlen == 0) continue;
    if (sdpa_from > 0 && qlen >= sdpa_from && qlen == ctx && window == (1 << 30) && kv == KV_SAME) {
      fresh.push_back(static_cast<int>(b));     // torch's SDPA, after the own kernel's work (cpu_attention_sdpa.cpp)
      continue;
    }
    const int first = std::max(0, ctx - qlen - window + 1) / static_cast<int>(bs);
    const int last = (ctx - 1) / static_cast<int>(bs);
    for (int i = first; i <= last; ++i) {
      const int32_t blk = bt[b * bts0 + i];
      BR_CHECK(blk >= 0 && blk < nblocks, "block_tables[", b, ", ", i, "] = ", blk, " is not a block of the cache (",
               nblocks, " blocks)");
    }
    const int nchunks = (qlen + tok_per_group - 1) / tok_per_group;
    const int per = (qlen + nchunks - 1) / nchunks;
    for (int t0 = 0; t0 < qlen; t0 += per) {
      const int t1 = std::min(qlen, t0 + per);
      const int pmin = ctx - qlen + t0, pmax = ctx - qlen + t1 - 1;
      const int lo = std::max(0, pmin - window + 1), hi = pmax + 1;
      max_rows = std::max(max_rows, (t1 - t0) * G);
      for (int h = 0; h < Hkv; ++h) groups.push_back({static_cast<int>(b), h, t0, t1, lo, hi, 0, 1, -1});
    }
  }
  const int nthreads = std::max<int>(1, static_cast<int>(torch::stable::get_num_threads()));
  // too few groups to keep the threads busy: split long key spans into partitions, merged below
  int want = 1;
  if (nthreads > 1 && !groups.empty() && static_cast<int64_t>(groups.size()) < 4 * nthreads)
    want = static_cast<int>((4 * nthreads + groups.size() - 1) / groups.size());
  std::vector<Item> items;
  int slots = 0;
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    Group& g = groups[gi];
    const int span = g.hi - g.lo;
    const int np = std::max(1, std::min(want, span / PART_KEYS));
    const int rows = (g.t1 - g.t0) * G;
    g.first_item = static_cast<int>(items.size());
    g.nparts = 1;
    if (np == 1) {
      items.push_back({static_cast<int>(gi), g.lo, g.hi, -1, static_cast<int64_t>(span) * (rows + 16)});
      continue;
    }
    g.slot = slots;
    const int per = round_up((span + np - 1) / np, TK);
    int p = 0;
    for (int k0 = g.lo; k0 < g.hi; k0 += per, ++p) {
      const int k1 = std::min(g.hi, k0 + per);
      items.push_back({static_cast<int>(gi), k0, k1, slots + p, static_cast<int64_t>(k1 - k0) * (rows + 16)});
    }
    g.nparts = p;
    slots += p;
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });

  std::vector<float> part_stats, part_acc;
  if (slots > 0) {
    part_stats.resize(static_cast<size_t>(slots) * max_rows * 2);
    part_acc.resize(static_cast<size_t>(slots) * max_rows * D);
  }

  Params P;
  P.q = q.data_ptr();
  P.qs0 = q.stride(0);
  P.qs1 = q.stride(1);
  P.k = k_cache.data_ptr();
  P.v = v_cache.data_ptr();
  P.ks0 = k_cache.stride(0);
  P.ks1 = k_cache.stride(1);
  P.ks2 = k_cache.stride(2);
  P.vs0 = v_cache.stride(0);
  P.vs1 = v_cache.stride(1);
  P.vs2 = v_cache.stride(2);
  P.out = out.data_ptr();
  P.os0 = out.stride(0);
  P.os1 = out.stride(1);
  P.qsl = qsl;
  P.lens = lens;
  P.bt = bt;
  P.bts0 = bts0;
  P.nblocks = nblocks;
  P.bs = static_cast<int>(bs);
  P.G = G;
  P.D = static_cast<int>(D);
  P.scale = static_cast<float>(scale) * static_cast<float>(k_scale);   // exactly `scale` when k_scale is 1
  P.v_scale = static_cast<float>(v_scale);
  P.window = window;
  P.groups = groups.data();
  P.items = items.data();
  P.nitems = static_cast<int>(items.size());
  P.max_rows = max_rows;
  P.part_stats = slots ? part_stats.data() : nullptr;
  P.part_acc = slots ? part_acc.data() : nullptr;

  const Dtype dt = st == ScalarType::Float ? F32 : st == ScalarType::BFloat16 ? BF16 : F16;
  const int64_t best = attention_isa();  // 3: AVX-512 with the bfloat16 path
  const int use_isa = static_cast<int>(isa < 0 ? best : std::min(isa, best));
  P.bf16 = use_isa == 3;
  P.kv = kv;
  const size_t ws_floats = scratch_floats(max_rows, static_cast<int>(D));
  std::atomic<int> next{0};
  const int64_t nworkers = std::min<int64_t>(nthreads, P.nitems);
  auto body = [&](int64_t, int64_t) {
    thread_local std::vector<float> ws;
    if (ws.size() < ws_floats) ws.resize(ws_floats);
    run_work(P, dt, kv, use_isa, next, ws.data());
  };
  if (nworkers <= 1) body(0, 1);
  else torch::stable::parallel_for(0, nworkers, 1, body);

  if (slots > 0) {
    std::vector<int> split;
    for (size_t gi = 0; gi < groups.size(); ++gi)
      if (groups[gi].nparts > 1) split.push_back(static_cast<int>(gi));
    auto merge = [&](int64_t s0, int64_t s1) {
      for (int64_t i = s0; i < s1; ++i) {
        const Group& g = groups[split[i]];
        if (dt == F32) merge_group<float>(P, g);
        else if (dt == BF16) merge_group<c10::BFloat16>(P, g);
        else merge_group<c10::Half>(P, g);
      }
    };
    if (split.size() <= 1) merge(0, static_cast<int64_t>(split.size()));
    else torch::stable::parallel_for(0, static_cast<int64_t>(split.size()), 1, merge);
  }
  for (int b : fresh) brcpu::sdpa_fresh(q, k_cache, v_cache, qsl[b], lens[b], bt + b * bts0, scale, out);
  return out;
}

int64_t cpu_isa() { return best_isa(); }
// how many tiles ahead decode prefetches a bfloat16 cache (1 or 2; cpu_attention_bf16.h); returns the old value
int64_t set_kv_prefetch(int64_t tiles) {
  STD_TORCH_CHECK(tiles == 1 || tiles == 2, "set_kv_prefetch: 1 or 2 tiles, got ", tiles);
#ifdef BR_X86_DISPATCH
  return kv_prefetch_tiles.exchange(tiles);
#else
  return tiles;
#endif
}

}  // namespace

namespace brcpu {  // for ops composed of these (ops.h)
Tensor paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_start_loc, Tensor seq_lens,
                       Tensor block_tables, double scale, int64_t sliding_window, int64_t isa, double k_scale,
                       double v_scale, int64_t sdpa_from) {
  return ::paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, sliding_window, isa,
                           k_scale, v_scale, sdpa_from);
}
}  // namespace brcpu

STABLE_TORCH_LIBRARY(batchrun_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_start_loc, Tensor seq_lens, "
        "Tensor block_tables, float scale, int sliding_window, int isa=-1, float k_scale=1.0, "
        "float v_scale=1.0, int sdpa_from=-1) -> Tensor");
  m.def("cpu_isa() -> int");
  m.def("attention_isa() -> int");
  m.def("set_kv_prefetch(int tiles) -> int");
}

STABLE_TORCH_LIBRARY_IMPL(batchrun_cpu, CPU, m) {
  m.impl("paged_attention", TORCH_BOX(&paged_attention));
}

STABLE_TORCH_LIBRARY_IMPL(batchrun_cpu, CompositeExplicitAutograd, m) {
  m.impl("cpu_isa", TORCH_BOX(&cpu_isa));
  m.impl("attention_isa", TORCH_BOX(&attention_isa));
  m.impl("set_kv_prefetch", TORCH_BOX(&set_kv_prefetch));
}
