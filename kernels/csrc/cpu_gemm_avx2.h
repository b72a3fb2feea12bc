// bf16_linear on AVX2 + FMA machines (cpu_gemm_avx2.cpp): out [M, n] bf16 = x [M, K] bf16 (row stride xs)
// @ w.T, wp the packed weight of `blocks` blocks of 16 outputs, out's row stride os. Threads from torch's pool.
#pragma once

#include <cstdint>

namespace brgemm {

// Both ISAs' threading rule: threads get contiguous runs of output blocks; only a product of a few
// microseconds (under 32K multiply-adds) stays on one thread, since one thread streams the weights at about
// half the machine's memory speed.
inline bool one_thread(int64_t blocks, int64_t M, int64_t K) { return blocks * 16 * M * K < (1 << 15); }

void avx2_linear(const uint16_t* x, int64_t xs, int64_t M, int64_t K, const uint16_t* wp, int64_t blocks,
                 uint16_t* out, int64_t os, int64_t n);

}  // namespace brgemm
