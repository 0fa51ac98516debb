// Paged attention for D = 256 verify (2-3 row blocks of 16 query rows) with S, the softmax and O
// in registers, on the MMA atoms of mma_atoms.h: m8n8k4 on SM70, m16n8k16 (the twin a newer GPU
// times) elsewhere. Same op, same semantics as paged_attention.cuh, whose header says what a
// CTA is; what differs is the tile:
//   warp w = (row block rb = w / 4, tg = w % 4). Per tile of 32 tokens:
//   gather+dequant K -> smem T | S[16 x 8] = Q K^T for rows of rb, tokens 8 tg.. (registers) |
//   row max over the warp (shuffles), over the row block's 4 warps (smem) | V -> smem T over K |
//   P = exp2(S - m) -> smem, alpha scales O in registers | O[16 x 64] += P V for columns 64 tg..
// Four barriers per tile. Each warp keeps the sum of P over its own tokens; the row block's four
// sums are added once, in warp order, in the epilogue. Shared memory is Q, one tile, P and the
// row state (traits.h: AttnRfTraits): 47 KB, so two CTAs share a V100 SM (the WMMA kernel takes
// 94 KB), in 80 registers a thread: across the tile loop a thread holds O (32), one register
// stage of K or V and little else. The rows' limits, the gather's bases and the epilogue's
// values wait in shared memory, indices from threadIdx are recomputed, the stage is zeroed
// where nothing is read (so it is dead between its store and the next load), and the epilogue
// is unrolled (O is dead once stored); each of these took spills away on sm_70.
// The layouts a lane's registers hold come from the atoms' documented fragment maps
// (mma_atoms.h); RfOps below is all that differs between the two atoms.
#pragma once

#include "sm70attn/cta.h"
#include "sm70attn/epilogue.h"
#include "sm70attn/kv_tile.h"
#include "sm70attn/mma_atoms.h"
#include "sm70attn/params.h"
#include "sm70attn/traits.h"
#include "sm70attn/utils.h"

namespace sm70attn {

template <class Atom>
struct RfOps;

// m8n8k4 (SM70). Quad-pair g = lane % 16 / 4 of a warp computes an 8x8 block: in QK^T rows
// 8 (g / 2).. of the row block over D half g % 2, the two halves added with one shuffle (lane
// ^ 4 holds the other); in PV rows 8 (g / 2).. and the 4 column blocks of 8 from 32 (g % 2).
// A lane's S and O elements lie in two rows of the block (slots 0, 1): the same two in S and
// O, so alpha stays in registers. Both lanes of a quad-pair pair hold the same S (each does the
// softmax of one row).
template <>
struct RfOps<MmaM8N8K4> {
  static constexpr int SE = 8;            // S elements a lane holds
  static constexpr int OB = 4, OE = 8;     // O: OB atom accumulators of OE elements
  static constexpr int XOR0 = 2, XOR1 = 0;  // lanes holding the other tokens of a lane's rows
  static __device__ __forceinline__ int g(int lane) { return lane % 16 / 4; }
  static __device__ __forceinline__ int row(int lane, int slot) {
    return 8 * (lane % 16 / 8) + (lane & 1) + 2 * slot + 4 * (lane / 16);
  }
  // The softmax: the two lanes of a quad-pair pair (lane, lane ^ 4) hold the same S, so each
  // takes one of the two rows (OS = 1 owned slot, g % 2) and its EPS = 4 elements, columns
  // (lane & 2) + 0, 1, 4, 5; lane ^ 2 holds the row's other 4 tokens of the warp.
  static constexpr int OS = 1, EPS = 4;
  static __device__ __forceinline__ int own_slot(int lane, int) { return g(lane) & 1; }
  static __device__ __forceinline__ void own(const float (&s)[8], float (&e)[1][4], int lane) {
    const bool hi = g(lane) & 1;  // element i of S is in slot i / 2 % 2, column (i & 4) + (i & 1)
#pragma unroll
    for (int j = 0; j < 4; ++j) e[0][j] = hi ? s[(j & 2) * 2 + (j & 1) + 2] : s[(j & 2) * 2 + (j & 1)];
  }
  static __device__ __forceinline__ int own_col(int lane, int j) { return (j & 2) * 2 + (lane & 2) + (j & 1); }
  static __device__ __forceinline__ bool own_writer(int lane) { return (lane & 2) == 0; }
  // O's two slots' alpha from the owned one: the pair lane ^ 4 owns the other.
  static __device__ __forceinline__ void o_alpha(const float (&a)[1], float (&out)[2], int lane) {
    const float other = __shfl_xor_sync(0xffffffffu, a[0], 4);
    const bool hi = g(lane) & 1;
    out[0] = hi ? other : a[0], out[1] = hi ? a[0] : other;
  }
  static __device__ __forceinline__ int o_slot(int e) { return e >> 1 & 1; }
  static __device__ __forceinline__ int o_col(int lane, int e) {  // n = (e & 4) + (lane & 2) + (e & 1), j = e / 8
    return 32 * (g(lane) & 1) + 4 * (e & 4) + 4 * (e / 8) + (lane & 2) + (e & 1);
  }

