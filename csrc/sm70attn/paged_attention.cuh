// Paged attention over an e4m3 KV cache on tensor cores (WMMA 16x16x16, fp16 in, fp32 acc).
//
// One CTA = (request b, KV head, row group, context split). Its rows are the G x Q query rows
// that share the KV head (row m = g * Q + r, which is also their order in the output), so
// every KV byte is read once per row group; all shapes we build for have one row group except
// D=256 with G * Q > 64. Per tile of N tokens:
//   gather+dequant K,V -> smem fp16 | S = Q K^T (WMMA) -> smem fp32 | online softmax (fp32,
//   8 lanes per row) -> P fp16 over S | O = alpha * O + P V (WMMA, O in registers).
// Four barriers per tile; five where S shares the K tile's memory (traits.h: S_ALIAS). The
// next tile's global loads are issued before the math of the current one (register staging,
// kv_tile.h). The split writes fp16 out directly (num_splits == 1) or partials for combine.cuh
// (row max, row sum, and O in fp16 over the sum's power of two, times 2^12: utils.h,
// partial_scale).
// D is permuted within groups of 4 in shared memory (Q, K, V and O alike; e4m3.h).
//
// Few rows (decode, G * Q <= 16) use this same kernel with the rows padded to 16: padding
// costs tensor-core work only (32 flop per KV byte; SM70 has ~139 flop/byte of fp16 tensor
// throughput per byte of HBM bandwidth), while an FP32 CUDA-core path would be compute-bound
// at G = 8 on V100 (16 FMA-flop per KV byte against 17 available) and is a second kernel to
// keep right.
#pragma once

#include <mma.h>

#include "sm70attn/cta.h"
#include "sm70attn/kv_tile.h"
#include "sm70attn/params.h"
#include "sm70attn/traits.h"
#include "sm70attn/utils.h"
#include "sm70attn/varlen.h"

