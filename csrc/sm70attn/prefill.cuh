// paged_attention_varlen's prefill kernel: the requests of a step with more than pf_min_q query
// tokens (prompts, chunks over a past), in CTAs of ROWS query rows (the G heads of a KV head
// packed, position-major: row m is token m / G, head m % G) over 64-token tiles of the E4M3
// pages, on the MMA atoms of mma_atoms.h (m8n8k4 on SM70, its m16n8k16 twin on newer GPUs).
// The shorter requests of the step (decodes, verifies) stay on varlen.cuh's tile loop: the two
// kernels split the requests by their token counts, the same way (varlen_scan below), so a
// request's bits do not depend on the rest of the batch.
//
// A CTA: 16 warps, one per SM (the V100's 96 KB hold Q, one K/V tile and P). Per KV tile:
//   gather+dequant K (and V) -> smem | S = Q K^T: warp (rq, cq) takes RQ rows x 16 keys over all
//   of D, S in registers | row maxima over the 4 key groups (smem) | lazy online softmax in
//   registers, P (fp16) -> smem | O = alpha O + P V: warp (rp, cp) takes 32 rows x CP columns,
//   O in registers.
// The tiles every row of the CTA sees whole, on valid pages, skip the mask (the main loop); the
// causal diagonal and the tiles with an invalid page take it. At D 256, V is stored over K once
// every warp is done with K (V_OVER_K). Splits and their partials are varlen.cuh's
// (combine_varlen_kernel merges them).
#pragma once

#include "sm70attn/cta.h"
#include "sm70attn/epilogue.h"
#include "sm70attn/kv_tile.h"
#include "sm70attn/mma_atoms.h"
#include "sm70attn/params.h"
#include "sm70attn/traits.h"
#include "sm70attn/utils.h"
#include "sm70attn/varlen.h"

namespace sm70attn {

template <class Atom>
struct PfOps;

// m8n8k4 (SM70). A warp's four quad-pairs g = lane % 16 / 4 in a 2 x 2 grid: rows rh = g / 2
// (half of the warp tile's rows), columns kh = g % 2. In QK^T the quad-pair's 8 keys are
// 4 kh + {0..3, 8..11} of the warp's 16 (lane half h takes 4 kh + 8 h + lane % 4), so a phase's
// 8 lanes load 8 consecutive K rows: no bank conflict. In PV the quad-pair's CP / 2 columns start
// 64 bytes after its neighbour's (col0), for the same reason on V's rows.
template <>
struct PfOps<MmaM8N8K4> {
  static constexpr int XOR0 = 2, XOR1 = 4;  // lanes holding the other keys of a lane's rows
  // S element i (of 8 a 16-row block j) of a lane: row, key (within the warp tile), row slot.
  template <class PT>
  static __device__ __forceinline__ int s_row(int lane, int j, int i) {
    return (lane >> 3 & 1) * (PT::RQ / 2) + 8 * j + (lane & 1) + (i & 2) + 4 * (lane >> 4);
  }
  static __device__ __forceinline__ int s_key(int lane, int i) {
    return 4 * (lane >> 2 & 1) + 8 * (i >> 2) + (lane & 2) + (i & 1);
  }
  static __device__ __forceinline__ int s_slot(int j, int i) { return 2 * j + (i >> 1 & 1); }
  static __device__ __forceinline__ bool s_writer(int lane) { return (lane & 6) == 0; }

  // s = Q K^T over all of D: qa the warp's first Q row, kb its first key's row.
  template <class PT>
  static __device__ __forceinline__ void qk(float (&s)[PT::NRB][8], const __half* qa, const __half* kb, int lane) {
    const int r = (lane & 3) + 4 * (lane >> 4);
    const __half* qp = qa + ((lane >> 3 & 1) * (PT::RQ / 2) + r) * PT::QLD;
    const __half* kp = kb + (4 * (lane >> 2 & 1) + 8 * (lane >> 4) + (lane & 3)) * PT::KLD;
#pragma unroll
    for (int j = 0; j < PT::NRB; ++j)
#pragma unroll
      for (int i = 0; i < 8; ++i) s[j][i] = 0.f;
#pragma unroll
    for (int d = 0; d < PT::D; d += 8) {
      const uint4 b = *reinterpret_cast<const uint4*>(kp + d);
      const unsigned b0[2] = {b.x, b.y}, b1[2] = {b.z, b.w};
#pragma unroll
      for (int j = 0; j < PT::NRB; ++j) {
        const uint4 a = *reinterpret_cast<const uint4*>(qp + 8 * j * PT::QLD + d);
        const unsigned a0[2] = {a.x, a.y}, a1[2] = {a.z, a.w};
        mma_atom(MmaM8N8K4{}, s[j], a0, b0, s[j]);
        mma_atom(MmaM8N8K4{}, s[j], a1, b1, s[j]);
      }
    }
  }

