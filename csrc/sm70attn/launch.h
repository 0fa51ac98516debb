// Host-side launches (torch-free): the binding checks inputs, fills the params, allocates the
// workspace the plan (plan.h) asks for and calls these on its current stream.
#pragma once

#ifndef __CUDACC_RTC__
#include <cuda_runtime.h>

#include "sm70attn/combine.cuh"
#include "sm70attn/paged_attention.cuh"
#include "sm70attn/paged_attention_rf.cuh"
#include "sm70attn/params.h"
#include "sm70attn/plan.h"
#include "sm70attn/static_switch.h"
#include "sm70attn/store_kv.cuh"
#include "sm70attn/traits.h"

namespace sm70attn {

// Calls f(kernel, threads, shared memory bytes) for the (kind, D, mb, vec) kernel; false when
// none is built (an RF kind only where attn_uses_rf(D, mb)).
template <class F>
inline bool attn_kernel(int kind, int d, int mb, int vec, F&& f) {
  if (kind == ATTN_WMMA)
    return attn_switch(d, mb, vec, [&](auto kt) {
      using KT = decltype(kt);
      f(paged_attention_kernel<KT>, KT::THREADS, KT::SMEM_BYTES);
    });
  if (kind != ATTN_RF_M8N8K4 && kind != ATTN_RF_M16N8K16) return false;
  return attn_rf_switch(d, mb, vec, [&](auto kt) {
    using KT = decltype(kt);
    if (kind == ATTN_RF_M8N8K4)
      f(paged_attention_rf_kernel<KT, MmaM8N8K4>, KT::THREADS, KT::SMEM_BYTES);
    else
      f(paged_attention_rf_kernel<KT, MmaM16N8K16>, KT::THREADS, KT::SMEM_BYTES);
  });
}

// Shared memory of the (kind, D, mb, vec) attention kernel (0: not built).
inline int attn_smem_bytes(int kind, int d, int mb, int vec) {
  int n = 0;
  attn_kernel(kind, d, mb, vec, [&](auto, int, int bytes) { n = bytes; });
  return n;
}

// p.num_splits / p.row_groups from the plan. cudaErrorInvalidValue: (kind, D, mb, vec) not
// built. smem_bytes: dynamic shared memory per CTA, at least the kernel's (0: the kernel's);
// more only caps how many CTAs share an SM (a benchmark's stand-in for a smaller SM). Launch
// errors are left for the caller's cudaGetLastError.
inline cudaError_t launch_paged_attention(const PagedAttnParams& params, int kind, int mb, int vec,
                                          cudaStream_t stream, int smem_bytes = 0) {
  PagedAttnParams p = params;
  set_divisors(p);
  cudaError_t err = cudaErrorInvalidValue;
  attn_kernel(kind, p.D, mb, vec, [&](auto kernel, int threads, int own) {
    const int smem = smem_bytes > own ? smem_bytes : own;
    err = smem > 48 * 1024 ? cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem)
                           : cudaSuccess;
    if (err != cudaSuccess) return;
    kernel<<<dim3(p.B * p.H_kv * p.row_groups, p.num_splits), threads, smem, stream>>>(p);
  });
  if (err != cudaSuccess || p.num_splits == 1) return err;
  err = cudaErrorInvalidValue;
  combine_switch(p.D, p.num_splits, [&](auto ct) {
    using CT = decltype(ct);
    const unsigned blocks = (unsigned)(((i64)p.B * p.H_q * p.Q + CT::ROWS - 1) / CT::ROWS);
    combine_kernel<CT><<<dim3(blocks, CT::D / CT::CW), CT::THREADS, CT::SMEM_BYTES, stream>>>(p);
    err = cudaSuccess;
  });
  return err;
}

// Resident CTAs per SM of the (kind, D, mb, vec) attention kernel on the current device (0: not
// built or the query failed), for plan_paged_attention's ctas_per_sm; smem_bytes as in
// launch_paged_attention. No work is enqueued (capture-safe).
inline int attn_ctas_per_sm(int kind, int d, int mb, int vec, int smem_bytes = 0) {
  int n = 0;
  attn_kernel(kind, d, mb, vec, [&](auto kernel, int threads, int own) {
    const int smem = smem_bytes > own ? smem_bytes : own;
    if (smem > 48 * 1024 &&
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess)
      return;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem) != cudaSuccess) n = 0;
  });
  if (n == 0) (void)cudaGetLastError();  // leave no error behind for the caller's launch check
  return n;
}

inline void launch_store_kv(const StoreKVParams& p, cudaStream_t stream) {
  const i64 items = (i64)p.T * p.H_kv * (p.vec8 ? p.D / 8 : p.D);
  if (items == 0) return;
  const i64 blocks = (items + StoreKVTraits::THREADS - 1) / StoreKVTraits::THREADS;
  store_kv_kernel<<<(unsigned)blocks, StoreKVTraits::THREADS, 0, stream>>>(p);
}

}  // namespace sm70attn
#endif  // __CUDACC_RTC__
