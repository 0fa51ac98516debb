// Split-K combine: out[row] = sum_s w_s acc_s / sum_s w_s l_s * v_scale * 2^8 with
// w_s = 2^(m_s - max_s m_s), in a fixed order that depends on num_splits only (deterministic,
// no atomics). Splits that saw nothing have m_s = -inf, so w_s = 0 (and acc_s = 0).
#pragma once

#include "sm70attn/params.h"
#include "sm70attn/traits.h"
#include "sm70attn/utils.h"

namespace sm70attn {

template <int VPL> struct FloatVec;
template <> struct FloatVec<2> {
  static __device__ __forceinline__ void load(const float* s, float* d) {
    const float2 x = *reinterpret_cast<const float2*>(s);
    d[0] = x.x, d[1] = x.y;
  }
};
template <> struct FloatVec<4> {
  static __device__ __forceinline__ void load(const float* s, float* d) {
    const float4 x = *reinterpret_cast<const float4*>(s);
    d[0] = x.x, d[1] = x.y, d[2] = x.z, d[3] = x.w;
  }
};
template <> struct FloatVec<8> {
  static __device__ __forceinline__ void load(const float* s, float* d) {
    FloatVec<4>::load(s, d);
    FloatVec<4>::load(s + 4, d + 4);
  }
};

// One CTA per output row of [B * H_q * Q]; warp w sums splits w, w + WARPS, ... (4 in flight),
// lane holds D / 32 consecutive columns; the warps' sums are added in warp order.
template <class CT>
__global__ void __launch_bounds__(CT::THREADS) combine_kernel(const PagedAttnParams p) {
  constexpr int D = CT::D, VPL = CT::VPL, W = CT::WARPS;
  extern __shared__ __align__(128) unsigned char smem[];
  float* red_acc = reinterpret_cast<float*>(smem);  // [W][D]
  float* red_l = red_acc + W * D;                   // [W]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const i64 row = blockIdx.x;
  const int S = p.num_splits;
  const float2* ml = p.part_ml + row * S;

  float mmax = neg_inf();
  for (int s = lane; s < S; s += 32) mmax = fmaxf(mmax, ml[s].x);
  mmax = warp_max(mmax);

  float acc[VPL], l = 0.f;
#pragma unroll
  for (int i = 0; i < VPL; ++i) acc[i] = 0.f;
  if (mmax != neg_inf()) {
#pragma unroll 4
    for (int s = warp; s < S; s += W) {
      const float2 e = ml[s];
      float x[VPL];
      FloatVec<VPL>::load(p.part_acc + (row * S + s) * D + lane * VPL, x);
      const float w = exp2f(e.x - mmax);  // 0 for an empty split (its O is written as 0)
      l += w * e.y;
#pragma unroll
      for (int i = 0; i < VPL; ++i) acc[i] += w * x[i];
    }
  }
#pragma unroll
  for (int i = 0; i < VPL; ++i) red_acc[warp * D + lane * VPL + i] = acc[i];
  if (lane == 0) red_l[warp] = l;
  __syncthreads();
  if (warp != 0) return;
  l = 0.f;
#pragma unroll
  for (int i = 0; i < VPL; ++i) acc[i] = 0.f;
  for (int w = 0; w < W; ++w) {
    l += red_l[w];
#pragma unroll
    for (int i = 0; i < VPL; ++i) acc[i] += red_acc[w * D + lane * VPL + i];
  }
  const int kvh = (int)(row / p.Q % p.H_q) / p.G;
  const float f = l > 0.f ? __ldg(p.v_scale + kvh * p.v_scale_stride) * 256.f / l : 0.f;
  unsigned h[VPL / 2];
#pragma unroll
  for (int i = 0; i < VPL / 2; ++i) h[i] = pack_half2(acc[2 * i] * f, acc[2 * i + 1] * f);
  __half* dst = p.out + row * D + lane * VPL;
  if constexpr (VPL == 2) *reinterpret_cast<unsigned*>(dst) = h[0];
  else if constexpr (VPL == 4) *reinterpret_cast<uint2*>(dst) = make_uint2(h[0], h[1]);
  else *reinterpret_cast<uint4*>(dst) = make_uint4(h[0], h[1], h[2], h[3]);
}

}  // namespace sm70attn