  // PV: O is [2 row blocks][NCB column blocks][8] a lane.
  template <class PT>
  static constexpr int NCB = PT::CP / 16;
  template <class PT>
  static __device__ __forceinline__ int col0(int cp, int kh) {
    return 2 * PT::CP * (cp / 2) + PT::CP / 2 * (cp % 2) + PT::CP * kh;
  }
  template <class PT>
  static __device__ __forceinline__ int o_row(int lane, int j, int i) {
    return 16 * (lane >> 3 & 1) + 8 * j + (lane & 1) + (i & 2) + 4 * (lane >> 4);
  }
  template <class PT>
  static __device__ __forceinline__ int o_col(int lane, int cp, int c, int i) {
    const int n = (i & 4) + (lane & 2) + (i & 1);
    return col0<PT>(cp, lane >> 2 & 1) + (NCB<PT> == 2 ? 8 * (n >> 2) + 4 * c + (n & 3) : n);
  }
  // o += P V: pa the warp's first P row; vt V's first row (token 0, column 0).
  template <class PT>
  static __device__ __forceinline__ void pv(float (&o)[2][PT::CP / 16][8], const __half* pa, const __half* vt, int cp,
                                            int lane) {
    constexpr int C = NCB<PT>;
    const int h = lane >> 4;
    const __half* pp = pa + (16 * (lane >> 3 & 1) + (lane & 3) + 4 * h) * PT::PLD;
    const __half* vp = vt + (lane & 3) * PT::KLD + col0<PT>(cp, lane >> 2 & 1) + (C == 2 ? 8 : 4) * h;
#pragma unroll
    for (int k = 0; k < PT::N; k += 8) {
      const uint4 p0 = *reinterpret_cast<const uint4*>(pp + k);
      const uint4 p1 = *reinterpret_cast<const uint4*>(pp + 8 * PT::PLD + k);
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) {
        const unsigned a0[2] = {ks ? p0.z : p0.x, ks ? p0.w : p0.y};
        const unsigned a1[2] = {ks ? p1.z : p1.x, ks ? p1.w : p1.y};
        unsigned bf[2][2];
        if constexpr (C == 2) {
          const uint4 v = *reinterpret_cast<const uint4*>(vp + (k + 4 * ks) * PT::KLD);
          bf[0][0] = v.x, bf[0][1] = v.y, bf[1][0] = v.z, bf[1][1] = v.w;
        } else {
          const uint2 v = *reinterpret_cast<const uint2*>(vp + (k + 4 * ks) * PT::KLD);
          bf[0][0] = v.x, bf[0][1] = v.y, bf[1][0] = bf[1][1] = 0u;
        }
#pragma unroll
        for (int c = 0; c < C; ++c) {
          mma_atom(MmaM8N8K4RowRow{}, o[0][c], a0, bf[c], o[0][c]);
          mma_atom(MmaM8N8K4RowRow{}, o[1][c], a1, bf[c], o[1][c]);
        }
      }
    }
  }
};

// m16n8k16 (SM80+, the twin a newer GPU times): the warp computes 16 x 8 blocks whole; keys and
// columns in their natural order; fragments by ldmatrix (as paged_attention_rf.cuh's twin).
template <>
struct PfOps<MmaM16N8K16> {
  static constexpr int XOR0 = 1, XOR1 = 2;
  // S of 16-row block j: [8] = two 8-key blocks nb of 4 elements (i = 4 nb + e).
  template <class PT>
  static __device__ __forceinline__ int s_row(int lane, int j, int i) {
    return 16 * j + (lane >> 2) + 8 * (i >> 1 & 1);
  }
  static __device__ __forceinline__ int s_key(int lane, int i) { return 8 * (i >> 2) + 2 * (lane & 3) + (i & 1); }
  static __device__ __forceinline__ int s_slot(int j, int i) { return 2 * j + (i >> 1 & 1); }
  static __device__ __forceinline__ bool s_writer(int lane) { return (lane & 3) == 0; }