namespace sm70attn {

// One CTA's work: paged_attention's (VARLEN false) or paged_attention_varlen's (varlen.h: the
// CTA's request and tile, rows position-major, out [T, H_q, D], split partials by unit). The
// tile loop and the epilogue are the same for both.
template <class KT, bool VARLEN>
__device__ __forceinline__ void attend_cta(const PagedAttnParams& p) {
  namespace wmma = nvcuda::wmma;
  using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major>;
  using FragKt = wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major>;
  using FragV = wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major>;
  using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
  constexpr int D = KT::D, N = KT::N, ROWS = KT::ROWS, WN = KT::WN;

  extern __shared__ __align__(128) unsigned char smem[];
  __half* Qs = reinterpret_cast<__half*>(smem + KT::Q_OFF);  // [ROWS][QLD]
  __half* Ks = reinterpret_cast<__half*>(smem + KT::K_OFF);  // [N][KLD]
  __half* Vs = reinterpret_cast<__half*>(smem + KT::V_OFF);  // [N][KLD]
  float* Ss = reinterpret_cast<float*>(smem + KT::S_OFF);    // [KS][ROWS][SLD] partial scores
  __half* Ps = reinterpret_cast<__half*>(Ss);                // [ROWS][PLD], row r inside S row r
  float* As = Ss + N / 2;                                    // [ROWS][SLD], 16 per row, after P
  float* Es = reinterpret_cast<float*>(smem);                // [ROWS][ELD], epilogue only
  float* row_m = reinterpret_cast<float*>(smem + KT::ROW_OFF);  // running max (log2 units)
  float* row_l = row_m + ROWS;                                  // running sum
  int* tok_ok = reinterpret_cast<int*>(smem + KT::TOK_OFF);     // [N]
  unsigned char* moved = smem + KT::FLAG_OFF;                   // [WARPS]: a row max of the warp moved

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int mblk = warp / WN, wn = warp % WN;  // this warp's 16-row block and column share

  int b, kvh, row0, nrows, len, t_begin, t_end;
  const int split = blockIdx.y;
  i64 out_row0 = 0;  // paged_attention: [B*H_q*Q] row index of local row 0
  VarlenTile vt{nullptr};
  if constexpr (!VARLEN) {
    const CtaSpan cta = cta_span<ROWS, N>(p, split);
    b = cta.b, kvh = cta.kvh, row0 = cta.row0, nrows = cta.nrows, out_row0 = cta.out_row0;
    len = cta.len, t_begin = cta.t_begin, t_end = cta.t_end;
  } else {
    const int tile = fastdiv(blockIdx.x, p.div_hkv);
    kvh = blockIdx.x - tile * p.H_kv;
    vt = varlen_scan<ROWS, prefill_rows(KT::D), false>(p, tile, reinterpret_cast<int*>(smem + KT::SMEM_BYTES));
    if (vt.b() < 0 || split >= vt.splits()) return;  // (CTA-uniform) past the last tile or split
    b = vt.b(), row0 = vt.row0(), nrows = min(ROWS, vt.q() * p.G - row0), len = vt.len();
    const int splits = vt.splits();
    // The tile's tokens: up to what its last row sees (causal), split evenly in whole tiles.
    const int seen = min(len, max(0, len - vt.q() + fastdiv(row0 + nrows - 1, p.div_g) + 1));
    const int chunk = ((seen + splits - 1) / splits + N - 1) / N * N;
    t_begin = min(seen, split * chunk);
    t_end = min(seen, t_begin + chunk);
  }

  auto splits = [&] {
    if constexpr (VARLEN) return vt.splits();
    return p.num_splits;
  };
  // Where local row lr goes: out, or with splits the split's fp16 partial row (params.h).
  auto dst_row = [&](int lr) {
    if constexpr (VARLEN) {
      const int m = row0 + lr, i = fastdiv(m, p.div_g), h = kvh * p.G + m - i * p.G;
      return vt.splits() == 1 ? p.out + ((i64)(vt.start() + i) * p.H_q + h) * D
                              : p.part_acc + ((((i64)vt.unit() * 8 + i) * p.H_q + h) * p.split_cap + split) * D;
    } else {
      return p.num_splits == 1 ? p.out + (out_row0 + lr) * D : p.part_acc + ((out_row0 + lr) * p.num_splits + split) * D;
    }
  };
  // The (m, l) slot of local row lr's partial (splits > 1).
  auto ml_slot = [&](int lr, int sp) {
    if constexpr (VARLEN) {
      const int m = row0 + lr, i = fastdiv(m, p.div_g), h = kvh * p.G + m - i * p.G;
      return p.part_ml + (((i64)vt.unit() * 8 + i) * p.H_q + h) * p.split_cap + sp;
    } else {
      return p.part_ml + (out_row0 + lr) * p.num_splits + sp;
    }
  };

  if constexpr (VARLEN) {  // the heads of the request's units, for combine_varlen_kernel
    // (by the CTA whose tile holds row g = 0 of the unit's first token)
    if (vt.splits() > 1 && kvh == 0 && split == 0 && tid == 0)
      for (int i = (row0 + 8 * p.G - 1) / (8 * p.G) * 8; i * p.G < row0 + nrows; i += 8) {
        int* h = p.unit_head + 4 * (vt.unit() + i / 8);
        h[0] = vt.start() + i, h[1] = min(8, vt.q() - i), h[2] = vt.splits(), h[3] = b;
      }
  }

  if (t_begin >= t_end) {  // nothing to see: zero rows, or an empty partial (m = -inf, l = 0, O = 0)
    for (int c = tid; c < nrows * (D / 8); c += KT::THREADS)
      *reinterpret_cast<uint4*>(dst_row(c / (D / 8)) + c % (D / 8) * 8) = make_uint4(0u, 0u, 0u, 0u);
    if (splits() > 1)
      for (int lr = tid; lr < nrows; lr += KT::THREADS) *ml_slot(lr, split) = make_float2(neg_inf(), 0.f);
    return;
  }

  // Q rows -> fp16 shared memory; padding rows are zero (and fully masked below).
  for (int c = tid; c < ROWS * (D / 8); c += KT::THREADS) {
    const int lr = c / (D / 8), part = c % (D / 8);
    uint4 x = make_uint4(0u, 0u, 0u, 0u);
    if (lr < nrows) {
      const __half* src;
      if constexpr (VARLEN) {
        const int m = row0 + lr, i = fastdiv(m, p.div_g), g = m - i * p.G;
        src = p.q + (i64)(vt.start() + i) * p.q_stride_b + (i64)(kvh * p.G + g) * p.q_stride_h + part * 8;
      } else {
        const int m = row0 + lr, g = fastdiv(m, p.div_q), r = m - g * p.Q;
        src = p.q + b * p.q_stride_b + (i64)(kvh * p.G + g) * p.q_stride_h + r * p.q_stride_r + part * 8;
      }
      x = load_q8(src, p.q_vec16);
    }
    // D permuted within groups of 4 like K and V (e4m3.h): positions 0..3 hold q0, q2, q1, q3.
    *reinterpret_cast<uint4*>(Qs + lr * KT::QLD + part * 8) =
        make_uint4(__byte_perm(x.x, x.y, 0x5410), __byte_perm(x.x, x.y, 0x7632),
                   __byte_perm(x.z, x.w, 0x5410), __byte_perm(x.z, x.w, 0x7632));
  }
  __syncthreads();

  FragC o[KT::DPW];  // O[mblk rows][(wn * DPW + k) * 16 ...], unnormalised
#pragma unroll
  for (int k = 0; k < KT::DPW; ++k) wmma::fill_fragment(o[k], 0.f);

  // Score scale in log2 units: softmax scale * k_scale * 2^8 (e4m3 -> fp16 leaves K at 2^-8).
  const float sl2 = p.scale_log2 * __ldg(p.k_scale + kvh * p.k_scale_stride) * 256.f;
  const int part0 = KvStage<KT>::part0(tid) * KT::VEC;  // this thread's first chunk of its token
  const unsigned char* kb = p.k + kvh * p.k_stride_head + part0;
  const unsigned char* vb = p.v + kvh * p.v_stride_head + part0;
  const int* bt = p.block_table + b * p.bt_stride_b;

  // Softmax rows of this warp: the RPW = 16 / WN consecutive rows from mblk * 16 + wn * RPW, RPP
  // per pass. Lane group grp (LPR = 8 lanes) of pass k owns row lr = row_of(k) and takes the
  // tokens j = 4 (gl + LPR h) + c of each tile (h < TPL / 4, c < 4; gl: lane in group; one
  // 16-byte load per lane and h). Consecutive rows let a warp whose rows are all padding (decode:
  // G * Q < 16) skip the pass. `last` is the last token a row may see (t <= len - Q + r; padding
  // rows see none). With at most two passes and registers to spare (every shape we tune for)
  // the row's running max and sum and `last` live in registers of its lane group; otherwise in
  // shared memory (registers would spill).
  constexpr int LPR = 8, TPL = N / LPR, H = TPL / 4, RPP = 32 / LPR, RPW = 16 / WN, PASSES = RPW / RPP;
  static_assert(PASSES >= 1 && RPW % RPP == 0 && TPL % 4 == 0, "softmax rows per warp");
  constexpr bool REGS = PASSES <= 2 && KT::ROOMY;
  constexpr int RP = REGS ? PASSES : 1;
  const int grp = lane / LPR, gl = lane % LPR;
  const int wrow0 = mblk * 16 + wn * RPW;  // the warp's first softmax row
  auto row_of = [&](int k) { return wrow0 + k * RPP + grp; };
  auto row_last = [&](int lr) {
    const int m = row0 + lr;
    if constexpr (VARLEN) return lr < nrows ? len - vt.q() + fastdiv(m, p.div_g) : -1;
    return lr < nrows ? len - p.Q + m - fastdiv(m, p.div_q) * p.Q : -1;
  };
  int last[RP];
  float m_run[RP], l_run[RP];
#pragma unroll
  for (int k = 0; k < RP; ++k) {
    last[k] = row_last(row_of(k));
    m_run[k] = neg_inf(), l_run[k] = 0.f;
  }
  if (!REGS) {
    for (int i = tid; i < ROWS; i += KT::THREADS) row_m[i] = neg_inf(), row_l[i] = 0.f;
    // (ordered before the first softmax by the loop's barriers)
  }

  KvStage<KT> st;
  st.load(p, kb, vb, bt, t_begin, t_end, tid);
  for (int t0 = t_begin; t0 < t_end; t0 += N) {
    __syncthreads();  // previous tile's PV done with K, V, P
    st.store(Ks, Vs, tok_ok, tid);
    __syncthreads();
    if (t0 + N < t_end) st.load(p, kb, vb, bt, t0 + N, t_end, tid);

    // S = Q K^T: warp (mblk, wn) computes S tiles n = wns, wns + WNS, ... of its row block over
    // D slices [ks * DPK, ks * DPK + DPK), into partial buffer ks (wns = wn % WNS, ks = wn / WNS).
    {
      const int wns = wn % KT::WNS, ks = wn / KT::WNS;
      const __half* qa = Qs + mblk * 16 * KT::QLD + ks * KT::DPK * 16;
      const __half* kt = Ks + wns * 16 * KT::KLD + ks * KT::DPK * 16;
      FragC s[KT::SPW];
#pragma unroll
      for (int k = 0; k < KT::SPW; ++k) wmma::fill_fragment(s[k], 0.f);
      // Slices in chunks of CH, each unrolled with constant offsets from pointers that step
      // between chunks: with a partial unroll (D256 MB3: 8 of 16) indexing by i made ptxas
      // recompute every fragment address (sm_70 tile 1420 -> 1374 instructions). Kernels
      // without registers to spare keep one chunk unrolled by QK_UNROLL (stepping spilled).
      constexpr int CH = KT::ROOMY ? KT::QK_UNROLL : KT::DPK;
#pragma unroll 1
      for (int c = 0; c < KT::DPK / CH; ++c) {
#pragma unroll(KT::QK_UNROLL)
        for (int i = 0; i < CH; ++i) {
          FragA a;
          wmma::load_matrix_sync(a, qa + i * 16, KT::QLD);
#pragma unroll
          for (int k = 0; k < KT::SPW; ++k) {
            if (KT::NB % KT::WNS == 0 || wns + k * KT::WNS < KT::NB) {
              FragKt bk;
              wmma::load_matrix_sync(bk, kt + k * KT::WNS * 16 * KT::KLD + i * 16, KT::KLD);
              wmma::mma_sync(s[k], a, bk, s[k]);
            }
          }
        }
        qa += CH * 16, kt += CH * 16;
      }
      float* sd = Ss + ks * ROWS * KT::SLD + mblk * 16 * KT::SLD + wns * 16;
      if (KT::S_ALIAS) __syncthreads();  // S overwrites the K tile: every warp is done with K
#pragma unroll
      for (int k = 0; k < KT::SPW; ++k)
        if (KT::NB % KT::WNS == 0 || wns + k * KT::WNS < KT::NB)
          wmma::store_matrix_sync(sd + k * KT::WNS * 16, s[k], KT::SLD, wmma::mem_row_major);
    }
    __syncthreads();

    // Online softmax, fp32, RPP rows per warp pass (rows as set up before the loop), one
    // log2(LPR)-step shuffle reduction for all of them. Tokens on invalid pages are masked like
    // future ones; a padding row sees nothing, so its P and alpha come out 0 and its O stays 0.
    // `moved`: whether any row of the warp's non-skipped passes that has seen a token before
    // this tile has alpha != 1 (its max moved), so PV can skip rescaling O when none has. A row
    // that has seen none (m_old = -inf: every padding row, and a real row before its first
    // token) has O = 0 and alpha = 0, so skipping its rescale is bitwise the same; counting it
    // rescaled every decode tile at G * Q < 16, where padding rows share a pass with real ones.
    {
      int ok[H][4];
#pragma unroll
      for (int h = 0; h < H; ++h) ld_vec(ok[h], tok_ok + 4 * (gl + LPR * h));
      bool mv = false;
#pragma unroll(REGS ? PASSES : 1)
      for (int k = 0; k < PASSES; ++k) {
        const int lr = row_of(k);
        float s[H][4];
        if (wrow0 + k * RPP >= nrows) {  // all rows padding (warp-uniform): P = 0, alpha = 0
#pragma unroll
          for (int h = 0; h < H; ++h) {
#pragma unroll
            for (int c = 0; c < 4; ++c) s[h][c] = 0.f;
            st_half_vec(Ps + lr * KT::PLD + 4 * (gl + LPR * h), s[h]);
          }
#pragma unroll
          for (int i = gl; i < 16; i += LPR) As[lr * KT::SLD + i] = 0.f;
          continue;
        }
        const int lim = (REGS ? last[REGS ? k : 0] : row_last(lr)) - t0 - gl * 4;  // vs c + 4 LPR h
#pragma unroll
        for (int h = 0; h < H; ++h) ld_vec(s[h], Ss + lr * KT::SLD + 4 * (gl + LPR * h));
#pragma unroll
        for (int q = 1; q < KT::KS; ++q) {  // partial scores, added in buffer order
#pragma unroll
          for (int h = 0; h < H; ++h) {
            float t[4];
            ld_vec(t, Ss + q * ROWS * KT::SLD + lr * KT::SLD + 4 * (gl + LPR * h));
#pragma unroll
            for (int c = 0; c < 4; ++c) s[h][c] += t[c];
          }
        }
        float mx = neg_inf();
#pragma unroll
        for (int h = 0; h < H; ++h)
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            s[h][c] = (c + 4 * LPR * h <= lim && ok[h][c]) ? s[h][c] * sl2 : neg_inf();
            mx = fmaxf(mx, s[h][c]);
          }
        mx = group_max<LPR>(mx);
        const float m_old = REGS ? m_run[REGS ? k : 0] : row_m[lr];
        const float l_old = REGS ? l_run[REGS ? k : 0] : row_l[lr];
        const float m_new = fmaxf(m_old, mx);
        const float m_use = m_new == neg_inf() ? 0.f : m_new;  // fully masked so far: p = 0
        __syncwarp();  // the rows' S values and state are read before P and state overwrite them
        float sum = 0.f;
#pragma unroll
        for (int h = 0; h < H; ++h) {
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            s[h][c] = exp2f(s[h][c] - m_use);
            sum += s[h][c];
          }
          st_half_vec(Ps + lr * KT::PLD + 4 * (gl + LPR * h), s[h]);
        }
        sum = group_sum<LPR>(sum);
        const float alpha = exp2f(m_old - m_use);
#pragma unroll
        for (int i = gl; i < 16; i += LPR) As[lr * KT::SLD + i] = alpha;  // 16 copies: row i of a 16 x 16 tile
        mv |= alpha != 1.f && m_old != neg_inf();
        if (REGS) {
          m_run[REGS ? k : 0] = m_new, l_run[REGS ? k : 0] = l_old * alpha + sum;
        } else if (gl == 0) {
          row_m[lr] = m_new, row_l[lr] = l_old * alpha + sum;
        }
      }
      mv = __any_sync(0xffffffffu, mv);
      if (lane == 0) moved[warp] = mv;
    }
    __syncthreads();

