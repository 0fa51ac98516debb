// store_kv: cache[page, offset, h, :] = e4m3(clamp((float)x / scale, -448, 448)) for every
// token whose slot (page * page_size + offset) is in [0, P * page_size); others are skipped.
#pragma once

#include "sm70attn/e4m3.h"
#include "sm70attn/params.h"
#include "sm70attn/traits.h"

namespace sm70attn {

// IEEE division (__fdiv_rn: no approximate division even under fast-math; flushing denormals
// cannot change the result, they quantize to +-0 anyway), then the saturating RNE quantizer.
__device__ __forceinline__ unsigned quantize_half(unsigned short x, float scale) {
  return e4m3_from_float(__fdiv_rn(__half2float(__ushort_as_half(x)), scale), (x >> 8) & 0x80u);
}

// 8 fp16 (one 16-byte load) -> 8 e4m3 bytes (one 8-byte store).
__device__ __forceinline__ uint2 quantize8(uint4 x, float scale) {
  const unsigned w[4] = {x.x, x.y, x.z, x.w};
  unsigned out[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const unsigned a = w[2 * i], b = w[2 * i + 1];
    out[i] = quantize_half(a & 0xFFFFu, scale) | quantize_half(a >> 16, scale) << 8 |
             quantize_half(b & 0xFFFFu, scale) << 16 | quantize_half(b >> 16, scale) << 24;
  }
  return make_uint2(out[0], out[1]);
}

// One thread per (token, head, 8 elements) when vec8, else per (token, head, element).
__global__ void __launch_bounds__(StoreKVTraits::THREADS) store_kv_kernel(const StoreKVParams p) {
  const int per_row = p.vec8 ? p.D / 8 : p.D;
  const i64 i = (i64)blockIdx.x * StoreKVTraits::THREADS + threadIdx.x;
  if (i >= (i64)p.T * p.H_kv * per_row) return;
  const int part = (int)(i % per_row), h = (int)(i / per_row % p.H_kv);
  const i64 t = i / per_row / p.H_kv;
  const i64 slot = p.slot_mapping[t * p.slot_stride];
  if (slot < 0 || slot >= (i64)p.num_pages * p.page_size) return;
  const i64 page = slot / p.page_size, off = slot - page * p.page_size;

  const float ks = __ldg(p.k_scale + h * p.k_scale_stride);
  const float vs = __ldg(p.v_scale + h * p.v_scale_stride);
  const __half* k = p.key + t * p.key_stride_t + h * p.key_stride_h;
  const __half* v = p.value + t * p.value_stride_t + h * p.value_stride_h;
  unsigned char* kc = p.k_cache + page * p.kc_stride_page + off * p.kc_stride_tok + h * p.kc_stride_head;
  unsigned char* vc = p.v_cache + page * p.vc_stride_page + off * p.vc_stride_tok + h * p.vc_stride_head;
  if (p.vec8) {
    const int e = part * 8;
    *reinterpret_cast<uint2*>(kc + e) = quantize8(__ldg(reinterpret_cast<const uint4*>(k + e)), ks);
    *reinterpret_cast<uint2*>(vc + e) = quantize8(__ldg(reinterpret_cast<const uint4*>(v + e)), vs);
  } else {
    kc[part] = (unsigned char)quantize_half(__half_as_ushort(k[part]), ks);
    vc[part] = (unsigned char)quantize_half(__half_as_ushort(v[part]), vs);
  }
}

}  // namespace sm70attn