  template <class PT>
  static __device__ __forceinline__ void qk(float (&s)[PT::NRB][8], const __half* qa, const __half* kb, int lane) {
    const __half* qp = qa + (lane & 15) * PT::QLD + 8 * (lane >> 4);
    const __half* kp = kb + (8 * (lane >> 4) + (lane & 7)) * PT::KLD + 8 * (lane >> 3 & 1);
#pragma unroll
    for (int j = 0; j < PT::NRB; ++j)
#pragma unroll
      for (int i = 0; i < 8; ++i) s[j][i] = 0.f;
#pragma unroll
    for (int d = 0; d < PT::D; d += 16) {
      unsigned bq[4];
      ldsm_x4(bq, kp + d);
      const unsigned b0[2] = {bq[0], bq[1]}, b1[2] = {bq[2], bq[3]};
#pragma unroll
      for (int j = 0; j < PT::NRB; ++j) {
        unsigned a[4];
        ldsm_x4(a, qp + 16 * j * PT::QLD + d);
        float(&lo)[4] = *reinterpret_cast<float(*)[4]>(&s[j][0]);
        float(&hi)[4] = *reinterpret_cast<float(*)[4]>(&s[j][4]);
        mma_atom(MmaM16N8K16{}, lo, a, b0, lo);
        mma_atom(MmaM16N8K16{}, hi, a, b1, hi);
      }
    }
  }

  // PV: O is [2 row blocks][CP / 16 pairs of 8-column blocks][8] a lane (i = 4 (block % 2) + e).
  template <class PT>
  static __device__ __forceinline__ int o_row(int lane, int j, int i) {
    return 16 * j + (lane >> 2) + 8 * (i >> 1 & 1);
  }
  template <class PT>
  static __device__ __forceinline__ int o_col(int lane, int cp, int c, int i) {
    return PT::CP * cp + 16 * c + 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
  }
  template <class PT>
  static __device__ __forceinline__ void pv(float (&o)[2][PT::CP / 16][8], const __half* pa, const __half* vt, int cp,
                                            int lane) {
    const __half* pp = pa + (lane & 15) * PT::PLD + 8 * (lane >> 4);
    const __half* vp = vt + ((lane >> 3 & 1) * 8 + (lane & 7)) * PT::KLD + PT::CP * cp + 8 * (lane >> 4);
#pragma unroll
    for (int k = 0; k < PT::N; k += 16) {
      unsigned a0[4], a1[4];
      ldsm_x4(a0, pp + k);
      ldsm_x4(a1, pp + 16 * PT::PLD + k);
#pragma unroll
      for (int c = 0; c < PT::CP / 16; ++c) {
        unsigned r[4];
        ldsm_x4_trans(r, vp + k * PT::KLD + 16 * c);
        const unsigned b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const unsigned(&a)[4] = j ? a1 : a0;
          float(&lo)[4] = *reinterpret_cast<float(*)[4]>(&o[j][c][0]);
          float(&hi)[4] = *reinterpret_cast<float(*)[4]>(&o[j][c][4]);
          mma_atom(MmaM16N8K16{}, lo, a, b0, lo);
          mma_atom(MmaM16N8K16{}, hi, a, b1, hi);
        }
      }
    }
  }
};

// The prefill kernel's shared memory, by name (traits.h: PrefillTraits).
template <class PT>
struct PfSmem {
  unsigned char* base;
  __device__ __half* q() const { return reinterpret_cast<__half*>(base + PT::Q_OFF); }  // [ROWS][QLD]
  __device__ __half* k() const { return reinterpret_cast<__half*>(base + PT::K_OFF); }  // [N][KLD]
  __device__ __half* v() const { return reinterpret_cast<__half*>(base + PT::V_OFF); }  // [N][KLD] (over K at D 256)
  __device__ __half* p() const { return reinterpret_cast<__half*>(base + PT::P_OFF); }  // [ROWS][PLD]
  __device__ float* red() const { return reinterpret_cast<float*>(base + PT::RED_OFF); }  // [ROWS][4]
  __device__ float* alpha() const { return reinterpret_cast<float*>(base + PT::ALPHA_OFF); }  // [ROWS]
  __device__ int* moved() const { return reinterpret_cast<int*>(base + PT::MOVED_OFF); }  // [4]
  __device__ int* tok_ok() const { return reinterpret_cast<int*>(base + PT::TOK_OFF); }  // [N]
  // the KV head's K and V bases and the request's block table row (read back where used:
  // registers held across the tile loop are what 16 warps of 128 registers lack)
  __device__ i64* meta() const { return reinterpret_cast<i64*>(base + PT::META_OFF); }
  __device__ int* last() const { return reinterpret_cast<int*>(base + PT::LAST_OFF); }  // [ROWS]
  __device__ float* e() const { return reinterpret_cast<float*>(base); }  // [ROWS][ELD], epilogue only
};