    // O = alpha * O + P V: warp (mblk, wn) owns O tiles wn * DPW .. wn * DPW + DPW - 1.
    {
      // Rows of O scale by alpha: the alpha tile is loaded as an accumulator fragment, so its
      // elements line up with O's whatever the (opaque) fragment layout.
      // Skipped when no warp of the block flagged a row: then every alpha is 1, or 0 on rows
      // whose O is 0, so skipping is bitwise the same.
      if (any_byte<WN>(moved + mblk * WN)) {
        FragC a;
        wmma::load_matrix_sync(a, As + mblk * 16 * KT::SLD, KT::SLD, wmma::mem_row_major);
#pragma unroll
        for (int k = 0; k < KT::DPW; ++k)
#pragma unroll
          for (int e = 0; e < FragC::num_elements; ++e) o[k].x[e] *= a.x[e];
      }
#pragma unroll
      for (int nn = 0; nn < KT::NB; ++nn) {
        FragA pa;
        wmma::load_matrix_sync(pa, Ps + mblk * 16 * KT::PLD + nn * 16, KT::PLD);
#pragma unroll
        for (int k = 0; k < KT::DPW; ++k) {
          FragV bv;
          wmma::load_matrix_sync(bv, Vs + nn * 16 * KT::KLD + (wn * KT::DPW + k) * 16, KT::KLD);
          wmma::mma_sync(o[k], pa, bv, o[k]);
        }
      }
    }
  }

  // Epilogue: O -> smem (fp32) -> coalesced fp16 rows of out (normalised, * v_scale * 2^8) or of
  // the split's partials (params.h).
  if (REGS && gl == 0) {
#pragma unroll
    for (int k = 0; k < RP; ++k) {
      const int lr = row_of(k);
      row_m[lr] = m_run[k], row_l[lr] = l_run[k];
    }
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < KT::DPW; ++k)
    wmma::store_matrix_sync(Es + mblk * 16 * KT::ELD + (wn * KT::DPW + k) * 16, o[k], KT::ELD,
                            wmma::mem_row_major);
  __syncthreads();
  if (splits() == 1) {
    const float vsc = __ldg(p.v_scale + kvh * p.v_scale_stride) * 256.f;
    for (int c = tid; c < nrows * (D / 8); c += KT::THREADS) {
      const int lr = c / (D / 8), part = c % (D / 8);
      const float l = row_l[lr], f = l > 0.f ? vsc / l : 0.f;
      const float4 e0 = *reinterpret_cast<const float4*>(Es + lr * KT::ELD + part * 8);
      const float4 e1 = *reinterpret_cast<const float4*>(Es + lr * KT::ELD + part * 8 + 4);
      // Columns of O are in the permuted D order (e4m3.h): positions 0..3 hold d0, d2, d1, d3.
      __half* dst;
      if constexpr (VARLEN) {
        dst = dst_row(lr);
      } else {
        dst = p.out + (out_row0 + lr) * D;
      }
      *reinterpret_cast<uint4*>(dst + part * 8) =
          make_uint4(pack_half2(e0.x * f, e0.z * f), pack_half2(e0.y * f, e0.w * f),
                     pack_half2(e1.x * f, e1.z * f), pack_half2(e1.y * f, e1.w * f));
    }
  } else {
    const int sp = reg_again<CTAID_Y>();  // (= split, read again: not held across the loop)
    for (int c = tid; c < nrows * (D / 4); c += KT::THREADS) {
      const int lr = c / (D / 4), part = c % (D / 4);
      const float f = partial_scale(row_l[lr]);
      const float4 e = *reinterpret_cast<const float4*>(Es + lr * KT::ELD + part * 4);  // d0, d2, d1, d3
      __half* dst;
      if constexpr (VARLEN) {
        dst = dst_row(lr);
      } else {
        dst = p.part_acc + ((out_row0 + lr) * p.num_splits + sp) * D;
      }
      *reinterpret_cast<uint2*>(dst + part * 4) =
          make_uint2(pack_half2(e.x * f, e.z * f), pack_half2(e.y * f, e.w * f));
    }
    for (int lr = tid; lr < nrows; lr += KT::THREADS) *ml_slot(lr, sp) = make_float2(row_m[lr], row_l[lr]);
  }
}

template <class KT>
__global__ void __launch_bounds__(KT::THREADS, KT::MIN_BLOCKS)
    paged_attention_kernel(const PagedAttnParams p) {
  attend_cta<KT, false>(p);
}

}  // namespace sm70attn
