// Split-K combine: out[row] = sum_s w_s acc_s / sum_s w_s l_s * v_scale * 2^8 with
// w_s = 2^(m_s - max_s m_s), in a fixed order that depends on num_splits only (deterministic,
// no atomics). Splits that saw nothing have m_s = -inf, so w_s = 0 (and acc_s = 0).
#pragma once

#include "sm70attn/params.h"
#include "sm70attn/traits.h"
#include "sm70attn/utils.h"

namespace sm70attn {

// CTA (row, column slice): 32 columns of one output row of [B * H_q * Q], one per lane. Warp w
// sums splits w, w + WARPS, ... in increasing order, U loads in flight per lane (so one call
// has rows * D * 4 * WARPS * U bytes in flight: a latency-bound combine of a few rows reads all
// of its partials at once); then the warps' sums are added in warp order.
template <class CT>
__global__ void __launch_bounds__(CT::THREADS) combine_kernel(const PagedAttnParams p) {
  constexpr int D = CT::D, W = CT::WARPS, U = CT::U, CW = CT::CW;
  extern __shared__ __align__(128) unsigned char smem[];
  float(*red_acc)[CW] = reinterpret_cast<float(*)[CW]>(smem);  // [W][CW]
  float* red_l = reinterpret_cast<float*>(smem) + W * CW;        // [W]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const i64 row = blockIdx.x;
  const int col = blockIdx.y * CW + lane;
  const int S = p.num_splits;
  const float2* ml = p.part_ml + row * S;

  float mmax = neg_inf();
  for (int s = lane; s < S; s += 32) mmax = fmaxf(mmax, ml[s].x);
  mmax = warp_max(mmax);

  float acc = 0.f, l = 0.f;
  if (mmax != neg_inf()) {
    const float* pa = p.part_acc + row * S * D + col;
    for (int s0 = warp; s0 < S; s0 += W * U) {
      float x[U];
      float2 e[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int s = s0 + u * W;
        if (s < S) x[u] = pa[(i64)s * D], e[u] = ml[s];
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (s0 + u * W < S) {
          const float w = exp2f(e[u].x - mmax);  // 0 for an empty split (its O is written as 0)
          l += w * e[u].y;
          acc += w * x[u];
        }
      }
    }
  }
  red_acc[warp][lane] = acc;
  if (lane == 0) red_l[warp] = l;
  __syncthreads();
  if (warp != 0) return;
  acc = 0.f, l = 0.f;
#pragma unroll
  for (int w = 0; w < W; ++w) l += red_l[w], acc += red_acc[w][lane];
  const int kvh = (int)(row / p.Q % p.H_q) / p.G;
  const float f = l > 0.f ? __ldg(p.v_scale + kvh * p.v_scale_stride) * 256.f / l : 0.f;
  p.out[row * D + col] = __float2half_rn(acc * f);
}

}  // namespace sm70attn
