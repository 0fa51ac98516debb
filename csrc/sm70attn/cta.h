// Where a CTA works: the request, KV head, rows and context split it takes, which positions
// each of its rows sees, where its query rows are read and its output rows written. The
// attention kernels are written against this interface; PagedCta (here) is paged_attention's,
// VarlenCta (varlen.h) paged_attention_varlen's. Every CTA work type has
//   b, kvh, row0, nrows, len, t_begin, t_end, split
//                         request, KV head, its first row and rows (at most ROWS), the request's
//                         length (clamped to capacity), the split's tokens [t_begin, t_end), split
//   init(p, split, smem)  false: no work (CTA-uniform; the CTA returns)
//   prologue(p, tid)      what the CTA writes before its tiles
//   splits(p)             the context splits of its rows (1: the output written directly)
//   q_row(p, lr, part)    the query's halves [8 part, 8 part + 8) of local row lr
//   last(p, lr)           the last position local row lr sees (last_visible; -1: a padding row)
//   dst_row(p, lr)        where row lr goes: out, or with splits this split's fp16 partial row
//   out_row(p, lr)        its row of out (splits(p) == 1)
//   part_row(p, lr, sp)   its partial row of split sp (splits(p) > 1)
//   ml_slot(p, lr, sp)    that partial's (m, l) slot
// (params.h has the partials' format, utils.h partial_scale.)
#pragma once

#include "sm70attn/params.h"

namespace sm70attn {

// The visibility rule, the op's one causal rule: row i of a request of q query rows whose
// length len counts them sees the positions t <= len - q + i: its past (len - q tokens) and its
// own rows up to itself (a decode's row the whole context, a prompt's rows their prefix, a
// chunk's rows the past and their prefix). Padding rows see none. A CTA's row m is (token i,
// query head) by its kernel's row packing: m = g Q + i (paged_attention, head-major) or
// m = i G + g (varlen, position-major).
__device__ __forceinline__ int last_visible(int past, int i) { return past + i; }

// paged_attention's CTA: blockIdx.x is (request b, KV head, row group), blockIdx.y the context
// split; rows m = g * Q + r, which is also their order in out [B, H_q, Q, D].
template <class KT>
struct PagedCta {
  int b, kvh;
  int row0, nrows;
  i64 out_row0;  // [B*H_q*Q] row index of local row 0
  int len;
  int t_begin, t_end;
  int split;

  // This split's tokens: ceil(len / num_splits) rounded up to whole tiles of N, so the work
  // follows the actual length while the grid depends on shapes only.
  __device__ __forceinline__ bool init(const PagedAttnParams& p, int split_, unsigned char*) {
    split = split_;
    const int bkv = fastdiv(blockIdx.x, p.div_rg), rg = blockIdx.x - bkv * p.row_groups;
    b = fastdiv(bkv, p.div_hkv), kvh = bkv - b * p.H_kv;
    row0 = rg * KT::ROWS, nrows = min(KT::ROWS, p.rows - row0);
    out_row0 = ((i64)b * p.H_q + (i64)kvh * p.G) * p.Q + row0;

    const int capacity = p.max_pages * p.page_size;
    len = min(max(p.seq_lens[b * p.seq_lens_stride], 0), capacity);
    const int chunk = (fastdiv(len + p.num_splits - 1, p.div_splits) + KT::N - 1) / KT::N * KT::N;
    t_begin = (int)min((i64)len, (i64)split * chunk);
    t_end = min(len, t_begin + chunk);
    return true;
  }
  __device__ __forceinline__ void prologue(const PagedAttnParams&, int) const {}
  __device__ __forceinline__ int splits(const PagedAttnParams& p) const { return p.num_splits; }

  // Local row lr: m = row0 + lr = g Q + r, row r of query head kvh G + g.
  __device__ __forceinline__ const __half* q_row(const PagedAttnParams& p, int lr, int part) const {
    const int m = row0 + lr, g = fastdiv(m, p.div_q), r = m - g * p.Q;
    return p.q + b * p.q_stride_b + (i64)(kvh * p.G + g) * p.q_stride_h + r * p.q_stride_r + part * 8;
  }
  __device__ __forceinline__ int last(const PagedAttnParams& p, int lr) const {
    const int m = row0 + lr;
    return lr < nrows ? last_visible(len - p.Q, m - fastdiv(m, p.div_q) * p.Q) : -1;
  }
  // (last() from values the caller holds: the same rule; as a separate function its compare keeps
  // the operand order the register-fragment kernel's code was built with)
  static __device__ __forceinline__ int last_of(const PagedAttnParams& p, int row0, int nrows, int len, int lr) {
    const int m = row0 + lr;
    return lr < nrows ? last_visible(len - p.Q, m - fastdiv(m, p.div_q) * p.Q) : -1;
  }

  // The rows of the CTA whose local row 0 is out row `row0` (the register-fragment kernel keeps
  // row0 and the split in shared memory and passes them back).
  static __device__ __forceinline__ __half* dst_row_of(const PagedAttnParams& p, i64 row0, int sp, int lr) {
    return p.num_splits == 1 ? p.out + (row0 + lr) * KT::D : p.part_acc + ((row0 + lr) * p.num_splits + sp) * KT::D;
  }
  static __device__ __forceinline__ float2* ml_slot_of(const PagedAttnParams& p, i64 row0, int lr, int sp) {
    return p.part_ml + (row0 + lr) * p.num_splits + sp;
  }
  __device__ __forceinline__ __half* dst_row(const PagedAttnParams& p, int lr) const {
    return dst_row_of(p, out_row0, split, lr);
  }
  __device__ __forceinline__ __half* out_row(const PagedAttnParams& p, int lr) const {
    return p.out + (out_row0 + lr) * KT::D;
  }
  __device__ __forceinline__ __half* part_row(const PagedAttnParams& p, int lr, int sp) const {
    return p.part_acc + ((out_row0 + lr) * p.num_splits + sp) * KT::D;
  }
  __device__ __forceinline__ float2* ml_slot(const PagedAttnParams& p, int lr, int sp) const {
    return ml_slot_of(p, out_row0, lr, sp);
  }
};

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
