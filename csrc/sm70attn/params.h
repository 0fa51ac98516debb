// Kernel parameters: raw pointers and strides only (no torch). The binding fills these.
// Strides are in elements of the pointed-to type (fp8 caches: bytes).
#pragma once

#ifdef SM70ATTN_HOST
// The binding, built by a host compiler alone, only points at fp16 data: cuda_fp16.h would need
// CUDA's C++ library headers (<nv/target>), which the pip packages of the toolkit do not ship.
#include <vector_types.h>  // float2; __host__ and __device__ for a host compiler
struct __half;
#else
#include <cuda_fp16.h>
#endif

namespace sm70attn {

using i64 = long long;  // NVRTC has no <cstdint>

// n / d for 0 <= n < 2^31 and a runtime divisor 1 <= d < 2^31 in three instructions
// (Granlund-Montgomery, round-up multiplier with an add): l = ceil(log2 d),
// m = floor(2^32 (2^l - d) / d) + 1, n / d = (umulhi(m, n) + n) >> l. Exact for every n < 2^32
// when the sum is taken in 33 bits; n < 2^31 keeps it in 32 bits (umulhi(m, n) <= n).
// The launcher computes (m, l) once per call (set_divisors in plan.h); the kernel reads them
// from the params.
struct FastDiv {
  unsigned m, l;
};

__host__ __device__ inline FastDiv fastdiv_init(int divisor) {
  const unsigned long long d = divisor > 0 ? (unsigned)divisor : 1u;
  unsigned l = 0;
  while ((1ull << l) < d) ++l;
  return FastDiv{(unsigned)((((1ull << l) - d) << 32) / d + 1), l};
}

__host__ __device__ __forceinline__ int fastdiv(int n, FastDiv f) {
  const unsigned hi = (unsigned)(((unsigned long long)f.m * (unsigned)n) >> 32);
  return (int)((hi + (unsigned)n) >> f.l);
}

struct PagedAttnParams {
  const __half* q;  // [B, H_q, Q, D], last dim contiguous
  i64 q_stride_b, q_stride_h, q_stride_r;
  const unsigned char* k;  // [P, page_size, H_kv, D] e4m3 bytes, last dim contiguous
  const unsigned char* v;  // same shape as k, own strides
  i64 k_stride_page, k_stride_tok, k_stride_head;
  i64 v_stride_page, v_stride_tok, v_stride_head;
  const int* block_table;  // [B, max_pages]
  i64 bt_stride_b;
  const int* seq_lens;  // [B]
  i64 seq_lens_stride;
  const float* k_scale;  // [1] or [H_kv]; element kvh * k_scale_stride (stride 0 when shared)
  const float* v_scale;
  int k_scale_stride, v_scale_stride;
  __half* out;         // [B, H_q, Q, D] contiguous
  // Split partials (num_splits > 1 only): each split's unnormalised O over the power of two of
  // its row sum, times 2^12, in fp16 (half the bytes of fp32; utils.h: partial_scale), and (row
  // max in log2 units, row sum). A row that saw nothing: O = 0, (-inf, 0).
  __half* part_acc;    // [B * H_q * Q, num_splits, D]
  float2* part_ml;     // [B * H_q * Q, num_splits]
  int B, H_q, H_kv, G, Q, D;
  int page_size, max_pages, num_pages;  // capacity = max_pages * page_size (fits in int)
  // Divisors of page_size, Q, H_kv, row_groups and num_splits: set by the launcher (set_divisors).
  FastDiv div_page, div_q, div_hkv, div_rg, div_splits;
  int rows;        // G * Q: query rows sharing one KV head
  int row_groups;  // CTAs over the rows of one KV head (1 unless G * Q is too large for one CTA)
  int num_splits;  // context splits per (request, KV head, row group)
  float scale_log2;  // softmax scale * log2(e); k_scale and the e4m3 2^8 are applied on device
  int q_vec16;       // query pointer and strides allow 16-byte loads
  // paged_attention_varlen only (varlen.h; after the fields above, which paged_attention's
  // kernels read at the same offsets as before). query and out are [T, H_q, D]: q_stride_b is
  // the token stride, B the requests, Q and rows unused.
  const int* qsl;  // query_start_loc [B + 1]
  int T;           // tokens of query and out
  // Split requests (varlen.h, VarlenTile): requests of at most split_q tokens whose CTAs are few
  // take splits = min(split_cap, ceil(len / split_tokens), split_target / their CTAs), if their
  // units (8 tokens each, in request order) fit in `units`; partials at [unit row][split_cap][D].
  int split_cap, split_tokens, split_q, split_target, units;
  int* unit_head;  // [units][4]: first token, tokens (0: unused), splits, request
  FastDiv div_g;   // divisor G
  // The prefill kernel's share of a varlen step (prefill.cuh, varlen_scan): requests of more than
  // pf_min_q tokens (the padding request too), split by its own target of CTAs.
  int pf_min_q, pf_split_target;
};

struct StoreKVParams {
  const __half* key;  // [T, H_kv, D], last dim contiguous
  const __half* value;
  i64 key_stride_t, key_stride_h, value_stride_t, value_stride_h;
  unsigned char* k_cache;  // [P, page_size, H_kv, D] e4m3 bytes, last dim contiguous
  unsigned char* v_cache;
  i64 kc_stride_page, kc_stride_tok, kc_stride_head;
  i64 vc_stride_page, vc_stride_tok, vc_stride_head;
  const i64* slot_mapping;  // [T]: page * page_size + offset; < 0 or >= P * page_size: skipped
  i64 slot_stride;
  const float* k_scale;  // as in PagedAttnParams
  const float* v_scale;
  int k_scale_stride, v_scale_stride;
  int T, H_kv, D, page_size, num_pages;
  int vec8;  // D % 8 == 0 and every row allows 16-byte fp16 loads / 8-byte e4m3 stores
};

}  // namespace sm70attn