  // s = Q K^T for the row block's 16 rows (qa: its first Q row group) and 8 tokens (kt: their
  // first row in T). A D half takes 4 chunks of 32 columns; half 1 starts with its second chunk,
  // so the two halves' loads of one step fall in different banks. Unrolled whole: constant
  // shared-memory offsets.
  template <class KT>
  static __device__ __forceinline__ void qk(float (&s)[8], const __half* qa, const __half* kt, int lane) {
    constexpr int CHUNKS = KT::D / 2 / 32;
    const int gg = g(lane), dh = gg & 1, r = lane % 4 + 4 * (lane / 16);
    const __half* qp = qa + (gg >> 1) * KT::Q_GROUP + r * KT::QLD + dh * (KT::D / 2);
    const __half* kp = kt + r * KT::KLD + dh * (KT::D / 2);
#pragma unroll
    for (int i = 0; i < 8; ++i) s[i] = 0.f;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
      const int off = (c + dh) % CHUNKS * 32;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const uint2 a = *reinterpret_cast<const uint2*>(qp + off + 4 * k);
        const uint2 b = *reinterpret_cast<const uint2*>(kp + off + 4 * k);
        const unsigned af[2] = {a.x, a.y}, bf[2] = {b.x, b.y};
        mma_atom(MmaM8N8K4{}, s, af, bf, s);
      }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) s[i] += __shfl_xor_sync(0xffffffffu, s[i], 4);  // a + b = b + a
  }

  // o += P V for the row block's rows (pa: its first P row) and the warp's columns (vt: the
  // first in T). Column n of accumulator j is V column 32 (g % 2) + 16 (n / 4) + 4 j + n % 4, so
  // the 16 columns a lane's B fragments take in one k-step are adjacent: two 16-byte loads.
  template <class KT>
  static __device__ __forceinline__ void pv(float (&o)[OB][OE], const __half* pa, const __half* vt, int lane) {
    const int gg = g(lane), r = lane % 4 + 4 * (lane / 16);
    const __half* pp = pa + (8 * (gg >> 1) + r) * KT::PLD;
    const __half* vp = vt + (lane % 4) * KT::KLD + 32 * (gg & 1) + 16 * (lane / 16);
#pragma unroll
    for (int k = 0; k < KT::N / 4; ++k) {
      const uint2 a = *reinterpret_cast<const uint2*>(pp + 4 * k);
      const unsigned af[2] = {a.x, a.y};
      const uint4 b0 = *reinterpret_cast<const uint4*>(vp + 4 * k * KT::KLD);
      const uint4 b1 = *reinterpret_cast<const uint4*>(vp + 4 * k * KT::KLD + 8);
      const unsigned bf[4][2] = {{b0.x, b0.y}, {b0.z, b0.w}, {b1.x, b1.y}, {b1.z, b1.w}};
#pragma unroll
      for (int j = 0; j < 4; ++j) mma_atom(MmaM8N8K4RowRow{}, o[j], af, bf[j], o[j]);
    }
  }
};

