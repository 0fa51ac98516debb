// Where a paged_attention CTA works (varlen.h places paged_attention_varlen's): the prologue the
// WMMA kernel (paged_attention.cuh) and the register-fragment kernel (paged_attention_rf.cuh)
// share. blockIdx.x is (request b, KV head, row group), blockIdx.y the context split.
#pragma once

#include "sm70attn/params.h"

namespace sm70attn {

struct CtaSpan {
  int b, kvh;
  int row0, nrows;      // the row group's first row (m = g * Q + r) and its rows (at most ROWS)
  i64 out_row0;         // [B*H_q*Q] row index of local row 0
  int len;              // the request's length, clamped to capacity
  int t_begin, t_end;   // the split's tokens
};

// This split's tokens: ceil(len / num_splits) rounded up to whole tiles of N, so the work follows
// the actual length while the grid depends on shapes only. Lengths are clamped to capacity.
template <int ROWS, int N>
__device__ __forceinline__ CtaSpan cta_span(const PagedAttnParams& p, int split) {
  CtaSpan c;
  const int bkv = fastdiv(blockIdx.x, p.div_rg), rg = blockIdx.x - bkv * p.row_groups;
  c.b = fastdiv(bkv, p.div_hkv), c.kvh = bkv - c.b * p.H_kv;
  c.row0 = rg * ROWS, c.nrows = min(ROWS, p.rows - c.row0);
  c.out_row0 = ((i64)c.b * p.H_q + (i64)c.kvh * p.G) * p.Q + c.row0;

  const int capacity = p.max_pages * p.page_size;
  c.len = min(max(p.seq_lens[c.b * p.seq_lens_stride], 0), capacity);
  const int chunk = (fastdiv(c.len + p.num_splits - 1, p.div_splits) + N - 1) / N * N;
  c.t_begin = (int)min((i64)c.len, (i64)split * chunk);
  c.t_end = min(c.len, c.t_begin + chunk);
  return c;
}

// Eight float16 of a query row (src: their first) from global memory: one 16-byte load where the
// query's rows allow it (p.q_vec16), else eight 2-byte loads.
__device__ __forceinline__ uint4 load_q8(const __half* src, bool vec16) {
  uint4 x;
  if (vec16) {
    x = __ldg(reinterpret_cast<const uint4*>(src));
  } else {
    const unsigned short* s = reinterpret_cast<const unsigned short*>(src);
    x.x = __ldg(s + 0) | (unsigned)__ldg(s + 1) << 16;
    x.y = __ldg(s + 2) | (unsigned)__ldg(s + 3) << 16;
    x.z = __ldg(s + 4) | (unsigned)__ldg(s + 5) << 16;
    x.w = __ldg(s + 6) | (unsigned)__ldg(s + 7) << 16;
  }
  return x;
}

}  // namespace sm70attn
