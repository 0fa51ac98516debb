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

template <class PT, class Atom>
__global__ void __launch_bounds__(PT::THREADS, PT::MIN_BLOCKS) prefill_kernel(const PagedAttnParams p) {
  using Ops = PfOps<Atom>;
  constexpr int D = PT::D, N = PT::N, ROWS = PT::ROWS, NRB = PT::NRB, NR = 2 * NRB, C = PT::CP / 16;
  constexpr unsigned FULL = 0xffffffffu;

  extern __shared__ __align__(128) unsigned char smem[];
  __half* Qs = reinterpret_cast<__half*>(smem + PT::Q_OFF);      // [ROWS][QLD]
  __half* Ks = reinterpret_cast<__half*>(smem + PT::K_OFF);      // [N][KLD]
  __half* Vs = reinterpret_cast<__half*>(smem + PT::V_OFF);      // [N][KLD] (over K at D 256)
  __half* Ps = reinterpret_cast<__half*>(smem + PT::P_OFF);      // [ROWS][PLD]
  float* red = reinterpret_cast<float*>(smem + PT::RED_OFF);     // [ROWS][4]
  float* alpha_s = reinterpret_cast<float*>(smem + PT::ALPHA_OFF);  // [ROWS]
  int* moved = reinterpret_cast<int*>(smem + PT::MOVED_OFF);     // [4]
  int* tok_ok = reinterpret_cast<int*>(smem + PT::TOK_OFF);      // [N]
  // The KV head's K and V bases and the request's block table row (read back where used:
  // registers held across the tile loop are what 16 warps of 128 registers lack).
  i64* meta = reinterpret_cast<i64*>(smem + PT::META_OFF);
  int* last_s = reinterpret_cast<int*>(smem + PT::LAST_OFF);    // [ROWS]
  float* Es = reinterpret_cast<float*>(smem);                    // [ROWS][ELD], epilogue only

  const int tid = threadIdx.x, lane = tid & 31;
  // The grid runs the tiles backwards: a request's last tiles, which see the most tokens, start
  // first (and the grid's empty tail, past the last tile, at once).
  auto cta_x = [&] { return (int)gridDim.x - 1 - reg_again<CTAID_X>(); };
  const int tile = fastdiv(cta_x(), p.div_hkv), kvh = cta_x() - tile * p.H_kv, split = blockIdx.y;
  const VarlenTile vt = varlen_scan<16 * varlen_row_blocks(), ROWS, true>(p, tile, reinterpret_cast<int*>(smem + PT::TILE_OFF));
  if (vt.b() < 0 || split >= vt.splits()) return;  // (CTA-uniform) past the last tile or split

  // The CTA's rows, what they see (row m of the request, token m / G, sees t <= len - q + m / G:
  // the first row the fewest, the last the most) and its split's tokens; and where a local row
  // goes: out, or with splits the split's fp16 partial row (params.h). From vt (shared memory)
  // where used.
  auto nrows = [&] { return min(ROWS, vt.q() * p.G - vt.row0()); };
  auto row_last = [&](int lr) { return vt.len() - vt.q() + fastdiv(vt.row0() + lr, p.div_g); };
  auto dst_row = [&](int lr, int sp, int h0) {
    const int m = vt.row0() + lr, i = fastdiv(m, p.div_g), h = h0 + m - i * p.G;
    return vt.splits() == 1 ? p.out + ((i64)(vt.start() + i) * p.H_q + h) * D
                            : p.part_acc + ((((i64)vt.unit() * 8 + i) * p.H_q + h) * p.split_cap + sp) * D;
  };
  auto ml_slot = [&](int lr, int sp, int h0) {
    const int m = vt.row0() + lr, i = fastdiv(m, p.div_g), h = h0 + m - i * p.G;
    return p.part_ml + (((i64)vt.unit() * 8 + i) * p.H_q + h) * p.split_cap + sp;
  };
  const int seen = min(vt.len(), max(0, row_last(nrows() - 1) + 1));
  const int chunk = ((seen + vt.splits() - 1) / vt.splits() + N - 1) / N * N;
  const int t_begin = min(seen, split * chunk), t_end = min(seen, t_begin + chunk);
  if (vt.splits() > 1 && kvh == 0 && split == 0 && tid == 0)  // the heads of the request's units (varlen.cuh)
    for (int i = (vt.row0() + 8 * p.G - 1) / (8 * p.G) * 8; i * p.G < vt.row0() + nrows(); i += 8) {
      int* h = p.unit_head + 4 * (vt.unit() + i / 8);
      h[0] = vt.start() + i, h[1] = min(8, vt.q() - i), h[2] = vt.splits(), h[3] = vt.b();
    }
  if (t_begin >= t_end) {  // nothing to see: zero rows, or an empty partial (m = -inf, l = 0, O = 0)
    for (int c = tid; c < nrows() * (D / 8); c += PT::THREADS)
      *reinterpret_cast<uint4*>(dst_row(c / (D / 8), split, kvh * p.G) + c % (D / 8) * 8) = make_uint4(0u, 0u, 0u, 0u);
    if (vt.splits() > 1)
      for (int lr = tid; lr < nrows(); lr += PT::THREADS) *ml_slot(lr, split, kvh * p.G) = make_float2(neg_inf(), 0.f);
    return;
  }

  // Q rows -> fp16 shared memory, D permuted within groups of 4 like K and V (e4m3.h);
  // padding rows are zero.
  for (int c = tid; c < ROWS * (D / 8); c += PT::THREADS) {
    const int lr = c / (D / 8), part = c % (D / 8);
    uint4 x = make_uint4(0u, 0u, 0u, 0u);
    if (lr < nrows()) {
      const int m = vt.row0() + lr, i = fastdiv(m, p.div_g), g = m - i * p.G;
      x = load_q8(p.q + (i64)(vt.start() + i) * p.q_stride_b + (i64)(kvh * p.G + g) * p.q_stride_h + part * 8,
                  p.q_vec16);
    }
    *reinterpret_cast<uint4*>(Qs + lr * PT::QLD + part * 8) =
        make_uint4(__byte_perm(x.x, x.y, 0x5410), __byte_perm(x.x, x.y, 0x7632),
                   __byte_perm(x.z, x.w, 0x5410), __byte_perm(x.z, x.w, 0x7632));
  }
  for (int lr = tid; lr < ROWS; lr += PT::THREADS) last_s[lr] = lr < nrows() ? row_last(lr) : -1;
  if (tid == 0) {
    meta[0] = reinterpret_cast<i64>(p.k + kvh * p.k_stride_head);
    meta[1] = reinterpret_cast<i64>(p.v + kvh * p.v_stride_head);
    meta[2] = reinterpret_cast<i64>(p.block_table + vt.b() * p.bt_stride_b);
  }
  // The gather's bases (this thread's first chunk added) and the warp's tiles, read again
  // where used.
  const int part0 = KvStage<PT>::part0(tid) * PT::VEC;
  auto kbase = [&] { return reinterpret_cast<const unsigned char*>(meta[0]) + part0; };
  auto vbase = [&] { return reinterpret_cast<const unsigned char*>(meta[1]) + part0; };
  auto btab = [&] { return reinterpret_cast<const int*>(meta[2]); };
  auto wq = [&] { return reg_again<TID_X>() >> 5; };  // the warp: (rq, cq) = (w / 4, w % 4), (rp, cp) = (w / WCP, w % WCP)

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

  const float sl2 = p.scale_log2 * __ldg(p.k_scale + kvh * p.k_scale_stride) * 256.f;
  const int first_last = row_last(0);

  // The register stage holds the next tile's K and V (one page lookup a token for both); at
  // D 256 its V waits in registers until every warp is done with K (V over K).
  KvStage<PT> st;
  __syncthreads();  // Q, meta and last_s stored
  st.load(p, kbase(), vbase(), btab(), t_begin, t_end, tid);
  for (int t0 = t_begin; t0 < t_end; t0 += N) {
    __syncthreads();  // previous tile's PV done with K, V and P
    if constexpr (PT::V_OVER_K) {
      st.template store_tensor<false>(Ks, tok_ok, reg_again<TID_X>());
    } else {
      st.store(Ks, Vs, tok_ok, reg_again<TID_X>());
    }
    __syncthreads();
    if constexpr (!PT::V_OVER_K) {
      if (t0 + N < t_end) st.load(p, kbase(), vbase(), btab(), t0 + N, t_end, reg_again<TID_X>());
    }
    // The tile needs no mask when every row sees all of it and its pages are valid.
    const unsigned ok_lo = __ballot_sync(FULL, tok_ok[lane]), ok_hi = __ballot_sync(FULL, tok_ok[lane + 32]);
    const bool whole = (ok_lo & ok_hi) == FULL && t0 + N - 1 <= first_last;
    const int rq = wq() / PT::WCQ, cq = wq() % PT::WCQ;

    float s[NRB][8];
    Ops::template qk<PT>(s, Qs + rq * PT::RQ * PT::QLD, Ks + 16 * cq * PT::KLD, lane);
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
        const int lim = last_s[rq * PT::RQ + Ops::template s_row<PT>(lane, k / 2, 2 * (k % 2))] - t0 - 16 * cq;
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
        red[(rq * PT::RQ + Ops::template s_row<PT>(lane, k / 2, 2 * (k % 2))) * 4 + cq] = mx[k];
    }
    __syncthreads();  // every warp done with K; the maxima are in red

    if constexpr (PT::V_OVER_K) {
      st.template store_tensor<true>(Ks, tok_ok, reg_again<TID_X>());  // V over K
      if (t0 + N < t_end) st.load(p, kbase(), vbase(), btab(), t0 + N, t_end, reg_again<TID_X>());
    }
    // Online softmax with a lazy rescale (paged_attention_rf.cuh): the four warps of a row group
    // read the same maxima and hold the same m; a row that has seen nothing (m = -inf) gets
    // p = 0 and alpha = 0 on an O that is 0.
    bool mv = false;
    float alpha[NR], m_use[NR];
#pragma unroll
    for (int k = 0; k < NR; ++k) {
      const int lr = rq * PT::RQ + Ops::template s_row<PT>(lane, k / 2, 2 * (k % 2));
      const float4 r = *reinterpret_cast<const float4*>(red + lr * 4);
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
        *reinterpret_cast<unsigned*>(Ps + (rq * PT::RQ + Ops::template s_row<PT>(lane, j, i)) * PT::PLD + 16 * cq +
                                     Ops::s_key(lane, i)) = pack_half2(e0, e1);
      }
    mv = __any_sync(FULL, mv);
    if (cq == 0) {
      if (Ops::s_writer(lane)) {
#pragma unroll
        for (int k = 0; k < NR; ++k) alpha_s[rq * PT::RQ + Ops::template s_row<PT>(lane, k / 2, 2 * (k % 2))] = alpha[k];
      }
      if (lane == 0) moved[rq] = mv;
    }
    __syncthreads();  // P, alpha and V stored

    // O = alpha O + P V. O's rows are those of RP / RQ row groups: rescaled when one moved.
    const int rp = wq() / PT::WCP, cp = wq() % PT::WCP;
    {
      constexpr int GROUPS = PT::RP / PT::RQ > 1 ? PT::RP / PT::RQ : 1;
      const int g0 = PT::RP * rp / PT::RQ;
      bool any = false;
#pragma unroll
      for (int g = 0; g < GROUPS; ++g) any |= moved[g0 + g] != 0;
      if (any) {  // (not a whole tile's)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int i = 0; i < 4; i += 2) {
            const float a = alpha_s[PT::RP * rp + Ops::template o_row<PT>(lane, j, i)];
#pragma unroll
            for (int c = 0; c < C; ++c) o[j][c][i] *= a, o[j][c][i + 1] *= a, o[j][c][i + 4] *= a, o[j][c][i + 5] *= a;
          }
      }
    }
    Ops::template pv<PT>(o, Ps + PT::RP * rp * PT::PLD, Vs, cp, lane);
  }

  // Epilogue. Each row's sum: its lanes' shares (in a fixed order), then its 4 warps' in warp
  // order; m is the same in the 4 warps.
  __syncthreads();  // every warp done with Q, K, V, P and red's maxima
  {
    const int rq = wq() / PT::WCQ, cq = wq() % PT::WCQ;
#pragma unroll
    for (int k = 0; k < NR; ++k) {
      l_run[k] += __shfl_xor_sync(FULL, l_run[k], Ops::XOR0);
      l_run[k] += __shfl_xor_sync(FULL, l_run[k], Ops::XOR1);
    }
    if (Ops::s_writer(lane)) {
#pragma unroll
      for (int k = 0; k < NR; ++k) {
        const int lr = rq * PT::RQ + Ops::template s_row<PT>(lane, k / 2, 2 * (k % 2));
        red[lr * 4 + cq] = l_run[k];
        if (cq == 0) alpha_s[lr] = m_run[k];
      }
    }
  }
  {
    const int rp = wq() / PT::WCP, cp = wq() % PT::WCP;
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int c = 0; c < C; ++c)
#pragma unroll
        for (int i = 0; i < 8; i += 2) {
          float* e = Es + (PT::RP * rp + Ops::template o_row<PT>(lane, j, i)) * PT::ELD + Ops::template o_col<PT>(lane, cp, c, i);
          *reinterpret_cast<float2*>(e) = make_float2(o[j][c][i], o[j][c][i + 1]);
        }
  }
  __syncthreads();
  // Each row's sum and the factor its O takes (red's first column, once read): out's
  // normalisation (* v_scale * 2^8), or the split's partial's (params.h).
  const int e_kvh = cta_x() - fastdiv(cta_x(), p.div_hkv) * p.H_kv;
  const int e_split = reg_again<CTAID_Y>();
  const float vsc = __ldg(p.v_scale + e_kvh * p.v_scale_stride) * 256.f;
  for (int i = reg_again<TID_X>(); i < ROWS; i += PT::THREADS) {
    const float4 r = *reinterpret_cast<const float4*>(red + i * 4);
    const float l = ((r.x + r.y) + r.z) + r.w;
    red[i * 4] = vt.splits() > 1 ? partial_scale(l) : l > 0.f ? vsc / l : 0.f;
    red[i * 4 + 1] = l;
  }
  __syncthreads();
  // fp16 rows of out or of the split's partials, columns in the permuted D order (e4m3.h):
  // positions 0..3 hold d0, d2, d1, d3.
  for (int c = reg_again<TID_X>(); c < nrows() * (D / 8); c += PT::THREADS) {
    const int lr = c / (D / 8), part = c % (D / 8);
    const float f = red[lr * 4];
    const float4 e0 = *reinterpret_cast<const float4*>(Es + lr * PT::ELD + part * 8);
    const float4 e1 = *reinterpret_cast<const float4*>(Es + lr * PT::ELD + part * 8 + 4);
    *reinterpret_cast<uint4*>(dst_row(lr, e_split, e_kvh * p.G) + part * 8) =
        make_uint4(pack_half2(e0.x * f, e0.z * f), pack_half2(e0.y * f, e0.w * f),
                   pack_half2(e1.x * f, e1.z * f), pack_half2(e1.y * f, e1.w * f));
  }
  if (vt.splits() > 1)
    for (int lr = reg_again<TID_X>(); lr < nrows(); lr += PT::THREADS)
      *ml_slot(lr, e_split, e_kvh * p.G) = make_float2(alpha_s[lr], red[lr * 4 + 1]);
}

}  // namespace sm70attn
