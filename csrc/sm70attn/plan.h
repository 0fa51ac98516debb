// Host-side planning (plain C++, torch-free): CTA shape and split-K factor of a call, and the
// workspace it needs. Used by the binding before it allocates and launches.
#pragma once

#ifndef __CUDACC_RTC__
#include <algorithm>

#include "sm70attn/params.h"
#include "sm70attn/traits.h"

namespace sm70attn {

struct AttnPlan {
  int mb = 0;                // 16-row blocks per CTA
  int row_groups = 0;        // CTAs over the G * Q rows of one KV head
  int num_splits = 0;        // context splits
  i64 workspace_floats = 0;  // part_acc (fp16) then part_ml, in floats; 0 when num_splits == 1
};

// Floats of the split partials of `rows` output rows (set_workspace): fp16 O and (m, l) a split.
inline i64 split_workspace_floats(i64 rows, int num_splits, int D) {
  return num_splits > 1 ? rows * num_splits * (D / 2 + 2) : 0;
}

// Depends on shapes and the SM count only, never on seq_lens values (one CUDA graph serves
// every length <= capacity) nor on B (a request's result is bitwise the same alone or batched).
// Splits: one request fills the SMs with ctas_per_sm resident CTAs each (the kernel's occupancy
// on this device, measured by the launcher: attn_ctas_per_sm), one wave of them (a kernel of one
// CTA per SM got two before: twice the partials for the same work), each split at least
// 4 tiles and 16 tokens per query row (the partials of a split stay well under its KV
// bytes), at most 512. A count above one wave (ctas_per_sm x num_sms over the CTAs a split
// takes, rounded up) is rounded down to the wave: a partial last wave costs a full CTA time
// while most SMs idle (as seen with two waves: verify at 128K on 132 SMs, 170 splits of 13
// tiles took 26 tile times, 132 splits of 16 take 16). ctas_per_sm depends on (D, mb, VEC), the
// kernel kind (which follows the cache capacity, a shape, and set_kernel_override) and the
// device only.
inline AttnPlan plan_paged_attention(int B, int H_q, int H_kv, int Q, int D, i64 capacity,
                                     int num_sms, int ctas_per_sm = 2) {
  AttnPlan pl;
  const int rows = H_q / H_kv * Q, need = (rows + 15) / 16, max_mb = attn_max_row_blocks(D);
  pl.row_groups = (need + max_mb - 1) / max_mb;
  pl.mb = (need + pl.row_groups - 1) / pl.row_groups;
  const i64 cta_rows = std::min(rows, 16 * pl.mb);
  const i64 min_split = std::max<i64>(4 * attn_tile_tokens(D, pl.mb), 16 * cta_rows);
  const i64 per_request = (i64)H_kv * pl.row_groups;
  i64 splits = (std::max(ctas_per_sm, 1) * (i64)num_sms + per_request - 1) / per_request;
  splits = std::min<i64>({splits, std::max<i64>(1, capacity / min_split), attn_max_splits()});
  const i64 wave = std::max<i64>(1, std::max(ctas_per_sm, 1) * (i64)num_sms / per_request);
  if (splits > wave) splits = splits / wave * wave;
  pl.num_splits = (int)std::max<i64>(1, splits);
  pl.workspace_floats = split_workspace_floats((i64)B * H_q * Q, pl.num_splits, D);
  return pl;
}

// paged_attention_varlen's launch (varlen.h): the grid's upper bound of tiles, the split rule's
// constants and the split workspace, from shapes, the SM count and the kernel's occupancy only
// (never the metadata's values). A request splits when it has at most split_q tokens and its
// CTAs (tiles x H_kv) are fewer than split_target (two waves); splits = min(split_cap, ceil(len /
// split_tokens), split_target / CTAs). Units (8 tokens of a split request, split_cap partials a
// row) are budgeted to at most kVarlenSplitBytes of workspace (at least one request of split_q
// tokens), and to no more than the call's tokens could claim.
constexpr i64 kVarlenSplitBytes = 48ll << 20;

// With the prefill kernel (pf_ctas_per_sm > 0: its occupancy on this device), the requests of more
// than kPrefillMinQ tokens are its (pf_tiles x H_kv CTAs: an upper bound of their tiles), and the
// tile loop's grid shrinks to the tiles of the others (at most kPrefillMinQ tokens each).
struct VarlenPlan {
  i64 tiles = 0;  // grid x / H_kv
  int split_cap = 1, split_tokens = 2048, split_q = 256, split_target = 1, units = 0;
  i64 workspace_floats = 0;  // partial O (fp16) of every unit row and split, (m, l), unit heads
  i64 pf_tiles = 0;          // the prefill kernel's grid x / H_kv (0: not launched)
  int pf_min_q = 0x7fffffff, pf_split_target = 1;
};

inline VarlenPlan plan_paged_attention_varlen(i64 T, i64 B, int H_q, int H_kv, int D, i64 capacity, int num_sms,
                                              int ctas_per_sm, int pf_ctas_per_sm = 0) {
  VarlenPlan pl;
  const i64 G = H_q / H_kv, rows = 16 * varlen_row_blocks();
  pl.tiles = (T * G + rows - 1) / rows + B + 1;
  if (pf_ctas_per_sm > 0) {
    const i64 pf_rows = prefill_rows(D);
    pl.pf_min_q = kPrefillMinQ;
    pl.pf_tiles = (T * G + pf_rows - 1) / pf_rows + B + 1;
    pl.tiles = std::min(pl.tiles, (B + 1) * ((kPrefillMinQ * G + rows - 1) / rows));
    pl.pf_split_target = 2 * pf_ctas_per_sm * std::max(num_sms, 1);
  }
  pl.split_target = 2 * std::max(ctas_per_sm, 1) * std::max(num_sms, 1);
  pl.split_cap = (int)std::min<i64>(16, std::max<i64>(1, (capacity + pl.split_tokens - 1) / pl.split_tokens));
  if (pl.split_cap > 1) {
    const i64 unit_floats = 8ll * H_q * pl.split_cap * (D / 2 + 2);
    const i64 budget = std::max<i64>((pl.split_q + 7) / 8, kVarlenSplitBytes / 4 / unit_floats);
    pl.units = (int)std::min<i64>(budget, (T + 7) / 8 + B);
    pl.workspace_floats = pl.units * unit_floats + 4ll * pl.units;
  }
  return pl;
}

// Where the varlen plan's workspace goes in p: part_acc, part_ml, then the unit heads (which the
// binding zeroes before the launch).
inline void set_varlen_workspace(PagedAttnParams& p, float* ws) {
  const i64 rows = (i64)p.units * 8 * p.H_q * p.split_cap;
  p.part_acc = reinterpret_cast<__half*>(ws);
  p.part_ml = ws ? reinterpret_cast<float2*>(ws + rows * (p.D / 2)) : nullptr;
  p.unit_head = ws ? reinterpret_cast<int*>(ws + rows * (p.D / 2 + 2)) : nullptr;
}

// The divisors the kernel divides by (launch_paged_attention calls this, after the plan's
// row_groups and num_splits are in p).
inline void set_divisors(PagedAttnParams& p) {
  p.div_page = fastdiv_init(p.page_size), p.div_q = fastdiv_init(p.Q), p.div_hkv = fastdiv_init(p.H_kv);
  p.div_rg = fastdiv_init(p.row_groups), p.div_splits = fastdiv_init(p.num_splits);
  p.div_g = fastdiv_init(p.G);
}

// Where the plan's workspace goes in p (part_acc first, then part_ml: D / 2 floats a partial
// row; D a multiple of 64, so part_ml stays 8-byte aligned).
inline void set_workspace(PagedAttnParams& p, float* ws) {
  p.part_acc = reinterpret_cast<__half*>(ws);
  p.part_ml = ws ? reinterpret_cast<float2*>(ws + (i64)p.B * p.H_q * p.Q * p.num_splits * (p.D / 2)) : nullptr;
}

}  // namespace sm70attn
#endif  // __CUDACC_RTC__