// Q rows -> fp16 shared memory, D permuted within groups of 4 like K and V (e4m3.h), padding rows
// zero; each row's last visible token (cta.last: -1 for padding rows) and the gather's bases.
template <class PT, class Cta>
__device__ __forceinline__ void pf_prologue(const PagedAttnParams& p, const Cta& cta, PfSmem<PT> sm, int tid) {
  constexpr int D = PT::D;
  for (int c = tid; c < PT::ROWS * (D / 8); c += PT::THREADS) {
    const int lr = c / (D / 8), part = c % (D / 8);
    const uint4 x = lr < cta.nrows ? load_q8(cta.q_row(p, lr, part), p.q_vec16) : make_uint4(0u, 0u, 0u, 0u);
    *reinterpret_cast<uint4*>(sm.q() + lr * PT::QLD + part * 8) =
        make_uint4(__byte_perm(x.x, x.y, 0x5410), __byte_perm(x.x, x.y, 0x7632),
                   __byte_perm(x.z, x.w, 0x5410), __byte_perm(x.z, x.w, 0x7632));
  }
  for (int lr = tid; lr < PT::ROWS; lr += PT::THREADS) sm.last()[lr] = cta.last(p, lr);
  if (tid == 0) {
    sm.meta()[0] = reinterpret_cast<i64>(p.k + cta.kvh * p.k_stride_head);
    sm.meta()[1] = reinterpret_cast<i64>(p.v + cta.kvh * p.v_stride_head);
    sm.meta()[2] = reinterpret_cast<i64>(p.block_table + cta.b * p.bt_stride_b);
  }
}

// S = Q K^T of the warp's tile (rq, cq), in log2 units, masked where the tile is not whole (the
// causal limit of each of the lane's rows and the tokens on invalid pages: ok_lo / ok_hi, a bit a
// token); the rows' maxima over the warp's 16 keys -> red[row][cq].
template <class PT, class Ops>
__device__ __forceinline__ void pf_scores(float (&s)[PT::NRB][8], PfSmem<PT> sm, int rq, int cq, int lane, int t0,
                                          bool whole, unsigned ok_lo, unsigned ok_hi, float sl2) {
  constexpr int NRB = PT::NRB, NR = 2 * NRB;
  constexpr unsigned FULL = 0xffffffffu;
  Ops::template qk<PT>(s, sm.q() + rq * PT::RQ * PT::QLD, sm.k() + 16 * cq * PT::KLD, lane);
  float mx[NR];
#pragma unroll
  for (int k = 0; k < NR; ++k) mx[k] = neg_inf();
  if (whole) {
#pragma unroll
    for (int j = 0; j < NRB; ++j)
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        s[j][i] *= sl2;
        mx[Ops::s_slot(j, i)] = fmaxf(mx[Ops::s_slot(j, i)], s[j][i]);
      }
  } else {  // the causal limit and the page flags (padding rows see nothing) // (not a whole tile's)
    // Bit k of vis[r]: the lane's row r sees the warp's key k (of 16): a valid page, at most
    // the row's last token.
    const unsigned ok16 = ((cq < 2 ? ok_lo : ok_hi) >> 16 * (cq & 1)) & 0xffffu;
    unsigned vis[NR];
#pragma unroll
    for (int k = 0; k < NR; ++k) {
      const int lim = sm.last()[rq * PT::RQ + Ops::template s_row<PT>(lane, k / 2, 2 * (k % 2))] - t0 - 16 * cq;
      vis[k] = ok16 & (lim >= 15 ? 0xffffu : lim < 0 ? 0u : (2u << lim) - 1u);
    }
#pragma unroll
    for (int j = 0; j < NRB; ++j)
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const bool vis_k = vis[Ops::s_slot(j, i)] >> Ops::s_key(lane, i) & 1u;
        s[j][i] = vis_k ? s[j][i] * sl2 : neg_inf();
        mx[Ops::s_slot(j, i)] = fmaxf(mx[Ops::s_slot(j, i)], s[j][i]);
      }
  }
