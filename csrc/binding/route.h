// The route of a call: the capability manifest's bounds (set at init) and the binding's rules of
// torch_sm70attn/routes.py's RULES, applied before any launch.
#pragma once

#include <algorithm>

#include "host.h"

namespace {

// The capability manifest (torch_sm70attn/manifest.py, the one place it is written): the shapes a
// call may take the kernels for (route_refusal).
struct Bounds {
  std::vector<int> head_dims;
  i64 group_mask = 0, rows_mask = 0;  // bit n: n admitted (group sizes, query rows; at most 62)
  i64 max_context = 0;
  int min_cc = 0;
} g_bounds;

bool in_mask(i64 mask, i64 n) { return n >= 0 && n < 63 && (mask >> n & 1); }

// A cache whose rows all start 8-byte (16-byte) aligned: the kernels' narrowest (widest) KV loads.
bool cache_aligned(const at::Tensor& t, i64 align) { return ptr_aligned(t, align) && strides_aligned(t, 3, align); }

// The route of a call: the name of the first rule of torch_sm70attn/routes.py's RULES it fails,
// of those applied here ("binding"), in that table's order and under its names (tests/test_routes.py
// reads them from this function), or nullptr: the kernels take it. The route is decided here
// alone; routes.admit predicts it from metadata, and ops.cuda_fallback words the reason.
const char* route_refusal(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                          i64 G, i64 Q, i64 D, i64 page_size, i64 capacity) {
  if (device_info(query.get_device()).cc < g_bounds.min_cc) return "compute capability";
  if (std::find(g_bounds.head_dims.begin(), g_bounds.head_dims.end(), D) == g_bounds.head_dims.end())
    return "head dim";
  if (!in_mask(g_bounds.group_mask, G)) return "group size";
  if (!in_mask(g_bounds.rows_mask, Q)) return "query rows";
  // Whole pages covering the contract (manifest.admitted_capacity with no served capacity).
  if (capacity > (g_bounds.max_context + page_size - 1) / std::max<i64>(page_size, 1) * page_size)
    return "table capacity";
  if (!cache_aligned(key_cache, 8)) return "key_cache alignment";
  if (!cache_aligned(value_cache, 8)) return "value_cache alignment";
  return nullptr;
}

}  // namespace
