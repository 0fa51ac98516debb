// The one dispatch level: runtime (head dim, row blocks, load width) -> template parameters,
// through the explicit list of every kernel the launcher can pick. tools/sm70_check.py parses
// the X(...) entries of the three lists below and compiles each for sm_70: edit only here.
#pragma once

#include "sm70attn/traits.h"

// Attention kernels: X(head dim D, 16-row blocks per CTA MB, KV load bytes VEC).
// MB runs to attn_max_row_blocks(D); VEC 8 serves caches that are only 8-byte aligned.
#define SM70ATTN_ATTN_KERNELS(X) \
  X(64, 1, 16) X(64, 1, 8) \
  X(64, 2, 16) X(64, 2, 8) \
  X(64, 3, 16) X(64, 3, 8) \
  X(64, 4, 16) X(64, 4, 8) \
  X(64, 5, 16) X(64, 5, 8) \
  X(64, 6, 16) X(64, 6, 8) \
  X(64, 7, 16) X(64, 7, 8) \
  X(64, 8, 16) X(64, 8, 8) \
  X(128, 1, 16) X(128, 1, 8) \
  X(128, 2, 16) X(128, 2, 8) \
  X(128, 3, 16) X(128, 3, 8) \
  X(128, 4, 16) X(128, 4, 8) \
  X(128, 5, 16) X(128, 5, 8) \
  X(128, 6, 16) X(128, 6, 8) \
  X(128, 7, 16) X(128, 7, 8) \
  X(128, 8, 16) X(128, 8, 8) \
  X(256, 1, 16) X(256, 1, 8) \
  X(256, 2, 16) X(256, 2, 8) \
  X(256, 3, 16) X(256, 3, 8) \
  X(256, 4, 16) X(256, 4, 8)

// Register-fragment attention kernels (paged_attention_rf.cuh), X(D, MB, VEC) as above: those
// attn_uses_rf(D, MB) says take it. Each is built for both MMA atoms (m16n8k16 only where the
// arch has it) and the WMMA kernel of the same (D, MB, VEC) stays, for A/B runs and tests.
#define SM70ATTN_RF_KERNELS(X) \
  X(256, 2, 16) X(256, 2, 8) \
  X(256, 3, 16) X(256, 3, 8)

// Split-K combine kernels: X(head dim D, warps per output row WPR), WPR as
// combine_warps_per_row(splits) picks it.
#define SM70ATTN_COMBINE_KERNELS(X) \
  X(64, 1) X(64, 4) X(64, 16) \
  X(128, 1) X(128, 4) X(128, 16) \
  X(256, 1) X(256, 4) X(256, 16)

// paged_attention_varlen's kernels (varlen.cuh): X(D, MB, VEC) of the tile loop over 64-row
// tiles (MB 4), and X(D) of the combine of split requests.
#define SM70ATTN_VARLEN_KERNELS(X) \
  X(64, 4, 16) X(64, 4, 8) \
  X(128, 4, 16) X(128, 4, 8) \
  X(256, 4, 16) X(256, 4, 8)
#define SM70ATTN_COMBINE_VARLEN_KERNELS(X) X(64) X(128) X(256)

// The prefill kernel of paged_attention_varlen (prefill.cuh): X(D, VEC), each built on the MMA
// atom of the arch (m8n8k4 on SM70, m16n8k16 on SM80+).
#define SM70ATTN_PREFILL_KERNELS(X) \
  X(64, 16) X(64, 8) \
  X(128, 16) X(128, 8) \
  X(256, 16) X(256, 8)

#ifndef __CUDACC_RTC__
namespace sm70attn {

// Calls f(AttnTraits<D, MB, VEC>{}) for the listed kernel; false when none is listed.
template <class F>
inline bool attn_switch(int d, int mb, int vec, F&& f) {
#define SM70ATTN_CASE(D_, MB_, VEC_) \
  if (d == D_ && mb == MB_ && vec == VEC_) return f(AttnTraits<D_, MB_, VEC_>{}), true;
  SM70ATTN_ATTN_KERNELS(SM70ATTN_CASE)
#undef SM70ATTN_CASE
  return false;
}

// Calls f(AttnRfTraits<D, MB, VEC>{}) for the listed kernel; false when none is listed.
template <class F>
inline bool attn_rf_switch(int d, int mb, int vec, F&& f) {
#define SM70ATTN_CASE(D_, MB_, VEC_) \
  if (d == D_ && mb == MB_ && vec == VEC_) return f(AttnRfTraits<D_, MB_, VEC_>{}), true;
  SM70ATTN_RF_KERNELS(SM70ATTN_CASE)
#undef SM70ATTN_CASE
  return false;
}

// Calls f(CombineTraits<D, combine_warps_per_row(splits)>{}) for the listed kernel; false when
// none is listed.
template <class F>
inline bool combine_switch(int d, int splits, F&& f) {
  const int wpr = combine_warps_per_row(splits);
#define SM70ATTN_CASE(D_, WPR_) \
  if (d == D_ && wpr == WPR_) return f(CombineTraits<D_, WPR_>{}), true;
  SM70ATTN_COMBINE_KERNELS(SM70ATTN_CASE)
#undef SM70ATTN_CASE
  return false;
}

// Calls f(AttnTraits<D, MB, VEC>{}) for the listed varlen kernel; false when none is listed.
template <class F>
inline bool varlen_switch(int d, int mb, int vec, F&& f) {
#define SM70ATTN_CASE(D_, MB_, VEC_) \
  if (d == D_ && mb == MB_ && vec == VEC_) return f(AttnTraits<D_, MB_, VEC_>{}), true;
  SM70ATTN_VARLEN_KERNELS(SM70ATTN_CASE)
#undef SM70ATTN_CASE
  return false;
}

// Calls f(PrefillTraits<D, VEC>{}) for the listed prefill kernel; false when none is listed.
template <class F>
inline bool prefill_switch(int d, int vec, F&& f) {
#define SM70ATTN_CASE(D_, VEC_) \
  if (d == D_ && vec == VEC_) return f(PrefillTraits<D_, VEC_>{}), true;
  SM70ATTN_PREFILL_KERNELS(SM70ATTN_CASE)
#undef SM70ATTN_CASE
  return false;
}

// Calls f(CombineVarlenTraits<D>{}) for the listed kernel; false when none is listed.
template <class F>
inline bool combine_varlen_switch(int d, F&& f) {
#define SM70ATTN_CASE(D_) \
  if (d == D_) return f(CombineVarlenTraits<D_>{}), true;
  SM70ATTN_COMBINE_VARLEN_KERNELS(SM70ATTN_CASE)
#undef SM70ATTN_CASE
  return false;
}

}  // namespace sm70attn
#endif  // __CUDACC_RTC__