#pragma unroll
  for (int k = 0; k < NR; ++k) {
    mx[k] = fmaxf(mx[k], __shfl_xor_sync(FULL, mx[k], Ops::XOR0));
    mx[k] = fmaxf(mx[k], __shfl_xor_sync(FULL, mx[k], Ops::XOR1));
  }
  if (Ops::s_writer(lane)) {
#pragma unroll
    for (int k = 0; k < NR; ++k)
      sm.red()[(rq * PT::RQ + Ops::template s_row<PT>(lane, k / 2, 2 * (k % 2))) * 4 + cq] = mx[k];
  }
}

// Online softmax with a lazy rescale (paged_attention_rf.cuh): a row's m moves only when the
// tile's maximum passes it by more than RESCALE_LOG2 (then P <= 2^8, which fp16 holds). The four
// warps of a row group read the same maxima and hold the same m; a row that has seen nothing
// (m = -inf) gets p = 0 and alpha = 0 on an O that is 0. P -> shared memory; the rows' alpha and
// whether one of the row group's moved (O's rescale) from the group's first warp.
template <class PT, class Ops>
__device__ __forceinline__ void pf_softmax(float (&s)[PT::NRB][8], float (&m_run)[2 * PT::NRB],
                                           float (&l_run)[2 * PT::NRB], PfSmem<PT> sm, int rq, int cq, int lane) {
  constexpr int NRB = PT::NRB, NR = 2 * NRB;
  constexpr unsigned FULL = 0xffffffffu;
  bool mv = false;
  float alpha[NR], m_use[NR];
#pragma unroll
  for (int k = 0; k < NR; ++k) {
    const int lr = rq * PT::RQ + Ops::template s_row<PT>(lane, k / 2, 2 * (k % 2));
    const float4 r = *reinterpret_cast<const float4*>(sm.red() + lr * 4);
    const float t_max = fmaxf(fmaxf(r.x, r.y), fmaxf(r.z, r.w));
    const bool up = t_max > m_run[k] + PT::RESCALE_LOG2;
    const float m_new = up ? t_max : m_run[k];
    m_use[k] = m_new == neg_inf() ? 0.f : m_new;
    alpha[k] = up ? ex2_approx(m_run[k] - m_use[k]) : 1.f;
    mv |= up && m_run[k] != neg_inf();
    m_run[k] = m_new;
    l_run[k] *= alpha[k];
  }
#pragma unroll
  for (int j = 0; j < NRB; ++j)
#pragma unroll
    for (int i = 0; i < 8; i += 2) {
      const int k = Ops::s_slot(j, i);
      const float e0 = ex2_approx(s[j][i] - m_use[k]), e1 = ex2_approx(s[j][i + 1] - m_use[k]);
      l_run[k] += e0 + e1;
      *reinterpret_cast<unsigned*>(sm.p() + (rq * PT::RQ + Ops::template s_row<PT>(lane, j, i)) * PT::PLD + 16 * cq +
                                   Ops::s_key(lane, i)) = pack_half2(e0, e1);
    }
  mv = __any_sync(FULL, mv);
  if (cq == 0) {
    if (Ops::s_writer(lane)) {
#pragma unroll
      for (int k = 0; k < NR; ++k)
        sm.alpha()[rq * PT::RQ + Ops::template s_row<PT>(lane, k / 2, 2 * (k % 2))] = alpha[k];
    }
    if (lane == 0) sm.moved()[rq] = mv;
  }
}

