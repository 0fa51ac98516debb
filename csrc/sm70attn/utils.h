// Small device helpers shared by the kernels.
#pragma once

#include <cuda_fp16.h>

namespace sm70attn {

// Reductions within each aligned group of L lanes (L a power of two; all 32 lanes take part).
template <int L>
__device__ __forceinline__ float group_max(float x) {
#pragma unroll
  for (int o = L / 2; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

template <int L>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int o = L / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// One 16-byte shared-memory access per lane for 4 adjacent elements (p aligned to 16 bytes).
__device__ __forceinline__ void ld_vec(float (&d)[4], const float* p) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  d[0] = v.x, d[1] = v.y, d[2] = v.z, d[3] = v.w;
}
__device__ __forceinline__ void ld_vec(int (&d)[4], const int* p) {
  const int4 v = *reinterpret_cast<const int4*>(p);
  d[0] = v.x, d[1] = v.y, d[2] = v.z, d[3] = v.w;
}

// Whether any of the W bytes at f (aligned to W; W = 1, 2 or 4: warps per row block) is
// nonzero: one load.
template <int W>
__device__ __forceinline__ bool any_byte(const unsigned char* f) {
  static_assert(W == 1 || W == 2 || W == 4, "byte count");
  if (W == 4) return *reinterpret_cast<const unsigned*>(f) != 0u;
  if (W == 2) return *reinterpret_cast<const unsigned short*>(f) != 0;
  return *f != 0;
}

// A special register read again (volatile: not merged with other reads), so that values
// derived from it need not be held in registers across a loop: reg_again<TID_X>() is
// threadIdx.x, CTAID_X and CTAID_Y blockIdx.x and .y.
enum SpecialReg { TID_X, CTAID_X, CTAID_Y };
template <SpecialReg R>
__device__ __forceinline__ int reg_again() {
#if defined(__CUDACC__)
  int t;
  if (R == TID_X) asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  if (R == CTAID_X) asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(t));
  if (R == CTAID_Y) asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(t));
  return t;
#else
  return (int)(R == TID_X ? threadIdx.x : R == CTAID_X ? blockIdx.x : blockIdx.y);
#endif
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// 2^x for a softmax's P (x <= 0): the MUFU instruction alone, subnormal results flushed to 0
// (exp2f adds its range handling: 24 instructions a tile). The CPU emulator takes exp2f.
__device__ __forceinline__ float ex2_approx(float x) {
#if defined(__CUDACC__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return x < -126.f ? 0.f : exp2f(x);
#endif
}

__device__ __forceinline__ unsigned pack_half2(float a, float b) {
  return (unsigned)__half_as_ushort(__float2half_rn(a)) |
         ((unsigned)__half_as_ushort(__float2half_rn(b)) << 16);
}

// A split's partial O is acc 2^(12 - e), 2^e the power of two of its row sum l (2^e <= l <
// 2^(e+1); params.h). Scaling by a power of two rounds nothing and costs two integer
// instructions (no division). Since |acc| <= l max|V|, |acc / 2^e| < 2 max|V| (3.75 in the
// kernels' 2^-8 units), so the 2^12 puts the partials at most 15360, under fp16's 65504, and
// moves fp16's subnormals (below 2^-14, where its precision is absolute) down by 2^12: without
// it a partial of 2^-14 kernel units (2^-6 v_scale) already lost relative precision. The
// combine takes the 2^12 out in its final factor, exactly. partial_scale: 2^(12 - e), 0 where
// l = 0 (a row that saw nothing; its acc is 0); l < 2^40 (the lazy rescale bounds p by 2^8).
// partial_weight: 2^e, which the combine weighs the partial by (0 for l = 0, +inf for a NaN
// l: the row comes out NaN, as it should).
__device__ __forceinline__ float partial_scale(float l) {
  return l > 0.f ? __uint_as_float(((254u + 12u) << 23) - (__float_as_uint(l) & 0x7f800000u)) : 0.f;
}
__device__ __forceinline__ float partial_weight(float l) { return __uint_as_float(__float_as_uint(l) & 0x7f800000u); }

// 4 floats -> fp16 (round to nearest even), one 8-byte shared-memory store.
__device__ __forceinline__ void st_half_vec(__half* p, const float (&v)[4]) {
  *reinterpret_cast<uint2*>(p) = make_uint2(pack_half2(v[0], v[1]), pack_half2(v[2], v[3]));
}

}  // namespace sm70attn
