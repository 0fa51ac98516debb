// Paged attention over an e4m3 KV cache on tensor cores (WMMA 16x16x16, fp16 in, fp32 acc).
//
// One CTA = (request b, KV head, row group, context split) (cta.h: PagedCta). Its rows are the
// G x Q query rows that share the KV head (row m = g * Q + r, which is also their order in the
// output), so every KV byte is read once per row group; all shapes we build for have one row
// group except D=256 with G * Q > 64. paged_attention_varlen runs the same CTA over 64-row tiles
// of packed requests (varlen.h: VarlenCta; varlen.cuh). Per tile of N tokens:
//   gather+dequant K,V -> smem fp16 | S = Q K^T (WMMA) -> smem fp32 | online softmax (fp32,
//   8 lanes per row) -> P fp16 over S | O = alpha * O + P V (WMMA, O in registers).
// Four barriers per tile; five where S shares the K tile's memory (traits.h: S_ALIAS). The
// next tile's global loads are issued before the math of the current one (register staging,
// kv_tile.h). The split writes fp16 out directly (num_splits == 1) or partials for combine.cuh
// (row max, row sum, and O in fp16 over the sum's power of two, times 2^12: utils.h,
// partial_scale; epilogue.h).
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
#include "sm70attn/epilogue.h"
#include "sm70attn/kv_tile.h"
#include "sm70attn/params.h"
#include "sm70attn/softmax.h"
#include "sm70attn/traits.h"
#include "sm70attn/utils.h"

