// Split-K combine: out[row] = sum_s w_s 2^e_s o_s / sum_s w_s l_s * v_scale * 2^8 * 2^-12 with
// w_s = 2^(m_s - max_s m_s), o_s the split's partial O (fp16, acc_s 2^(12 - e_s), 2^e_s the
// power of two of its row sum l_s: params.h, utils.h), in a fixed order that depends on
// num_splits only (deterministic, no atomics). Splits that saw nothing have m_s = -inf, so
// w_s = 0 (and l_s = 0, o_s = 0).
#pragma once

#include "sm70attn/params.h"
#include "sm70attn/traits.h"
#include "sm70attn/utils.h"

namespace sm70attn {

// CTA (row block, column slice): 64 columns, two adjacent ones per lane (one 4-byte load of a
// partial, one (m, l) load and one exp2 serve both), of CT::ROWS consecutive output rows
// of [B * H_q * Q]; warp w serves row w / WPR. The WPR warps of a row fold its splits
// k, k + WPR, ... (k = w % WPR) in increasing order into a running (max, sum, acc) (one pass
// over the partials, U loads in flight per lane: a latency-bound combine of a few rows reads
// all of its partials at once); then, with WPR > 1, the row's warps' results are merged in warp
// order. The order depends on num_splits only (WPR is a function of it). Splits that saw
// nothing (m = -inf) weigh 0; a NaN partial makes the row NaN. With WPR = 1 and S <= 16 the
// sums are those of WPR = 16 term by term: one pass adds w_s x_s in split order either way.
template <class CT>
__global__ void __launch_bounds__(CT::THREADS, CT::MIN_BLOCKS) combine_kernel(const PagedAttnParams p) {
  constexpr int D = CT::D, W = CT::WARPS, WPR = CT::WPR, U = CT::U, CW = CT::CW;
  extern __shared__ __align__(128) unsigned char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sub = warp % WPR;
  const i64 row = (i64)blockIdx.x * CT::ROWS + warp / WPR;
  const bool live = row < (i64)p.B * p.H_q * p.Q;  // the last CTA's rows may run past the end
  const int col = blockIdx.y * CW + 2 * lane;
  const int S = p.num_splits;
  const float2* ml = p.part_ml + row * S;
  const unsigned* pa = reinterpret_cast<const unsigned*>(p.part_acc + row * S * D + col);  // 2 halves

  float m = neg_inf(), l = 0.f, acc0 = 0.f, acc1 = 0.f;  // this warp's running max, sum, columns
  for (int s0 = live ? sub : S; s0 < S; s0 += WPR * U) {
    unsigned x[U];
    float2 e[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int s = s0 + u * WPR;
      x[u] = 0u, e[u] = make_float2(neg_inf(), 0.f);
      if (s < S) x[u] = pa[(i64)s * (D / 2)], e[u] = ml[s];
      // A split whose sum is NaN (NaN in its query row or k_scale: fmaxf left its max at
      // -inf) gets max +inf, so it weighs NaN and the row comes out NaN, not 0.
      if (e[u].y != e[u].y) e[u].x = -neg_inf();
    }
    float mx = m;
#pragma unroll
    for (int u = 0; u < U; ++u) mx = fmaxf(mx, e[u].x);
    if (mx != neg_inf()) {
      const float r = exp2f(m - mx);  // m = -inf: 0 (acc and l are 0 then)
      acc0 *= r, acc1 *= r, l *= r;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float w = exp2f(e[u].x - mx);  // 0 for an empty split (its O is written as 0)
        const float wo = w * partial_weight(e[u].y);
        l += w * e[u].y;
        acc0 += wo * __half2float(__ushort_as_half((unsigned short)(x[u] & 0xffffu)));
        acc1 += wo * __half2float(__ushort_as_half((unsigned short)(x[u] >> 16)));
      }
      m = mx;
    }
  }
  if (WPR > 1) {
    float2(*red_acc)[CW / 2] = reinterpret_cast<float2(*)[CW / 2]>(smem);  // [W][CW / 2]
    float* red_l = reinterpret_cast<float*>(smem) + W * CW;                // [W]
    float* red_m = red_l + W;                                              // [W]
    red_acc[warp][lane] = make_float2(acc0, acc1);
    if (lane == 0) red_l[warp] = l, red_m[warp] = m;
    __syncthreads();
    if (sub != 0) return;
    const int w0 = warp;  // the row's warps: w0 .. w0 + WPR - 1
    float mmax = neg_inf();
#pragma unroll
    for (int w = 0; w < WPR; ++w) mmax = fmaxf(mmax, red_m[w0 + w]);
    acc0 = 0.f, acc1 = 0.f, l = 0.f;
    if (mmax != neg_inf()) {
#pragma unroll
      for (int w = 0; w < WPR; ++w) {
        const float r = exp2f(red_m[w0 + w] - mmax);
        const float2 a = red_acc[w0 + w][lane];
        l += r * red_l[w0 + w], acc0 += r * a.x, acc1 += r * a.y;
      }
    }
  }
  // (row and column read again: not held across the loop)
  const i64 orow = (i64)reg_again<CTAID_X>() * CT::ROWS + (reg_again<TID_X>() >> 5) / WPR;
  if (orow >= (i64)p.B * p.H_q * p.Q) return;
  const int kvh = (int)(orow / p.Q % p.H_q) / p.G;
  // 2^8 (the kernels' units) x 2^-12 (the partials' headroom: utils.h, partial_scale)
  const float f = l > 0.f ? __ldg(p.v_scale + kvh * p.v_scale_stride) * 0x1p-4f / l : 0.f;
  *reinterpret_cast<unsigned*>(p.out + orow * D + blockIdx.y * CW + 2 * (reg_again<TID_X>() & 31)) =
      pack_half2(acc0 * f, acc1 * f);
}

}  // namespace sm70attn