// O = alpha O + P V for the warp's tile (rp, cp): O's rows are those of RP / RQ row groups,
// rescaled when one of them moved.
template <class PT, class Ops>
__device__ __forceinline__ void pf_pv(float (&o)[2][PT::CP / 16][8], PfSmem<PT> sm, int rp, int cp, int lane) {
  constexpr int C = PT::CP / 16, GROUPS = PT::RP / PT::RQ > 1 ? PT::RP / PT::RQ : 1;
  const int g0 = PT::RP * rp / PT::RQ;
  bool any = false;
#pragma unroll
  for (int g = 0; g < GROUPS; ++g) any |= sm.moved()[g0 + g] != 0;
  if (any) {  // (not a whole tile's)
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int i = 0; i < 4; i += 2) {
        const float a = sm.alpha()[PT::RP * rp + Ops::template o_row<PT>(lane, j, i)];
#pragma unroll
        for (int c = 0; c < C; ++c) o[j][c][i] *= a, o[j][c][i + 1] *= a, o[j][c][i + 4] *= a, o[j][c][i + 5] *= a;
      }
  }
  Ops::template pv<PT>(o, sm.p() + PT::RP * rp * PT::PLD, sm.v(), cp, lane);
}

// After the tile loop: each row's sum (its lanes' shares in a fixed order, then its 4 warps' in
// warp order) -> red[row] (row_l), m (the same in the 4 warps) -> alpha[row] (row_m), and O
// staged in shared memory (fp32, [ROWS][ELD]) for epilogue.h.
template <class PT, class Ops>
__device__ __forceinline__ void pf_stage(const float (&o)[2][PT::CP / 16][8], float (&m_run)[2 * PT::NRB],
                                         float (&l_run)[2 * PT::NRB], PfSmem<PT> sm, int warp, int lane) {
  constexpr int NR = 2 * PT::NRB, C = PT::CP / 16;
  constexpr unsigned FULL = 0xffffffffu;
  const int rq = warp / PT::WCQ, cq = warp % PT::WCQ, rp = warp / PT::WCP, cp = warp % PT::WCP;
#pragma unroll
  for (int k = 0; k < NR; ++k) {
    l_run[k] += __shfl_xor_sync(FULL, l_run[k], Ops::XOR0);
    l_run[k] += __shfl_xor_sync(FULL, l_run[k], Ops::XOR1);
  }
  if (Ops::s_writer(lane)) {
#pragma unroll
    for (int k = 0; k < NR; ++k) {
      const int lr = rq * PT::RQ + Ops::template s_row<PT>(lane, k / 2, 2 * (k % 2));
      sm.red()[lr * 4 + cq] = l_run[k];
      if (cq == 0) sm.alpha()[lr] = m_run[k];
    }
  }
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int c = 0; c < C; ++c)
#pragma unroll
      for (int i = 0; i < 8; i += 2) {
        float* e = sm.e() + (PT::RP * rp + Ops::template o_row<PT>(lane, j, i)) * PT::ELD +
                   Ops::template o_col<PT>(lane, cp, c, i);
        *reinterpret_cast<float2*>(e) = make_float2(o[j][c][i], o[j][c][i + 1]);
      }
  __syncthreads();
  const int t = reg_again<TID_X>();
  const float4 r = t < PT::ROWS ? *reinterpret_cast<const float4*>(sm.red() + t * 4) : make_float4(0.f, 0.f, 0.f, 0.f);
  __syncthreads();
  if (t < PT::ROWS) sm.red()[t] = ((r.x + r.y) + r.z) + r.w;
  __syncthreads();
}