namespace sm70attn {

namespace wmma = nvcuda::wmma;
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major>;
using FragKt = wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major>;
using FragV = wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// The CTA's query rows -> fp16 shared memory; padding rows are zero (and fully masked by the
// softmax).
template <class KT, class Cta>
__device__ __forceinline__ void load_q(const PagedAttnParams& p, const Cta& cta, __half* Qs, int tid) {
  constexpr int D = KT::D;
  for (int c = tid; c < KT::ROWS * (D / 8); c += KT::THREADS) {
    const int lr = c / (D / 8), part = c % (D / 8);
    uint4 x = make_uint4(0u, 0u, 0u, 0u);
    if (lr < cta.nrows) x = load_q8(cta.q_row(p, lr, part), p.q_vec16);
    // D permuted within groups of 4 like K and V (e4m3.h): positions 0..3 hold q0, q2, q1, q3.
    *reinterpret_cast<uint4*>(Qs + lr * KT::QLD + part * 8) =
        make_uint4(__byte_perm(x.x, x.y, 0x5410), __byte_perm(x.x, x.y, 0x7632),
                   __byte_perm(x.z, x.w, 0x5410), __byte_perm(x.z, x.w, 0x7632));
  }
}

// S = Q K^T: warp (mblk, wn) computes S tiles n = wns, wns + WNS, ... of its row block over
// D slices [ks * DPK, ks * DPK + DPK), into partial buffer ks (wns = wn % WNS, ks = wn / WNS);
// s: the S tiles' accumulators.
template <class KT>
__device__ __forceinline__ void qk_tile(const __half* Qs, const __half* Ks, float* Ss, int mblk, int wn,
                                        FragC (&s)[KT::SPW]) {
  constexpr int ROWS = KT::ROWS;
  const int wns = wn % KT::WNS, ks = wn / KT::WNS;
  const __half* qa = Qs + mblk * 16 * KT::QLD + ks * KT::DPK * 16;
  const __half* kt = Ks + wns * 16 * KT::KLD + ks * KT::DPK * 16;
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

// O = alpha * O + P V: warp (mblk, wn) owns O tiles wn * DPW .. wn * DPW + DPW - 1 (a, pa, bv: the
// alpha, P and V fragments).
template <class KT>
__device__ __forceinline__ void pv_tile(FragC (&o)[KT::DPW], const __half* Ps, const __half* Vs, const float* As,
                                        const unsigned char* moved, int mblk, int wn, FragC& a, FragA& pa, FragV& bv) {
  constexpr int WN = KT::WN;
  // Rows of O scale by alpha: the alpha tile is loaded as an accumulator fragment, so its
  // elements line up with O's whatever the (opaque) fragment layout.
  // Skipped when no warp of the block flagged a row: then every alpha is 1, or 0 on rows
  // whose O is 0, so skipping is bitwise the same.
  if (any_byte<WN>(moved + mblk * WN)) {
    wmma::load_matrix_sync(a, As + mblk * 16 * KT::SLD, KT::SLD, wmma::mem_row_major);
#pragma unroll
    for (int k = 0; k < KT::DPW; ++k)
#pragma unroll
      for (int e = 0; e < FragC::num_elements; ++e) o[k].x[e] *= a.x[e];
  }
#pragma unroll
  for (int nn = 0; nn < KT::NB; ++nn) {
    wmma::load_matrix_sync(pa, Ps + mblk * 16 * KT::PLD + nn * 16, KT::PLD);
#pragma unroll
    for (int k = 0; k < KT::DPW; ++k) {
      wmma::load_matrix_sync(bv, Vs + nn * 16 * KT::KLD + (wn * KT::DPW + k) * 16, KT::KLD);
      wmma::mma_sync(o[k], pa, bv, o[k]);
    }
  }
}

// O -> shared memory (fp32, [ROWS][ELD]) for the epilogue: warp (mblk, wn) its tiles.
template <class KT>
__device__ __forceinline__ void stage_o(const FragC (&o)[KT::DPW], float* Es, int mblk, int wn) {
#pragma unroll
  for (int k = 0; k < KT::DPW; ++k)
    wmma::store_matrix_sync(Es + mblk * 16 * KT::ELD + (wn * KT::DPW + k) * 16, o[k], KT::ELD, wmma::mem_row_major);
}

// One CTA's work, for a CTA work type Cta (cta.h: PagedCta for paged_attention, VarlenCta for
// paged_attention_varlen): where it works, its query rows, then per tile the KV gather, S = Q K^T,
// the online softmax (softmax.h) and O = alpha O + P V, then the epilogue (epilogue.h).
// The pieces are always inlined, but each is optimised on its own first: a fragment or array
// they work in is declared here and passed in, since as their own locals those changed the
// order of the kernel's registers and with it ptxas's code (the machine code is kept the same
// byte for byte across this split: docs/data/sass.json).
template <class KT, class Cta>
__device__ __forceinline__ void attend_cta(const PagedAttnParams& p) {
  constexpr int N = KT::N, ROWS = KT::ROWS, WN = KT::WN;

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

  Cta cta;
  if (!cta.init(p, blockIdx.y, smem)) return;
  cta.prologue(p, tid);
  const int b = cta.b, kvh = cta.kvh, t_begin = cta.t_begin, t_end = cta.t_end;

  if (t_begin >= t_end) {
    store_empty<KT>(p, cta, tid);
    return;
  }

  load_q<KT>(p, cta, Qs, tid);
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

  // The online softmax's rows (softmax.h): this lane's group and place in it, the warp's first row,
  // and the rows' state.
  using Rows = SoftmaxRows<KT>;
  constexpr int RP = Rows::RP, H = Rows::H;
  const int grp = lane / Rows::LPR, gl = lane % Rows::LPR;
  const int wrow0 = mblk * 16 + wn * Rows::RPW;
  int last[RP];
  float m_run[RP], l_run[RP];
  softmax_init<KT>(p, cta, tid, grp, wrow0, last, m_run, l_run, row_m, row_l);

  KvStage<KT> st;
  st.load(p, kb, vb, bt, t_begin, t_end, tid);
  for (int t0 = t_begin; t0 < t_end; t0 += N) {
    __syncthreads();  // previous tile's PV done with K, V, P
    st.store(Ks, Vs, tok_ok, tid);
    __syncthreads();
    if (t0 + N < t_end) st.load(p, kb, vb, bt, t0 + N, t_end, tid);

    {
      FragC s[KT::SPW];
      qk_tile<KT>(Qs, Ks, Ss, mblk, wn, s);
    }
    __syncthreads();

    {
      int ok[H][4];
      float s[H][4], t[4];
      softmax_tile<KT>(p, cta, t0, sl2, lane, warp, gl, grp, wrow0, last, m_run, l_run, Ss, Ps, As, row_m, row_l,
                       tok_ok, moved, ok, s, t);
    }
    __syncthreads();

    {
      FragC a;
      FragA pa;
      FragV bv;
      pv_tile<KT>(o, Ps, Vs, As, moved, mblk, wn, a, pa, bv);
    }
  }

  // Epilogue: O -> smem (fp32) -> coalesced fp16 rows of out (normalised, * v_scale * 2^8) or of
  // the split's partials (params.h).
  softmax_store<KT>(grp, gl, wrow0, m_run, l_run, row_m, row_l);
  __syncthreads();
  stage_o<KT>(o, Es, mblk, wn);
  __syncthreads();
  if (cta.splits(p) == 1)
    store_out<KT>(p, cta, Es, row_l, tid);
  else
    store_partials<KT>(p, cta, Es, row_m, row_l, tid);
}

// paged_attention: decodes and verifies (1-16 rows a request), a CTA per (request, KV head, row
// group) and split.
template <class KT>
__global__ void __launch_bounds__(KT::THREADS, KT::MIN_BLOCKS)
    paged_attention_kernel(const PagedAttnParams p) {
  attend_cta<KT, PagedCta<KT>>(p);
}

}  // namespace sm70attn
