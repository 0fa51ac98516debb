// One warp runs one product of an MMA atom (mma_atoms.h) with every operand gathered from
// and the result scattered to global memory through the atom's element maps: D[g] = A[g] B[g] +
// C[g] per group g (a quad-pair of m8n8k4, the warp for m16n8k16), row-major A [G, M, K] and
// B [G, K, N] fp16, C and D [G, M, N] fp32. If the maps are the hardware's, D equals the product
// a reference computes from the same arrays (tests/test_cuda.py); the CPU emulator runs it too.
#pragma once

#include "sm70attn/mma_atoms.h"
#include "sm70attn/traits.h"

namespace sm70attn {

template <class At>
__global__ void mma_check_kernel(const __half* A, const __half* B, const float* C, float* D) {
  const int lane = threadIdx.x & 31, g = At::group(lane);
  const __half* a_g = A + g * At::M * At::K;
  const __half* b_g = B + g * At::K * At::N;
  unsigned a[At::A / 2], b[At::B / 2];
  float c[At::C], d[At::C];
  for (int j = 0; j < At::A / 2; ++j)
    a[j] = pack_halves(a_g[At::a_row(lane, 2 * j) * At::K + At::a_col(lane, 2 * j)],
                       a_g[At::a_row(lane, 2 * j + 1) * At::K + At::a_col(lane, 2 * j + 1)]);
  for (int j = 0; j < At::B / 2; ++j)
    b[j] = pack_halves(b_g[At::b_row(lane, 2 * j) * At::N + At::b_col(lane, 2 * j)],
                       b_g[At::b_row(lane, 2 * j + 1) * At::N + At::b_col(lane, 2 * j + 1)]);
  for (int i = 0; i < At::C; ++i) c[i] = C[(g * At::M + At::c_row(lane, i)) * At::N + At::c_col(lane, i)];
  mma_atom(At{}, d, a, b, c);
  for (int i = 0; i < At::C; ++i) D[(g * At::M + At::c_row(lane, i)) * At::N + At::c_col(lane, i)] = d[i];
}

}  // namespace sm70attn