// The CTA: where it works (VarlenCta<PT, true>: the scan, its rows, its split's tokens), the
// prologue, per KV tile (register-staged gather, pf_scores, pf_softmax, pf_pv), then O staged and
// epilogue.h's output or partials.
template <class PT, class Atom>
__global__ void __launch_bounds__(PT::THREADS, PT::MIN_BLOCKS) prefill_kernel(const PagedAttnParams p) {
  using Ops = PfOps<Atom>;
  constexpr int N = PT::N, NR = 2 * PT::NRB, C = PT::CP / 16;
  constexpr unsigned FULL = 0xffffffffu;
  extern __shared__ __align__(128) unsigned char smem[];
  const PfSmem<PT> sm{smem};
  const int tid = threadIdx.x, lane = tid & 31;

  int t_begin, t_end, first_last;
  float sl2;
  {
    VarlenCta<PT, true> cta;
    if (!cta.init(p, blockIdx.y, smem)) return;
    cta.prologue(p, tid);
    if (cta.t_begin >= cta.t_end) return store_empty<PT>(p, cta, tid);
    pf_prologue<PT>(p, cta, sm, tid);
    t_begin = cta.t_begin, t_end = cta.t_end, first_last = cta.last(p, 0);
    sl2 = p.scale_log2 * __ldg(p.k_scale + cta.kvh * p.k_scale_stride) * 256.f;
  }
  // The gather's bases (this thread's first chunk added) and the warp, read again where used.
  const int part0 = KvStage<PT>::part0(tid) * PT::VEC;
  auto kbase = [&] { return reinterpret_cast<const unsigned char*>(sm.meta()[0]) + part0; };
  auto vbase = [&] { return reinterpret_cast<const unsigned char*>(sm.meta()[1]) + part0; };
  auto btab = [&] { return reinterpret_cast<const int*>(sm.meta()[2]); };
  auto wq = [&] { return reg_again<TID_X>() >> 5; };

  float o[2][C][8];  // O[rows 32 rp + o_row][columns o_col], unnormalised
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int c = 0; c < C; ++c)
#pragma unroll
      for (int i = 0; i < 8; ++i) o[j][c][i] = 0.f;
  float m_run[NR], l_run[NR];  // this lane's rows (slots): running max (log2 units), its share of the sum
#pragma unroll
  for (int k = 0; k < NR; ++k) m_run[k] = neg_inf(), l_run[k] = 0.f;

  // The register stage holds the next tile's K and V (one page lookup a token for both); at
  // D 256 its V waits in registers until every warp is done with K (V over K).
  KvStage<PT> st;
  __syncthreads();  // Q, meta and the rows' limits stored
  st.load(p, kbase(), vbase(), btab(), t_begin, t_end, tid);
  for (int t0 = t_begin; t0 < t_end; t0 += N) {
    __syncthreads();  // previous tile's PV done with K, V and P
    if constexpr (PT::V_OVER_K) {
      st.template store_tensor<false>(sm.k(), sm.tok_ok(), reg_again<TID_X>());
    } else {
      st.store(sm.k(), sm.v(), sm.tok_ok(), reg_again<TID_X>());
    }
    __syncthreads();
    if constexpr (!PT::V_OVER_K) {
      if (t0 + N < t_end) st.load(p, kbase(), vbase(), btab(), t0 + N, t_end, reg_again<TID_X>());
    }
    // The tile needs no mask when every row sees all of it and its pages are valid.
    const unsigned ok_lo = __ballot_sync(FULL, sm.tok_ok()[lane]), ok_hi = __ballot_sync(FULL, sm.tok_ok()[lane + 32]);
    const bool whole = (ok_lo & ok_hi) == FULL && t0 + N - 1 <= first_last;
    const int rq = wq() / PT::WCQ, cq = wq() % PT::WCQ;
    float s[PT::NRB][8];
    pf_scores<PT, Ops>(s, sm, rq, cq, lane, t0, whole, ok_lo, ok_hi, sl2);
    __syncthreads();  // every warp done with K; the maxima are in red
    if constexpr (PT::V_OVER_K) {
      st.template store_tensor<true>(sm.k(), sm.tok_ok(), reg_again<TID_X>());  // V over K
      if (t0 + N < t_end) st.load(p, kbase(), vbase(), btab(), t0 + N, t_end, reg_again<TID_X>());
    }
    pf_softmax<PT, Ops>(s, m_run, l_run, sm, rq, cq, lane);
    __syncthreads();  // P, alpha and V stored
    pf_pv<PT, Ops>(o, sm, wq() / PT::WCP, wq() % PT::WCP, lane);
  }

  __syncthreads();  // every warp done with Q, K, V, P and red's maxima
  pf_stage<PT, Ops>(o, m_run, l_run, sm, wq(), lane);
  VarlenCta<PT, true> cta;  // again, from the tile in shared memory
  const int x = VarlenCta<PT, true>::cta_x(), tile = fastdiv(x, p.div_hkv);
  cta.at(p, VarlenTile{VarlenCta<PT, true>::tile_smem(smem)}, x - tile * p.H_kv, reg_again<CTAID_Y>());
  if (cta.splits(p) == 1) {
    store_out<PT>(p, cta, sm.e(), sm.red(), reg_again<TID_X>());
  } else {
    store_partials<PT>(p, cta, sm.e(), sm.alpha(), sm.red(), reg_again<TID_X>());
  }
}

}  // namespace sm70attn