// m16n8k16 (SM80+): the warp computes the 16x8 S block whole, and O as 8 blocks of 16x8.
template <>
struct RfOps<MmaM16N8K16> {
  static constexpr int SE = 4;
  static constexpr int OB = 8, OE = 4;
  static constexpr int XOR0 = 1, XOR1 = 2;
  static __device__ __forceinline__ int row(int lane, int slot) { return lane / 4 + 8 * slot; }
  // The softmax: a lane owns both its rows (slots), 2 elements each, columns 2 (lane % 4) + 0, 1.
  static constexpr int OS = 2, EPS = 2;
  static __device__ __forceinline__ int own_slot(int, int k) { return k; }
  static __device__ __forceinline__ void own(const float (&s)[4], float (&e)[2][2], int) {
    e[0][0] = s[0], e[0][1] = s[1], e[1][0] = s[2], e[1][1] = s[3];
  }
  static __device__ __forceinline__ int own_col(int lane, int j) { return 2 * (lane % 4) + j; }
  static __device__ __forceinline__ bool own_writer(int lane) { return lane % 4 == 0; }
  static __device__ __forceinline__ void o_alpha(const float (&a)[2], float (&out)[2], int) { out[0] = a[0], out[1] = a[1]; }
  static __device__ __forceinline__ int o_slot(int e) { return e >> 1 & 1; }
  static __device__ __forceinline__ int o_col(int lane, int e) { return 8 * (e / 4) + 2 * (lane % 4) + (e & 1); }

  static __device__ __forceinline__ unsigned ld32(const __half* p) { return *reinterpret_cast<const unsigned*>(p); }

  template <class KT>
  static __device__ __forceinline__ void qk(float (&s)[4], const __half* qa, const __half* kt, int lane) {
    const __half* q0 = qa + (lane / 4) * KT::QLD + 2 * (lane % 4);
    const __half* q1 = q0 + KT::Q_GROUP;  // rows 8..15
    const __half* kp = kt + (lane / 4) * KT::KLD + 2 * (lane % 4);
#pragma unroll
    for (int i = 0; i < 4; ++i) s[i] = 0.f;
#pragma unroll
    for (int k = 0; k < KT::D / 16; ++k) {
      const unsigned af[4] = {ld32(q0 + 16 * k), ld32(q1 + 16 * k), ld32(q0 + 16 * k + 8), ld32(q1 + 16 * k + 8)};
      const unsigned bf[2] = {ld32(kp + 16 * k), ld32(kp + 16 * k + 8)};
      mma_atom(MmaM16N8K16{}, s, af, bf, s);
    }
  }

  template <class KT>
  static __device__ __forceinline__ void pv(float (&o)[OB][OE], const __half* pa, const __half* vt, int lane) {
    const __half* p0 = pa + (lane / 4) * KT::PLD + 2 * (lane % 4);
    const __half* p1 = p0 + 8 * KT::PLD;
    const __half* vr = vt + (lane / 8 % 2 * 8 + lane % 8) * KT::KLD + 8 * (lane / 16);
#pragma unroll
    for (int k = 0; k < KT::N / 16; ++k) {
      const unsigned af[4] = {ld32(p0 + 16 * k), ld32(p1 + 16 * k), ld32(p0 + 16 * k + 8), ld32(p1 + 16 * k + 8)};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        unsigned r[4];
        ldsm_x4_trans(r, vr + 16 * k * KT::KLD + 16 * j);
        const unsigned b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
        mma_atom(MmaM16N8K16{}, o[2 * j], af, b0, o[2 * j]);
        mma_atom(MmaM16N8K16{}, o[2 * j + 1], af, b1, o[2 * j + 1]);
      }
    }
  }
};

