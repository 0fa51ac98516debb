// paged_attention_varlen's work split, on the device (no host read of the metadata, so a CUDA
// graph replays it for any lengths): which request and rows a CTA takes, and whether that
// request splits its context.
//
// Requests: query_start_loc is read as its running maximum over entries 1 .. B, clamped to
// [0, T]: request b's tokens are [e_{b-1}, e_b) (e_{-1} = 0), so for any metadata every token
// of [0, T) belongs to exactly one request, and the tokens from e_{B-1} on to a padding request
// of length 0 (its rows are written 0). For valid metadata (0 first, non-decreasing, at most T)
// these are the requests as given. Lengths are clamped to [0, capacity].
// Rows: request b's q tokens give q * G rows per KV head, position-major (row m = i * G + g:
// token i, query head kvh * G + g), cut into tiles of ROWS rows; the grid's x covers an upper
// bound of the tiles (ceil(T G / ROWS) + B + 1) times H_kv, y the most splits (split_cap).
// Splits: see params.h. They depend on the request's own tokens and length and on shapes and
// the device, never on the other requests, so long as the split requests before it fit in the
// units (else it runs unsplit: the same values, other roundings).
#pragma once

#include "sm70attn/cta.h"
#include "sm70attn/params.h"
#include "sm70attn/traits.h"
#include "sm70attn/utils.h"

namespace sm70attn {

// The CTA's request and tile, in shared memory (read again at each use, volatile: values the
// tile loop does not need are not held in registers across it).
struct VarlenTile {
  volatile int* s;
  __device__ int b() const { return s[0]; }       // request (B: the padding request); < 0: no tile
  __device__ int start() const { return s[1]; }   // its first token
  __device__ int q() const { return s[2]; }       // its tokens
  __device__ int len() const { return s[3]; }     // its length (clamped)
  __device__ int row0() const { return s[4]; }    // the tile's first row among the request's q * G
  __device__ int splits() const { return s[5]; }  // context splits (1: the output written directly)
  __device__ int unit() const { return s[6]; }    // its first unit (splits > 1)
};

// Warp 0 scans the requests 32 at a time (inclusive scans of the running end, the tiles and
// the units); the tile's request is handed to the CTA through shared memory (sh, 7 ints).
// Every thread calls it (one barrier). The requests of more than pf_min_q tokens (the padding
// request B too) are the prefill kernel's (prefill.cuh, PREFILL: tiles of PF_ROWS rows), the
// others the tile loop's (tiles of OLD_ROWS); both kernels scan every request alike, so the
// split units (in request order, one budget) are numbered the same in both. A request's splits
// depend on its own tokens and length and on shapes (the split target over its CTAs in its own
// kernel).
template <int OLD_ROWS, int PF_ROWS, bool PREFILL>
__device__ __forceinline__ VarlenTile varlen_scan(const PagedAttnParams& p, int tile, int* sh) {
  if (threadIdx.x < 32) {
    const unsigned all = 0xffffffffu;
    const int lane = threadIdx.x, capacity = p.max_pages * p.page_size;
    int carry_end = 0, carry_tiles = 0, carry_units = 0;
    bool found = false;
    for (int c = 0; c <= p.B && !found; c += 32) {
      const int b = c + lane;
      int e = 0, len = 0;
      if (b < p.B) {
        e = min(max(__ldg(p.qsl + b + 1), 0), p.T);
        len = min(max(__ldg(p.seq_lens + (i64)b * p.seq_lens_stride), 0), capacity);
      } else if (b == p.B) {
        e = p.T;
      }
      int end = max(e, carry_end), tiles_incl, units_incl;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(all, end, o);
        if (lane >= o) end = max(end, y);
      }
      int start = __shfl_up_sync(all, end, 1);
      if (lane == 0) start = carry_end;
      const int q = end - start;  // 0 past the padding request
      const bool pf = q > p.pf_min_q;
      const int kind_tiles = (q * p.G + (pf ? PF_ROWS : OLD_ROWS) - 1) / (pf ? PF_ROWS : OLD_ROWS);
      const int tiles = pf == PREFILL ? kind_tiles : 0;
      int splits = 1, units = 0;
      if (b < p.B && q > 0 && q <= p.split_q && p.split_cap > 1) {
        splits = min(p.split_cap, (len + p.split_tokens - 1) / p.split_tokens);
        splits = max(1, min(splits, (pf ? p.pf_split_target : p.split_target) / (kind_tiles * p.H_kv)));
        if (splits > 1) units = (q + 7) / 8;
      }
      tiles_incl = tiles, units_incl = units;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int t = __shfl_up_sync(all, tiles_incl, o), u = __shfl_up_sync(all, units_incl, o);
        if (lane >= o) tiles_incl += t, units_incl += u;
      }
      tiles_incl += carry_tiles, units_incl += carry_units;
      if (units > 0 && units_incl > p.units) splits = 1, units = 0;  // over the budget
      const bool mine = tile >= tiles_incl - tiles && tile < tiles_incl;
      found = __ballot_sync(all, mine) != 0u;
      if (mine) {
        const int rows = PREFILL ? PF_ROWS : OLD_ROWS;
        sh[0] = b, sh[1] = start, sh[2] = q, sh[3] = len;
        sh[4] = (tile - (tiles_incl - tiles)) * rows, sh[5] = splits, sh[6] = units_incl - units;
      }
      carry_end = __shfl_sync(all, end, 31), carry_tiles = __shfl_sync(all, tiles_incl, 31);
      carry_units = __shfl_sync(all, units_incl, 31);
    }
    if (lane == 0 && !found) sh[0] = -1;
  }
  __syncthreads();
  return VarlenTile{sh};
}

