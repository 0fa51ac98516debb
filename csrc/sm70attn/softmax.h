// The WMMA kernel's online softmax (paged_attention.cuh): over each tile of N tokens, fp32, the
// scores S (KS partial buffers in shared memory) of the rows a warp owns -> P (fp16, over S) and
// each row's O rescale factor alpha, the rows' running max and sum kept across tiles. The
// register-fragment kernel has its own (lazy rescale, rows in registers: paged_attention_rf.cuh).
//
// Rows of a warp: the RPW = 16 / WN consecutive rows from wrow0 = mblk * 16 + wn * RPW, RPP per
// pass. Lane group grp (LPR = 8 lanes) of pass k owns row lr = wrow0 + k RPP + grp and takes the
// tokens j = 4 (gl + LPR h) + c of each tile (h < TPL / 4, c < 4; gl: lane in group; one 16-byte
// load per lane and h). Consecutive rows let a warp whose rows are all padding (decode: G * Q <
// 16) skip the pass. `last` is the last position a row sees (the CTA's last(): cta.h's visibility
// rule; padding rows see none). With at most two passes and registers to spare (every shape we
// tune for) the row's running max and sum and `last` live in registers of its lane group (REGS);
// otherwise in shared memory (registers would spill).
//
// The caller holds the rows' state (last, m_run, l_run: RP each) and the step's arrays as its own
// separate arrays and passes them in: as members of one object, or as the step's own locals, they
// changed the order of the kernel's registers and with it ptxas's code.
#pragma once

#include "sm70attn/params.h"
#include "sm70attn/utils.h"

namespace sm70attn {

template <class KT>
struct SoftmaxRows {
  static constexpr int LPR = 8, TPL = KT::N / LPR, H = TPL / 4, RPP = 32 / LPR, RPW = 16 / KT::WN;
  static constexpr int PASSES = RPW / RPP;
  static_assert(PASSES >= 1 && RPW % RPP == 0 && TPL % 4 == 0, "softmax rows per warp");
  static constexpr bool REGS = PASSES <= 2 && KT::ROOMY;
  static constexpr int RP = REGS ? PASSES : 1;
};

// Before the first tile: each row's last visible position, and its max and sum (-inf, 0) in
// registers (REGS) or in row_m, row_l.
template <class KT, class Cta, int RP>
__device__ __forceinline__ void softmax_init(const PagedAttnParams& p, const Cta& cta, int tid, int grp, int wrow0,
                                             int (&last)[RP], float (&m_run)[RP], float (&l_run)[RP], float* row_m,
                                             float* row_l) {
  using R = SoftmaxRows<KT>;
#pragma unroll
  for (int k = 0; k < RP; ++k) {
    last[k] = cta.last(p, wrow0 + k * R::RPP + grp);
    m_run[k] = neg_inf(), l_run[k] = 0.f;
  }
  if (!R::REGS) {
    for (int i = tid; i < KT::ROWS; i += KT::THREADS) row_m[i] = neg_inf(), row_l[i] = 0.f;
    // (ordered before the first softmax by the loop's barriers)
  }
}

// The tile from position t0: RPP rows per warp pass, one log2(LPR)-step shuffle reduction for
// all of them. S (Ss) scaled by sl2 into log2 units; tokens on invalid pages (tok_ok) are masked
// like invisible ones; a padding row sees nothing, so its P and alpha come out 0 and its O
// stays 0. P goes over S's rows (Ps), alpha to As (16 copies a row: row i of a 16 x 16 tile).
// `moved` (a byte a warp): whether any row of the warp's non-skipped passes that has seen a
// token before this tile has alpha != 1 (its max moved), so PV can skip rescaling O when none
// has. A row that has seen none (m_old = -inf: every padding row, and a real row before its
// first token) has O = 0 and alpha = 0, so skipping its rescale is bitwise the same; counting
// it rescaled every decode tile at G * Q < 16, where padding rows share a pass with real ones.
// ok, s, t: the step's arrays (page flags, a row's scores, a partial buffer's).
template <class KT, class Cta, int RP, int H>
__device__ __forceinline__ void softmax_tile(const PagedAttnParams& p, const Cta& cta, int t0, float sl2, int lane,
                                             int warp, int gl, int grp, int wrow0, int (&last)[RP], float (&m_run)[RP],
                                             float (&l_run)[RP], const float* Ss, __half* Ps, float* As, float* row_m,
                                             float* row_l, const int* tok_ok, unsigned char* moved, int (&ok)[H][4],
                                             float (&s)[H][4], float (&t)[4]) {
  using R = SoftmaxRows<KT>;
  constexpr int ROWS = KT::ROWS, LPR = R::LPR, RPP = R::RPP, PASSES = R::PASSES;
  constexpr bool REGS = R::REGS;
  static_assert(RP == R::RP && H == R::H, "the caller's arrays");
  auto row_of = [&](int k) { return wrow0 + k * RPP + grp; };
#pragma unroll
  for (int h = 0; h < H; ++h) ld_vec(ok[h], tok_ok + 4 * (gl + LPR * h));
  bool mv = false;
#pragma unroll(REGS ? PASSES : 1)
  for (int k = 0; k < PASSES; ++k) {
    const int lr = row_of(k);
    if (wrow0 + k * RPP >= cta.nrows) {  // all rows padding (warp-uniform): P = 0, alpha = 0
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
    const int lim = (REGS ? last[REGS ? k : 0] : cta.last(p, lr)) - t0 - gl * 4;  // vs c + 4 LPR h
#pragma unroll
    for (int h = 0; h < H; ++h) ld_vec(s[h], Ss + lr * KT::SLD + 4 * (gl + LPR * h));
#pragma unroll
    for (int q = 1; q < KT::KS; ++q) {  // partial scores, added in buffer order
#pragma unroll
      for (int h = 0; h < H; ++h) {
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
    for (int i = gl; i < 16; i += LPR) As[lr * KT::SLD + i] = alpha;
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

// After the last tile: the rows' max and sum to row_m, row_l (where REGS kept them in registers).
template <class KT, int RP>
__device__ __forceinline__ void softmax_store(int grp, int gl, int wrow0, const float (&m_run)[RP],
                                              const float (&l_run)[RP], float* row_m, float* row_l) {
  using R = SoftmaxRows<KT>;
  if (R::REGS && gl == 0) {
#pragma unroll
    for (int k = 0; k < RP; ++k) {
      const int lr = wrow0 + k * R::RPP + grp;
      row_m[lr] = m_run[k], row_l[lr] = l_run[k];
    }
  }
}

}  // namespace sm70attn
