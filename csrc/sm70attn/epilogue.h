// The attention kernels' epilogues, over a CTA's rows (cta.h's interface): the split that sees
// nothing, and O staged in shared memory (fp32, [ROWS][ELD], columns in the permuted D order of
// e4m3.h: positions 0..3 of a group hold d0, d2, d1, d3) -> coalesced fp16 rows of out
// (normalised, * v_scale * 2^8) or of the split's partials (params.h), which the combine kernels
// (combine.cuh, varlen.cuh) fold.
#pragma once

#include "sm70attn/params.h"
#include "sm70attn/utils.h"

namespace sm70attn {

// Eight staged O columns (e0, e1: a group of 8, permuted) times f as fp16 in D order.
__device__ __forceinline__ uint4 pack8(const float4& e0, const float4& e1, float f) {
  return make_uint4(pack_half2(e0.x * f, e0.z * f), pack_half2(e0.y * f, e0.w * f), pack_half2(e1.x * f, e1.z * f),
                    pack_half2(e1.y * f, e1.w * f));
}

// Nothing to see (t_begin >= t_end): zero rows, or an empty partial (m = -inf, l = 0, O = 0).
template <class KT, class Cta>
__device__ __forceinline__ void store_empty(const PagedAttnParams& p, const Cta& cta, int tid) {
  constexpr int D = KT::D;
  for (int c = tid; c < cta.nrows * (D / 8); c += KT::THREADS)
    *reinterpret_cast<uint4*>(cta.dst_row(p, c / (D / 8)) + c % (D / 8) * 8) = make_uint4(0u, 0u, 0u, 0u);
  if (cta.splits(p) > 1)
    for (int lr = tid; lr < cta.nrows; lr += KT::THREADS) *cta.ml_slot(p, lr, cta.split) = make_float2(neg_inf(), 0.f);
}

// One split: out = O / l * v_scale * 2^8 (0 for a row that saw nothing).
template <class KT, class Cta>
__device__ __forceinline__ void store_out(const PagedAttnParams& p, const Cta& cta, const float* Es,
                                          const float* row_l, int tid) {
  constexpr int D = KT::D;
  const float vsc = __ldg(p.v_scale + cta.kvh * p.v_scale_stride) * 256.f;
  for (int c = tid; c < cta.nrows * (D / 8); c += KT::THREADS) {
    const int lr = c / (D / 8), part = c % (D / 8);
    const float l = row_l[lr], f = l > 0.f ? vsc / l : 0.f;
    const float4 e0 = *reinterpret_cast<const float4*>(Es + lr * KT::ELD + part * 8);
    const float4 e1 = *reinterpret_cast<const float4*>(Es + lr * KT::ELD + part * 8 + 4);
    __half* dst = cta.out_row(p, lr);
    *reinterpret_cast<uint4*>(dst + part * 8) = pack8(e0, e1, f);
  }
}

// Several splits: the split's partial O (times partial_scale(l)) and its (m, l).
template <class KT, class Cta>
__device__ __forceinline__ void store_partials(const PagedAttnParams& p, const Cta& cta, const float* Es,
                                               const float* row_m, const float* row_l, int tid) {
  constexpr int D = KT::D;
  const int sp = reg_again<CTAID_Y>();  // (= the split, read again: not held across the loop)
  for (int c = tid; c < cta.nrows * (D / 4); c += KT::THREADS) {
    const int lr = c / (D / 4), part = c % (D / 4);
    const float f = partial_scale(row_l[lr]);
    const float4 e = *reinterpret_cast<const float4*>(Es + lr * KT::ELD + part * 4);  // d0, d2, d1, d3
    __half* dst = cta.part_row(p, lr, sp);
    *reinterpret_cast<uint2*>(dst + part * 4) = make_uint2(pack_half2(e.x * f, e.z * f), pack_half2(e.y * f, e.w * f));
  }
  for (int lr = tid; lr < cta.nrows; lr += KT::THREADS) *cta.ml_slot(p, lr, sp) = make_float2(row_m[lr], row_l[lr]);
}

}  // namespace sm70attn