// paged_attention_varlen's CTA (cta.h's interface), of its tile loop (PREFILL false: varlen.cuh)
// or of its prefill kernel (PREFILL: prefill.cuh, which runs the grid backwards: a request's last
// tiles, which see the most tokens, start first, and the grid's empty tail at once): blockIdx.x
// is (tile, KV head), blockIdx.y the context split; rows position-major (m = i G + g: token i of
// the request, query head kvh G + g), out [T, H_q, D], a split request's partials by unit
// (params.h). The tile's values other than its rows and tokens are read again from shared memory
// at each use (VarlenTile; at(): the CTA again from them, after the tile loop).
template <class KT, bool PREFILL = false>
struct VarlenCta {
  int b, kvh;
  int row0, nrows;
  int len;
  int t_begin, t_end;
  int split;
  int row_end;  // row0 + nrows (one sum: the split's tokens and the unit heads both read it)
  VarlenTile vt{nullptr};

  // Where the scan hands the CTA its tile (7 ints of shared memory).
  static __device__ __forceinline__ int* tile_smem(unsigned char* smem) {
    if constexpr (PREFILL) {
      return reinterpret_cast<int*>(smem + KT::TILE_OFF);
    } else {
      return reinterpret_cast<int*>(smem + KT::SMEM_BYTES);
    }
  }
  // blockIdx.x, backwards for the prefill kernel.
  static __device__ __forceinline__ int cta_x() {
    if constexpr (PREFILL) {
      return (int)gridDim.x - 1 - reg_again<CTAID_X>();
    } else {
      return blockIdx.x;
    }
  }

  __device__ __forceinline__ bool init(const PagedAttnParams& p, int split_, unsigned char* smem) {
    const int tile = fastdiv(cta_x(), p.div_hkv);
    const VarlenTile t = varlen_scan<16 * varlen_row_blocks(), prefill_rows(KT::D), PREFILL>(p, tile, tile_smem(smem));
    return at(p, t, cta_x() - tile * p.H_kv, split_);
  }

  // The CTA of a scanned tile: its rows and its split's tokens (up to what its last row sees,
  // causal, split evenly in whole tiles); false past the last tile or split.
  __device__ __forceinline__ bool at(const PagedAttnParams& p, VarlenTile t, int kvh_, int split_) {
    vt = t, kvh = kvh_, split = split_;
    if (vt.b() < 0 || split >= vt.splits()) return false;  // past the last tile or split
    b = vt.b(), row0 = vt.row0(), nrows = min(KT::ROWS, vt.q() * p.G - row0), len = vt.len();
    row_end = nrows + row0;
    const int splits = vt.splits();
    const int seen = min(len, max(0, last_visible(len - vt.q(), fastdiv(row_end - 1, p.div_g)) + 1));
    const int chunk = ((seen + splits - 1) / splits + KT::N - 1) / KT::N * KT::N;
    t_begin = min(seen, split * chunk);
    t_end = min(seen, t_begin + chunk);
    return true;
  }

  // The heads of the request's units, for combine_varlen_kernel (by the CTA whose tile holds
  // row g = 0 of the unit's first token).
  __device__ __forceinline__ void prologue(const PagedAttnParams& p, int tid) const {
    if (vt.splits() > 1 && kvh == 0 && split == 0 && tid == 0)
      for (int i = (row0 + 8 * p.G - 1) / (8 * p.G) * 8; i * p.G < row_end; i += 8) {
        int* h = p.unit_head + 4 * (vt.unit() + i / 8);
        h[0] = vt.start() + i, h[1] = min(8, vt.q() - i), h[2] = vt.splits(), h[3] = b;
      }
  }
  __device__ __forceinline__ int splits(const PagedAttnParams&) const { return vt.splits(); }

  __device__ __forceinline__ const __half* q_row(const PagedAttnParams& p, int lr, int part) const {
    const int m = row0 + lr, i = fastdiv(m, p.div_g), g = m - i * p.G;
    return p.q + (i64)(vt.start() + i) * p.q_stride_b + (i64)(kvh * p.G + g) * p.q_stride_h + part * 8;
  }
  __device__ __forceinline__ int last(const PagedAttnParams& p, int lr) const {
    const int m = row0 + lr;
    return lr < nrows ? last_visible(len - vt.q(), fastdiv(m, p.div_g)) : -1;
  }

  __device__ __forceinline__ __half* dst_row(const PagedAttnParams& p, int lr) const {
    const int m = row0 + lr, i = fastdiv(m, p.div_g), h = kvh * p.G + m - i * p.G;
    return vt.splits() == 1 ? p.out + ((i64)(vt.start() + i) * p.H_q + h) * KT::D
                            : p.part_acc + ((((i64)vt.unit() * 8 + i) * p.H_q + h) * p.split_cap + split) * KT::D;
  }
  // (dst_row: the split count read again, the split the CTA's own)
  __device__ __forceinline__ __half* out_row(const PagedAttnParams& p, int lr) const { return dst_row(p, lr); }
  __device__ __forceinline__ __half* part_row(const PagedAttnParams& p, int lr, int) const { return dst_row(p, lr); }
  __device__ __forceinline__ float2* ml_slot(const PagedAttnParams& p, int lr, int sp) const {
    const int m = row0 + lr, i = fastdiv(m, p.div_g), h = kvh * p.G + m - i * p.G;
    return p.part_ml + (((i64)vt.unit() * 8 + i) * p.H_q + h) * p.split_cap + sp;
  }
};

}  // namespace sm70attn