template <class KT, class Atom>
__global__ void __launch_bounds__(KT::THREADS, KT::MIN_BLOCKS)
    paged_attention_rf_kernel(const PagedAttnParams p) {
  using Ops = RfOps<Atom>;
  constexpr int D = KT::D, N = KT::N, ROWS = KT::ROWS, TG = KT::TG, SE = Ops::SE;
  constexpr unsigned FULL = 0xffffffffu;

  extern __shared__ __align__(128) unsigned char smem[];
  __half* Qs = reinterpret_cast<__half*>(smem + KT::Q_OFF);    // [2 MB groups][Q_GROUP]: 8 rows of QLD
  __half* Ts = reinterpret_cast<__half*>(smem + KT::T_OFF);    // [N][KLD]: K, then V
  __half* Ps = reinterpret_cast<__half*>(smem + KT::P_OFF);    // [ROWS][PLD]
  float* red = reinterpret_cast<float*>(smem + KT::RED_OFF);   // [ROWS][TG]
  int* tok_ok = reinterpret_cast<int*>(smem + KT::TOK_OFF);    // [N]
  float* row_m = reinterpret_cast<float*>(smem + KT::ML_OFF);  // epilogue: row max (log2 units)
  float* row_l = row_m + ROWS;                                 // and row sum
  int* last_s = reinterpret_cast<int*>(smem + KT::LAST_OFF);   // [ROWS] last visible token
  // out_row0, split | nrows << 32, the KV head's K and V bases, the block table row, v_scale
  i64* meta = reinterpret_cast<i64*>(smem + KT::META_OFF);
  float* Es = reinterpret_cast<float*>(smem);                  // [ROWS][ELD], epilogue only

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int rb = warp / TG, tg = warp % TG;

  const int split = blockIdx.y;
  PagedCta<KT> cta;  // paged_attention's CTA (cta.h), its values kept in registers or shared memory below
  cta.init(p, split, smem);
  const int b = cta.b, kvh = cta.kvh, row0 = cta.row0, nrows = cta.nrows, len = cta.len;
  const i64 out_row0 = cta.out_row0;
  const int t_begin = cta.t_begin, t_end = cta.t_end;

  if (t_begin >= t_end) {
    store_empty<KT>(p, cta, tid);
    return;
  }

  // Q rows -> fp16 shared memory in groups of 8 rows (two 8-byte stores: a group starts 8 bytes
  // off 16), D permuted within groups of 4 like K and V; padding rows are zero.
  for (int c = tid; c < ROWS * (D / 8); c += KT::THREADS) {
    const int lr = c / (D / 8), part = c % (D / 8);
    uint4 x = make_uint4(0u, 0u, 0u, 0u);
    if (lr < nrows) x = load_q8(cta.q_row(p, lr, part), p.q_vec16);
    uint2* dst = reinterpret_cast<uint2*>(Qs + lr / 8 * KT::Q_GROUP + lr % 8 * KT::QLD + part * 8);
    dst[0] = make_uint2(__byte_perm(x.x, x.y, 0x5410), __byte_perm(x.x, x.y, 0x7632));
    dst[1] = make_uint2(__byte_perm(x.z, x.w, 0x5410), __byte_perm(x.z, x.w, 0x7632));
  }

  constexpr int OB = Ops::OB, OE = Ops::OE;
  float o[OB][OE];  // O[rows of rb][columns 64 tg + Ops::o_col(lane, OE j + i)], unnormalised
#pragma unroll
  for (int j = 0; j < OB; ++j)
#pragma unroll
    for (int i = 0; i < OE; ++i) o[j][i] = 0.f;

  const float sl2 = p.scale_log2 * __ldg(p.k_scale + kvh * p.k_scale_stride) * 256.f;

  // Each row's last visible position (cta.h: last_visible; padding rows none) and the values the
  // epilogue needs go to shared memory (ordered by the loop's first barrier): registers held
  // across the tile loop are what two CTAs per SM70 SM lack.
  for (int lr = tid; lr < ROWS; lr += KT::THREADS) last_s[lr] = PagedCta<KT>::last_of(p, row0, nrows, len, lr);
  if (tid == 0) {
    meta[0] = out_row0, meta[1] = (i64)split | (i64)nrows << 32;
    meta[2] = reinterpret_cast<i64>(p.k + kvh * p.k_stride_head);
    meta[3] = reinterpret_cast<i64>(p.v + kvh * p.v_stride_head);
    meta[4] = reinterpret_cast<i64>(p.block_table + b * p.bt_stride_b);
    meta[5] = __float_as_uint(__ldg(p.v_scale + kvh * p.v_scale_stride) * 256.f);
  }
  // The gather's bases, read back where they are used (this thread's first chunk added).
  auto kbase = [&] { return reinterpret_cast<const unsigned char*>(meta[2]) + KvStage<KT>::part0(reg_again<TID_X>()) * KT::VEC; };
  auto vbase = [&] { return reinterpret_cast<const unsigned char*>(meta[3]) + KvStage<KT>::part0(reg_again<TID_X>()) * KT::VEC; };
  auto btab = [&] { return reinterpret_cast<const int*>(meta[4]); };

  // The rows of the block whose softmax this lane does (Ops::OS of its two), their running max,
  // and the sum of P over this warp's tokens.
  constexpr int OS = Ops::OS, EPS = Ops::EPS;
  // (rows recomputed where used, from threadIdx read again: not held across the loop)
  auto orow = [&](int k) {
    const int t = reg_again<TID_X>(), l = t & 31;
    return 16 * (t / 32 / TG) + Ops::row(l, Ops::own_slot(l, k));
  };
  float m_run[OS], l_run[OS];
#pragma unroll
  for (int k = 0; k < OS; ++k) m_run[k] = neg_inf(), l_run[k] = 0.f;

  // One register stage: K(i) is stored, V(i) loaded into the same registers during QK^T and
  // stored over K, then K(i + 1) loaded during the softmax and PV.
  KvStage<KT> st;
  __syncthreads();  // Q, last_s and meta stored
  st.template load_one<false>(p, kbase(), btab(), t_begin, t_end, tid);
  for (int t0 = t_begin; t0 < t_end; t0 += N) {
    __syncthreads();  // previous PV done with T and P (first tile: Q stored)
    st.template store_one<false>(Ts, tok_ok, reg_again<TID_X>());
    st.template load_one<true>(p, vbase(), btab(), t0, t_end, reg_again<TID_X>());
    __syncthreads();

    float s[SE];
    Ops::template qk<KT>(s, Qs + 2 * rb * KT::Q_GROUP, Ts + 8 * tg * KT::KLD, lane);
    // Mask (future tokens, invalid pages), scale to log2 units; the row maxima of this warp's
    // tokens go to red for the row block's other warps.
    // Token t of the tile is visible to a row if bit t of its mask is: the tile's valid pages
    // (one flag a lane: N = 32) below the row's causal limit.
    static_assert(N == 32, "one token a lane");
    const unsigned ok_bits = __ballot_sync(FULL, tok_ok[lane]);
    float e[OS][EPS], mx[OS];
    Ops::own(s, e, lane);
#pragma unroll
    for (int k = 0; k < OS; ++k) {
      const int lim = last_s[orow(k)] - t0;  // the row's last visible token of the tile
      const unsigned vis = (ok_bits & (lim >= N - 1 ? ~0u : lim < 0 ? 0u : (2u << lim) - 1u)) >>
                           (8 * tg + Ops::own_col(lane, 0));
      mx[k] = neg_inf();
#pragma unroll
      for (int j = 0; j < EPS; ++j) {  // (own_col(lane, j) - own_col(lane, 0) is a constant)
        e[k][j] = vis >> (Ops::own_col(lane, j) - Ops::own_col(lane, 0)) & 1u ? e[k][j] * sl2 : neg_inf();
        mx[k] = fmaxf(mx[k], e[k][j]);
      }
      mx[k] = fmaxf(mx[k], __shfl_xor_sync(FULL, mx[k], Ops::XOR0));
      if (Ops::XOR1) mx[k] = fmaxf(mx[k], __shfl_xor_sync(FULL, mx[k], Ops::XOR1));
      if (Ops::own_writer(lane)) red[orow(k) * TG + tg] = mx[k];
    }
    __syncthreads();  // every warp done with K; the maxima are in red

    st.template store_one<true>(Ts, tok_ok, reg_again<TID_X>());  // V over K

    // Online softmax, fp32, with a lazy rescale: a row's m moves only when the tile's maximum
    // passes it by more than RESCALE_LOG2 (then P <= 2^RESCALE_LOG2, which fp16 holds), so O
    // and l are rescaled on few tiles. Every warp of the row block reads the same four maxima
    // and holds the same m, so all agree. A row that has seen no token (m = -inf: every padding
    // row) gets p = 0 and alpha = 0 on an O that is 0; skipping the rescale when no other row
    // moved is bitwise the same.
    float alpha[OS];
    bool mv = false;
#pragma unroll
    for (int k = 0; k < OS; ++k) {
      const float4 r = *reinterpret_cast<const float4*>(red + orow(k) * TG);
      const float t_max = fmaxf(fmaxf(r.x, r.y), fmaxf(r.z, r.w));
      const bool up = t_max > m_run[k] + KT::RESCALE_LOG2;  // (m = -inf: any visible token)
      const float m_new = up ? t_max : m_run[k];
      const float m_use = m_new == neg_inf() ? 0.f : m_new;
      alpha[k] = up ? ex2_approx(m_run[k] - m_use) : 1.f;
      mv |= up && m_run[k] != neg_inf();
      m_run[k] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < EPS; ++j) {
        e[k][j] = ex2_approx(e[k][j] - m_use);
        sum += e[k][j];
      }
#pragma unroll
      for (int j = 0; j < EPS; j += 2)  // elements j, j + 1: adjacent tokens
        *reinterpret_cast<unsigned*>(Ps + orow(k) * KT::PLD + 8 * tg + Ops::own_col(lane, j)) =
            pack_half2(e[k][j], e[k][j + 1]);
      sum += __shfl_xor_sync(FULL, sum, Ops::XOR0);
      if (Ops::XOR1) sum += __shfl_xor_sync(FULL, sum, Ops::XOR1);
      l_run[k] = l_run[k] * alpha[k] + sum;
    }
    float a2[2];  // alpha of O's two slots
    Ops::o_alpha(alpha, a2, lane);
    if (__any_sync(FULL, mv)) {
#pragma unroll
      for (int j = 0; j < OB; ++j)
#pragma unroll
        for (int i = 0; i < OE; ++i) o[j][i] *= a2[Ops::o_slot(OE * j + i)];
    }
    st.template load_one<false>(p, kbase(), btab(), t0 + N, t_end, reg_again<TID_X>());  // zeros past t_end
    __syncthreads();  // V and P stored

    Ops::template pv<KT>(o, Ps + 16 * rb * KT::PLD, Ts + KT::DW * tg, lane);
  }

  // Epilogue. Row state: m is the same in the row block's warps; l is their four sums, added in
  // warp order.
  __syncthreads();  // every warp done with T, P and red's maxima
  const i64 e_row0 = meta[0];
  const int e_split = (int)meta[1], e_nrows = (int)(meta[1] >> 32);
