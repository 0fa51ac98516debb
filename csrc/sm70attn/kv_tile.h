// Paged KV gather: one tile of N tokens of K and V, staged in registers (SM70 has no cp.async)
// so the next tile's global loads overlap the current tile's math, then dequantized to fp16
// (value * 2^-8) into shared memory.
#pragma once

#include "sm70attn/e4m3.h"
#include "sm70attn/params.h"
#include "sm70attn/utils.h"

namespace sm70attn {

template <int VEC> struct LoadVec;
template <> struct LoadVec<16> { using type = uint4; };
template <> struct LoadVec<8> { using type = uint2; };

__device__ __forceinline__ void zero(uint4& x) { x = make_uint4(0u, 0u, 0u, 0u); }
__device__ __forceinline__ void zero(uint2& x) { x = make_uint2(0u, 0u); }

// Thread tid serves token j = tid / TPK of the tile and its chunks part = tid % TPK + l * TPK
// (l < LPT): the token's page and offset are found once (one FastDiv) and shared by its K and V
// chunks, so the per-byte gather cost is a few base-pointer loads. A warp's load l covers
// 32 / TPK tokens with TPK * VEC contiguous bytes each (whole 32-byte sectors).
template <class KT>
struct KvStage {
  using Vec = typename LoadVec<KT::VEC>::type;
  static constexpr int TPK = KT::TPK, LPT = KT::LPT;
  Vec k[LPT], v[LPT];
  bool ok;  // this thread's token is inside [t0, t_end) and its page id is valid

  // kb, vb: the KV head's base plus this thread's first chunk (tid % TPK * VEC).
  // Tokens >= t_end and tokens on a page id outside [0, num_pages) are not read (zeros);
  // the softmax masks them through the per-token flag.
  __device__ __forceinline__ void load(const PagedAttnParams& p, const unsigned char* kb,
                                       const unsigned char* vb, const int* bt, int t0, int t_end,
                                       int tid) {
    const int t = t0 + tid / TPK;
#pragma unroll
    for (int l = 0; l < LPT; ++l) zero(k[l]), zero(v[l]);
    ok = false;
    if ((KT::ACTIVE == KT::THREADS || tid < KT::ACTIVE) && t < t_end) {
      const int pi = fastdiv(t, FastDiv{p.page_div_m, p.page_div_l});  // < max_pages: t < t_end <= capacity
      const int page = __ldg(bt + pi);
      if (page >= 0 && page < p.num_pages) {
        const i64 off = t - pi * p.page_size;
        const unsigned char* kp = kb + page * p.k_stride_page + off * p.k_stride_tok;
        const unsigned char* vp = vb + page * p.v_stride_page + off * p.v_stride_tok;
#pragma unroll
        for (int l = 0; l < LPT; ++l) {
          k[l] = __ldg(reinterpret_cast<const Vec*>(kp + l * TPK * KT::VEC));
          v[l] = __ldg(reinterpret_cast<const Vec*>(vp + l * TPK * KT::VEC));
        }
        ok = true;
      }
    }
  }

  __device__ __forceinline__ void store(__half* Ks, __half* Vs, int* tok_ok, int tid) const {
    if (KT::ACTIVE == KT::THREADS || tid < KT::ACTIVE) {
      const int j = tid / TPK, q = tid % TPK;
#pragma unroll
      for (int l = 0; l < LPT; ++l) {
        const int part = q + l * TPK;
        store_chunk(Ks + j * KT::KLD + part * KT::VEC, k[l], part);
        store_chunk(Vs + j * KT::KLD + part * KT::VEC, v[l], part);
      }
      if (q == 0) tok_ok[j] = ok;
    }
  }

 private:
  // 8 bytes -> one 16-byte shared store; consecutive parts are contiguous.
  static __device__ __forceinline__ void store_chunk(__half* dst, const uint2& x, int) {
    uint4 h;
    e4m3x4_to_half4(x.x, h.x, h.y);
    e4m3x4_to_half4(x.y, h.z, h.w);
    *reinterpret_cast<uint4*>(dst) = h;
  }
  // 16 bytes -> two 16-byte shared stores 32 bytes apart per thread. Parts 4..7 (mod 8) store
  // their upper half first, so each quarter-warp store phase hits 8 distinct bank groups.
  static __device__ __forceinline__ void store_chunk(__half* dst, const uint4& x, int part) {
    uint4 h0, h1;
    e4m3x4_to_half4(x.x, h0.x, h0.y);
    e4m3x4_to_half4(x.y, h0.z, h0.w);
    e4m3x4_to_half4(x.z, h1.x, h1.y);
    e4m3x4_to_half4(x.w, h1.z, h1.w);
    const int sw = (part >> 2) & 1;
    uint4* d = reinterpret_cast<uint4*>(dst);
    d[sw] = sw ? h1 : h0;
    d[sw ^ 1] = sw ? h0 : h1;
  }
};

}  // namespace sm70attn
