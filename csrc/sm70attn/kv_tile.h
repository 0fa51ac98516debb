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

// Thread tid serves token j = token(tid) of the tile and its chunks part = part0(tid) + l * TPK
// (l < LPT): the token's page and offset are found once (one FastDiv) and shared by its K and V
// chunks, so the per-byte gather cost is a few base-pointer loads. A warp's load l covers
// 32 / TPK tokens with TPK * VEC contiguous bytes each (whole 32-byte sectors).
// With 16-byte chunks and TPK >= 4 (PAIRED) the threads of each aligned group of 8 take 4 chunks
// of two adjacent tokens, so each 8-thread phase of a 16-byte shared store hits 8 distinct
// 16-byte bank groups (the fp16 row stride is 16 bytes mod 128, chunk c of a token lands at
// 32 c): no bank conflicts, no data shuffling.
template <class KT>
struct KvStage {
  using Vec = typename LoadVec<KT::VEC>::type;
  static constexpr int TPK = KT::TPK, LPT = KT::LPT;
  static constexpr bool PAIRED = KT::VEC == 16 && TPK >= 4;
  Vec k[LPT], v[LPT];
  bool ok;  // this thread's token is inside [t0, t_end) and its page id is valid

  static __device__ __forceinline__ int token(int tid) {
    return PAIRED ? tid / (2 * TPK) * 2 + (tid >> 2 & 1) : tid / TPK;
  }
  static __device__ __forceinline__ int part0(int tid) {
    return PAIRED ? (tid & 3) | (tid >> 3 & (TPK / 4 - 1)) << 2 : tid % TPK;
  }

  // Registers start as zeros; a token that is not read keeps the previous tile's bytes. Either
  // way every byte decodes to a finite fp16 (e4m3.h), and the softmax gives that token P = 0.
  __device__ __forceinline__ KvStage() {
#pragma unroll
    for (int l = 0; l < LPT; ++l) zero(k[l]), zero(v[l]);
  }

  // kb, vb: the KV head's base plus this thread's first chunk (part0(tid) * VEC).
  // Tokens >= t_end and tokens on a page id outside [0, num_pages) are not read; the softmax
  // masks them through the per-token flag.
  __device__ __forceinline__ void load(const PagedAttnParams& p, const unsigned char* kb,
                                       const unsigned char* vb, const int* bt, int t0, int t_end,
                                       int tid) {
    const int t = t0 + token(tid);
    ok = false;
    if ((KT::ACTIVE == KT::THREADS || tid < KT::ACTIVE) && t < t_end) {
      const int pi = fastdiv(t, p.div_page);  // < max_pages: t < t_end <= capacity
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
      const int j = token(tid), q = part0(tid);
#pragma unroll
      for (int l = 0; l < LPT; ++l) {
        const int part = q + l * TPK;
        store_chunk(Ks + j * KT::KLD + part * KT::VEC, k[l]);
        store_chunk(Vs + j * KT::KLD + part * KT::VEC, v[l]);
      }
      if (q == 0) tok_ok[j] = ok;
    }
  }

  // One of the two tensors that load() staged (K: k[], and the token flags; V: v[]), for a kernel
  // that stores V over K once every warp is done with K (prefill.cuh at D 256).
  template <bool IS_V>
  __device__ __forceinline__ void store_tensor(__half* T, int* tok_ok, int tid) const {
    if (KT::ACTIVE == KT::THREADS || tid < KT::ACTIVE) {
      const int j = token(tid), q = part0(tid);
#pragma unroll
      for (int l = 0; l < LPT; ++l) store_chunk(T + j * KT::KLD + (q + l * TPK) * KT::VEC, IS_V ? v[l] : k[l]);
      if (!IS_V && q == 0) tok_ok[j] = ok;
    }
  }

  // One tensor at a time through one register stage (k[]; v[] stays unused), for a kernel that
  // stores V over K (paged_attention_rf.cuh): K's load also sets ok, and K's store the token
  // flags; a token not read is zeros. base: kb or vb as in load.
  template <bool IS_V>
  __device__ __forceinline__ void load_one(const PagedAttnParams& p, const unsigned char* base, const int* bt,
                                           int t0, int t_end, int tid) {
    const int t = t0 + token(tid);
    bool okk = false;
    if ((KT::ACTIVE == KT::THREADS || tid < KT::ACTIVE) && t < t_end) {
      const int pi = fastdiv(t, p.div_page);
      const int page = __ldg(bt + pi);
      if (page >= 0 && page < p.num_pages) {
        const i64 off = t - pi * p.page_size;
        const unsigned char* ptr = base + page * (IS_V ? p.v_stride_page : p.k_stride_page) +
                                   off * (IS_V ? p.v_stride_tok : p.k_stride_tok);
#pragma unroll
        for (int l = 0; l < LPT; ++l) k[l] = __ldg(reinterpret_cast<const Vec*>(ptr + l * TPK * KT::VEC));
        okk = true;
      }
    }
    if (!okk) {  // zeros, not the last tensor's bytes: the stage is dead between store and load
#pragma unroll
      for (int l = 0; l < LPT; ++l) zero(k[l]);
    }
    if (!IS_V) ok = okk;
  }

  template <bool IS_V>
  __device__ __forceinline__ void store_one(__half* T, int* tok_ok, int tid) const {
    if (KT::ACTIVE == KT::THREADS || tid < KT::ACTIVE) {
      const int j = token(tid), q = part0(tid);
#pragma unroll
      for (int l = 0; l < LPT; ++l) store_chunk(T + j * KT::KLD + (q + l * TPK) * KT::VEC, k[l]);
      if (!IS_V && q == 0) tok_ok[j] = ok;
    }
  }

 private:
  // 8 bytes -> one 16-byte shared store.
  static __device__ __forceinline__ void store_chunk(__half* dst, const uint2& x) {
    uint4 h;
    e4m3x4_to_half4(x.x, h.x, h.y);
    e4m3x4_to_half4(x.y, h.z, h.w);
    *reinterpret_cast<uint4*>(dst) = h;
  }
  // 16 bytes -> two 16-byte shared stores.
  static __device__ __forceinline__ void store_chunk(__half* dst, const uint4& x) {
    uint4 h0, h1;
    e4m3x4_to_half4(x.x, h0.x, h0.y);
    e4m3x4_to_half4(x.y, h0.z, h0.w);
    e4m3x4_to_half4(x.z, h1.x, h1.y);
    e4m3x4_to_half4(x.w, h1.z, h1.w);
    reinterpret_cast<uint4*>(dst)[0] = h0;
    reinterpret_cast<uint4*>(dst)[1] = h1;
  }
};

}  // namespace sm70attn