#pragma unroll
  for (int k = 0; k < OS; ++k)
    if (Ops::own_writer(lane)) {
      red[orow(k) * TG + tg] = l_run[k];
      if (tg == 0) row_m[orow(k)] = m_run[k];
    }
  __syncthreads();
  // Each row's sum, and the factor its O takes (into red's first column, read by then): out's
  // normalisation (* v_scale * 2^8), or the split's partial's (params.h).
  for (int i = tid; i < ROWS; i += KT::THREADS) {
    const float4 r = *reinterpret_cast<const float4*>(red + i * TG);
    const float l = ((r.x + r.y) + r.z) + r.w;
    row_l[i] = l;
    red[i * TG] = p.num_splits > 1 ? partial_scale(l) : l > 0.f ? __uint_as_float((unsigned)meta[5]) / l : 0.f;
  }
  // O -> smem (fp32, half of D at a time) -> coalesced fp16 rows of out or of the split's
  // partials; columns in the permuted D order (e4m3.h).
#pragma unroll  // (o is dead once its half is stored)
  for (int h = 0; h < 2; ++h) {
    __syncthreads();  // row_l written; the previous half read out of Es
    if (tg / 2 == h) {
#pragma unroll
      for (int j = 0; j < OB; ++j)
#pragma unroll
        for (int i = 0; i < OE; ++i)
          Es[(16 * rb + Ops::row(lane, Ops::o_slot(OE * j + i))) * KT::ELD + KT::DW * (tg % 2) +
             Ops::o_col(lane, OE * j + i)] = o[j][i];
    }
    __syncthreads();
    constexpr int HD = D / 2;
    for (int c = reg_again<TID_X>(); c < e_nrows * (HD / 8); c += KT::THREADS) {
      const int lr = c / (HD / 8), part = c % (HD / 8);
      const float f = red[lr * TG];
      const float4 e0 = *reinterpret_cast<const float4*>(Es + lr * KT::ELD + part * 8);
      const float4 e1 = *reinterpret_cast<const float4*>(Es + lr * KT::ELD + part * 8 + 4);
      *reinterpret_cast<uint4*>(PagedCta<KT>::dst_row_of(p, e_row0, e_split, lr) + h * HD + part * 8) = pack8(e0, e1, f);
    }
  }
  if (p.num_splits > 1)
    for (int lr = reg_again<TID_X>(); lr < e_nrows; lr += KT::THREADS)
      *PagedCta<KT>::ml_slot_of(p, e_row0, lr, e_split) = make_float2(row_m[lr], row_l[lr]);
}

}  // namespace sm70attn
