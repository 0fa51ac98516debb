// paged_attention_varlen: packed requests of any row counts (prompts, chunks over a past,
// decodes, verifies) in one launch of the attention kernel's CTA (paged_attention.cuh:
// attend_cta) over varlen.h's VarlenCta (64-row tiles of a request's position-major rows,
// causal), then, where a request split its context, combine_varlen_kernel over its units.
#pragma once

#include "sm70attn/paged_attention.cuh"
#include "sm70attn/varlen.h"

namespace sm70attn {

// The tile loop: a CTA per (tile, KV head) and split (VarlenCta).
template <class KT>
__global__ void __launch_bounds__(KT::THREADS, KT::MIN_BLOCKS)
    paged_attention_varlen_kernel(const PagedAttnParams p) {
  attend_cta<KT, VarlenCta<KT>>(p);
}

// The combine of split requests: CTA u takes unit u's 8 tokens x H_q rows (none if its head says
// 0 tokens: the unit is unused), a warp a row, two adjacent columns a lane per 64; the row's
// splits in increasing order (deterministic: the order depends on the request's split count
// only). Math as combine.cuh's: weights 2^(m_s - max m), the partials' 2^12 taken out at the end,
// a NaN sum makes the row NaN. (CombineVarlenTraits: traits.h.)
template <class CT>
__global__ void __launch_bounds__(CT::THREADS, CT::MIN_BLOCKS) combine_varlen_kernel(const PagedAttnParams p) {
  constexpr int D = CT::D, C = D / 64;
  const int* head = p.unit_head + 4 * blockIdx.x;
  const int tok0 = head[0], count = head[1], S = head[2];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int r = warp; r < count * p.H_q; r += CT::WARPS) {
    const int j = r / p.H_q, h = r - j * p.H_q;
    const i64 k = ((i64)blockIdx.x * 8 + j) * p.H_q + h;  // the unit row
    const float2* ml = p.part_ml + k * p.split_cap;
    const __half* pa = p.part_acc + k * p.split_cap * D + 2 * lane;
    float mx = neg_inf();
    for (int s = 0; s < S; ++s) {
      const float2 e = ml[s];
      mx = fmaxf(mx, e.y != e.y ? -neg_inf() : e.x);
    }
    float l = 0.f, acc[C][2] = {};
    if (mx != neg_inf()) {
      for (int s = 0; s < S; ++s) {
        float2 e = ml[s];
        if (e.y != e.y) e.x = -neg_inf();
        const float w = exp2f(e.x - mx), wo = w * partial_weight(e.y);  // 0 for an empty split
        l += w * e.y;
#pragma unroll
        for (int c = 0; c < C; ++c) {
          const unsigned x = *reinterpret_cast<const unsigned*>(pa + (i64)s * D + 64 * c);
          acc[c][0] += wo * __half2float(__ushort_as_half((unsigned short)(x & 0xffffu)));
          acc[c][1] += wo * __half2float(__ushort_as_half((unsigned short)(x >> 16)));
        }
      }
    }
    const int kvh = h / p.G;
    const float f = l > 0.f ? __ldg(p.v_scale + kvh * p.v_scale_stride) * 0x1p-4f / l : 0.f;
    __half* out = p.out + ((i64)(tok0 + j) * p.H_q + h) * D + 2 * lane;
#pragma unroll
    for (int c = 0; c < C; ++c) *reinterpret_cast<unsigned*>(out + 64 * c) = pack_half2(acc[c][0] * f, acc[c][1] * f);
  }
}

}  // namespace sm70attn
