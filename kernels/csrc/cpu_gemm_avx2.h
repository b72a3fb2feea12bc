// bf16_linear on AVX2 + FMA machines (cpu_gemm_avx2.cpp): out [M, n] bf16 = x [M, K] bf16 (row stride xs)
// @ w.T, wp the packed weight of `blocks` blocks of 16 outputs, out's row stride os. Threads from torch's pool.
#pragma once

#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace brgemm {

// Both ISAs' threading rule: only a product of a few microseconds (under 32K multiply-adds) stays on one
// thread, since one thread streams the weights at about half the machine's memory speed.
inline bool one_thread(int64_t blocks, int64_t M, int64_t K) { return blocks * 16 * M * K < (1 << 15); }

// body(i0, i1) over [0, n) in contiguous runs that the threads claim as they come free, ~8 a thread: a static
// split into one run a thread left the first one waiting at the join whenever the other woke late or streamed
// slower (at batch 1 on Zen 1 the main thread waited ~1 ms of a 9.9 ms decode step)
template <typename F>
void parallel_runs(int64_t n, const F& body) {
  const int64_t threads = std::max<int64_t>(1, torch::stable::get_num_threads());
  const int64_t run = std::max<int64_t>(1, n / (8 * threads));
  std::atomic<int64_t> next{0};
  torch::stable::parallel_for(0, std::min(threads, (n + run - 1) / run), 1, [&](int64_t, int64_t) {
    for (int64_t i0 = next.fetch_add(run); i0 < n; i0 = next.fetch_add(run)) body(i0, std::min(n, i0 + run));
  });
}

// A product of a few rows reads each weight byte once. Ordinary loads leave those bytes in every cache level,
// so a decode step ends with the caches full of weights and the host's next step (Python, the scheduler, the
// inputs) misses on everything it touches; non-temporal loads mark them for early eviction. Whether that
// is faster depends on the CPU (AMD honours the hint on ordinary memory; Intel may not), so
// models/weight_loads.py measures it at engine start and sets this. Only 64-byte aligned weights (every
// packed tensor torch allocates) take non-temporal loads.
inline std::atomic<bool> nontemporal{false};
inline bool streams_weights(const void* wp) {
  return nontemporal.load(std::memory_order_relaxed) && reinterpret_cast<uintptr_t>(wp) % 64 == 0;
}

void avx2_linear(const uint16_t* x, int64_t xs, int64_t M, int64_t K, const uint16_t* wp, int64_t blocks,
                 uint16_t* out, int64_t os, int64_t n);

}  // namespace brgemm
