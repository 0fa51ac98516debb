// The CUDA implementations of the ops (paged_attention, paged_attention_varlen, store_kv) and of
// the test hook mma_atom_check: checks that name the argument, the route, the plan, the params
// and the launch on torch's current stream.
#pragma once

#include <algorithm>

#include "call_plan.h"
#include "host.h"
#include "route.h"

namespace {

// Host-side check of the values the kernel otherwise clamps/skips (validate mode only).
void validate_lengths_and_pages(const at::Tensor& seq_lens, const at::Tensor& block_table, i64 page_size,
                                i64 capacity, i64 num_pages) {
  const at::Tensor lens = seq_lens.cpu(), bt = block_table.cpu();
  const auto l = lens.accessor<int, 1>();
  const auto t = bt.accessor<int, 2>();
  for (i64 b = 0; b < l.size(0); ++b) {
    const i64 len = l[b];
    TORCH_CHECK_VALUE(len >= 0 && len <= capacity, msg("seq_lens[", b, "] = ", len, " is outside [0, capacity = ",
                      capacity, "] (capacity = block_table.size(1) * page_size)"));
    const i64 pages = (len + page_size - 1) / page_size;
    for (i64 i = 0; i < pages; ++i)
      TORCH_CHECK_VALUE(t[b][i] >= 0 && t[b][i] < num_pages, msg("block_table[", b, ", ", i, "] = ", t[b][i],
                        " is outside [0, num_pages = ", num_pages, ") (used by seq_lens[", b, "] = ", len, ")"));
  }
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const at::Tensor& block_table, const at::Tensor& seq_lens, double scale,
                           const at::Tensor& k_scale, const at::Tensor& v_scale) {
  TORCH_CHECK_TYPE(query.scalar_type() == at::kHalf, msg("query must be float16, got ", query.scalar_type()));
  TORCH_CHECK_TYPE(key_cache.scalar_type() == at::kFloat8_e4m3fn, msg("key_cache must be float8_e4m3fn, got ",
                   key_cache.scalar_type()));
  TORCH_CHECK_TYPE(value_cache.scalar_type() == at::kFloat8_e4m3fn, msg("value_cache must be float8_e4m3fn, got ",
                   value_cache.scalar_type()));
  TORCH_CHECK_TYPE(block_table.scalar_type() == at::kInt, msg("block_table must be int32, got ",
                   block_table.scalar_type()));
  TORCH_CHECK_TYPE(seq_lens.scalar_type() == at::kInt, msg("seq_lens must be int32, got ", seq_lens.scalar_type()));
  TORCH_CHECK_VALUE(query.dim() == 4, msg("query must be [B, H_q, Q, D], got shape ", query.sizes()));
  TORCH_CHECK_VALUE(key_cache.dim() == 4, msg("key_cache must be [P, page_size, H_kv, D], got shape ",
                    key_cache.sizes()));
  TORCH_CHECK_VALUE(value_cache.sizes() == key_cache.sizes(), msg("value_cache shape ", value_cache.sizes(),
                    " != key_cache shape ", key_cache.sizes()));
  TORCH_CHECK_VALUE(block_table.dim() == 2, msg("block_table must be [B, max_pages], got shape ", block_table.sizes()));
  TORCH_CHECK_VALUE(seq_lens.dim() == 1, msg("seq_lens must be [B], got shape ", seq_lens.sizes()));

  const i64 B = query.size(0), H_q = query.size(1), Q = query.size(2), D = query.size(3);
  const i64 P = key_cache.size(0), page_size = key_cache.size(1), H_kv = key_cache.size(2);
  const i64 max_pages = block_table.size(1);
  TORCH_CHECK_VALUE(key_cache.size(3) == D, msg("key_cache head dim ", key_cache.size(3), " != query head dim ", D));
  TORCH_CHECK_VALUE(H_kv > 0 && H_q % H_kv == 0, msg("query heads H_q = ", H_q,
                    " must be a multiple of the KV heads H_kv = ", H_kv));
  TORCH_CHECK_VALUE(block_table.size(0) == B && seq_lens.size(0) == B, msg("block_table rows (", block_table.size(0),
                    ") and seq_lens size (", seq_lens.size(0), ") must equal the batch size B = ", B));
  check_last_dim_contiguous(query, "query");
  check_last_dim_contiguous(key_cache, "key_cache");
  check_last_dim_contiguous(value_cache, "value_cache");
  check_last_dim_contiguous(block_table, "block_table");
  TORCH_CHECK_VALUE(query.is_cuda(), msg("query must be a CUDA tensor, got ", query.device()));
  check_device(key_cache, query, "key_cache");
  check_device(value_cache, query, "value_cache");
  check_device(block_table, query, "block_table");
  check_device(seq_lens, query, "seq_lens");
  const int ks_stride = scale_stride(k_scale, H_kv, query, "k_scale");
  const int vs_stride = scale_stride(v_scale, H_kv, query, "v_scale");

  // The route: a call that fails a rule runs the reference, handed the rule's name (Python only on
  // this path: an admitted call never enters the interpreter).
  const i64 G = H_q / H_kv, capacity = max_pages * page_size;
  if (const char* rule = route_refusal(query, key_cache, value_cache, G, Q, D, page_size, capacity)) {
    TORCH_CHECK(g_fallback, "torch_sm70attn: the CUDA library was not initialised");
    py::gil_scoped_acquire gil;
    return (*g_fallback)(query, key_cache, value_cache, block_table, seq_lens, scale, k_scale, v_scale, rule)
        .cast<at::Tensor>();
  }
  // The kernels' token arithmetic is int32, with headroom for a split's rounding (len + splits -
  // 1, t + N): capacity stays 1024 below INT_MAX (only a page of billions of tokens gets here).
  const i64 max_capacity = (i64)INT_MAX - 1024;
  TORCH_CHECK_VALUE(capacity <= max_capacity && P <= INT_MAX,
                    msg("capacity (max_pages * page_size = ", capacity, ") must be at most ", max_capacity,
                        " and num_pages (", P, ") must fit in int32"));
  // 16-byte KV loads when every row start allows them
  const int vec = cache_aligned(key_cache, 16) && cache_aligned(value_cache, 16) ? 16 : 8;

  const c10::cuda::CUDAGuard guard(query.device());
  at::Tensor out = at::empty({B, H_q, Q, D}, query.options());
  if (B == 0 || H_q == 0) return out;
  const int device = query.get_device();
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(device);

  if (g_validate.load() && c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None)
    validate_lengths_and_pages(seq_lens, block_table, page_size, capacity, P);

  const sm70attn::Launcher l{&driver().launch, &load_kernel, device, stream.stream()};
  const CallPlan call = plan_call(l, B, H_q, H_kv, Q, D, capacity, vec);
  const sm70attn::AttnPlan& plan = call.plan;
  TORCH_CHECK_VALUE(B * H_kv * plan.row_groups <= INT_MAX && B * H_q * Q <= INT_MAX, msg("batch B = ", B,
                    " is too large for the launch grid"));
  at::Tensor workspace;
  if (plan.workspace_floats > 0)
    workspace = at::empty({plan.workspace_floats}, query.options().dtype(at::kFloat));

  sm70attn::PagedAttnParams p{};
  p.q = reinterpret_cast<const __half*>(query.data_ptr<at::Half>());
  p.q_stride_b = query.stride(0), p.q_stride_h = query.stride(1), p.q_stride_r = query.stride(2);
  p.k = reinterpret_cast<const unsigned char*>(key_cache.data_ptr());
  p.v = reinterpret_cast<const unsigned char*>(value_cache.data_ptr());
  p.k_stride_page = key_cache.stride(0), p.k_stride_tok = key_cache.stride(1), p.k_stride_head = key_cache.stride(2);
  p.v_stride_page = value_cache.stride(0), p.v_stride_tok = value_cache.stride(1);
  p.v_stride_head = value_cache.stride(2);
  p.block_table = block_table.data_ptr<int>();
  p.bt_stride_b = block_table.stride(0);
  p.seq_lens = seq_lens.data_ptr<int>();
  p.seq_lens_stride = seq_lens.stride(0);
  p.k_scale = k_scale.data_ptr<float>(), p.v_scale = v_scale.data_ptr<float>();
  p.k_scale_stride = ks_stride, p.v_scale_stride = vs_stride;
  p.out = reinterpret_cast<__half*>(out.data_ptr<at::Half>());
  p.B = (int)B, p.H_q = (int)H_q, p.H_kv = (int)H_kv, p.G = (int)G, p.Q = (int)Q, p.D = (int)D;
  p.page_size = (int)page_size, p.max_pages = (int)max_pages, p.num_pages = (int)P;
  p.rows = (int)(G * Q);
  p.row_groups = plan.row_groups, p.num_splits = plan.num_splits;
  p.scale_log2 = (float)(scale * 1.4426950408889634);  // log2(e)
  p.q_vec16 = ptr_aligned(query, 16) && strides_aligned(query, 3, 8);
  sm70attn::set_workspace(p, plan.workspace_floats > 0 ? workspace.data_ptr<float>() : nullptr);
  check_cu(sm70attn::launch_paged_attention(l, p, call.kind, plan.mb, vec, call.smem_bytes), "paged_attention launch");
  return out;
}

// paged_attention_varlen: the checks paged_attention makes of the caches, table, lengths and
// scales, and of query [T, H_q, D] and query_start_loc [B + 1]; the route by the same rules
// (query rows: one); one launch of the varlen tile loop (and of its combine where requests split).
// No value of the metadata is read on the host (validate mode aside): varlen.h says what the
// kernel makes of any values.
at::Tensor paged_attention_varlen(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& block_table, const at::Tensor& query_start_loc,
                                  const at::Tensor& seq_lens, double scale, const at::Tensor& k_scale,
                                  const at::Tensor& v_scale) {
  TORCH_CHECK_TYPE(query.scalar_type() == at::kHalf, msg("query must be float16, got ", query.scalar_type()));
  TORCH_CHECK_TYPE(key_cache.scalar_type() == at::kFloat8_e4m3fn, msg("key_cache must be float8_e4m3fn, got ",
                   key_cache.scalar_type()));
  TORCH_CHECK_TYPE(value_cache.scalar_type() == at::kFloat8_e4m3fn, msg("value_cache must be float8_e4m3fn, got ",
                   value_cache.scalar_type()));
  TORCH_CHECK_TYPE(block_table.scalar_type() == at::kInt, msg("block_table must be int32, got ",
                   block_table.scalar_type()));
  TORCH_CHECK_TYPE(query_start_loc.scalar_type() == at::kInt, msg("query_start_loc must be int32, got ",
                   query_start_loc.scalar_type()));
  TORCH_CHECK_TYPE(seq_lens.scalar_type() == at::kInt, msg("seq_lens must be int32, got ", seq_lens.scalar_type()));
  TORCH_CHECK_VALUE(query.dim() == 3, msg("query must be [T, H_q, D], got shape ", query.sizes()));
  TORCH_CHECK_VALUE(key_cache.dim() == 4, msg("key_cache must be [P, page_size, H_kv, D], got shape ",
                    key_cache.sizes()));
  TORCH_CHECK_VALUE(value_cache.sizes() == key_cache.sizes(), msg("value_cache shape ", value_cache.sizes(),
                    " != key_cache shape ", key_cache.sizes()));
  TORCH_CHECK_VALUE(block_table.dim() == 2, msg("block_table must be [B, max_pages], got shape ", block_table.sizes()));
  TORCH_CHECK_VALUE(seq_lens.dim() == 1, msg("seq_lens must be [B], got shape ", seq_lens.sizes()));
  const i64 T = query.size(0), H_q = query.size(1), D = query.size(2), B = seq_lens.size(0);
  const i64 P = key_cache.size(0), page_size = key_cache.size(1), H_kv = key_cache.size(2);
  const i64 max_pages = block_table.size(1);
  TORCH_CHECK_VALUE(query_start_loc.dim() == 1 && query_start_loc.size(0) == B + 1, msg("query_start_loc must be [B + 1 = ",
                    B + 1, "], got shape ", query_start_loc.sizes()));
  TORCH_CHECK_VALUE(key_cache.size(3) == D, msg("key_cache head dim ", key_cache.size(3), " != query head dim ", D));
  TORCH_CHECK_VALUE(H_kv > 0 && H_q % H_kv == 0, msg("query heads H_q = ", H_q,
                    " must be a multiple of the KV heads H_kv = ", H_kv));
  TORCH_CHECK_VALUE(block_table.size(0) == B, msg("block_table has ", block_table.size(0), " rows, seq_lens ", B));
  TORCH_CHECK_VALUE(page_size > 0, "key_cache page_size (dim 1) must be >= 1");
  check_last_dim_contiguous(query, "query");
  check_last_dim_contiguous(key_cache, "key_cache");
  check_last_dim_contiguous(value_cache, "value_cache");
  check_last_dim_contiguous(block_table, "block_table");
  TORCH_CHECK_VALUE(query.is_cuda(), msg("query must be a CUDA tensor, got ", query.device()));
  check_device(key_cache, query, "key_cache");
  check_device(value_cache, query, "value_cache");
  check_device(block_table, query, "block_table");
  check_device(query_start_loc, query, "query_start_loc");
  check_device(seq_lens, query, "seq_lens");
  const int ks_stride = scale_stride(k_scale, H_kv, query, "k_scale");
  const int vs_stride = scale_stride(v_scale, H_kv, query, "v_scale");

  const i64 G = H_q / H_kv, capacity = max_pages * page_size;
  if (const char* rule = route_refusal(query, key_cache, value_cache, G, 1, D, page_size, capacity)) {
    TORCH_CHECK(g_fallback_varlen, "torch_sm70attn: the CUDA library was not initialised");
    py::gil_scoped_acquire gil;
    return (*g_fallback_varlen)(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale, k_scale,
                                v_scale, rule)
        .cast<at::Tensor>();
  }
  const i64 max_capacity = (i64)INT_MAX - 1024;
  TORCH_CHECK_VALUE(capacity <= max_capacity && P <= INT_MAX,
                    msg("capacity (max_pages * page_size = ", capacity, ") must be at most ", max_capacity,
                        " and num_pages (", P, ") must fit in int32"));
  TORCH_CHECK_VALUE(T * G <= INT_MAX / 2 && B <= INT_MAX / 2, msg("T = ", T, " tokens and B = ", B,
                    " requests are too many for the launch grid"));
  const int vec = cache_aligned(key_cache, 16) && cache_aligned(value_cache, 16) ? 16 : 8;

  const c10::cuda::CUDAGuard guard(query.device());
  at::Tensor out = at::empty({T, H_q, D}, query.options());
  if (T == 0 || H_q == 0) return out;
  const int device = query.get_device();
  if (g_validate.load() && c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None) {
    validate_lengths_and_pages(seq_lens, block_table, page_size, capacity, P);
    const at::Tensor qsl = query_start_loc.cpu();
    const auto a = qsl.accessor<int, 1>();
    TORCH_CHECK_VALUE(a[0] == 0, msg("query_start_loc[0] must be 0, got ", a[0]));
    for (i64 b = 0; b < B; ++b)
      TORCH_CHECK_VALUE(a[b + 1] >= a[b], msg("query_start_loc must be non-decreasing, got query_start_loc[", b,
                        "] = ", a[b], " > query_start_loc[", b + 1, "] = ", a[b + 1]));
    TORCH_CHECK_VALUE(a[B] <= T, msg("query_start_loc[B] = ", a[B], " exceeds the query's T = ", T, " tokens"));
  }
  const sm70attn::Launcher l = launcher(device);
  int num_sms = device_info(device).num_sms;
  if (const int sms = g_plan_sms.load(); sms > 0) num_sms = sms;
  const int ctas = std::max(1, sm70attn::varlen_ctas_per_sm(l, (int)D, vec));
  const int prefill = prefill_kind(device);
  const int pf_ctas = prefill == sm70attn::kNoPrefill ? 0 : std::max(1, prefill_occupancy(l, prefill, (int)D, vec));
  const sm70attn::VarlenPlan plan =
      sm70attn::plan_paged_attention_varlen(T, B, (int)H_q, (int)H_kv, (int)D, capacity, num_sms, ctas, pf_ctas);
  TORCH_CHECK_VALUE(std::max(plan.tiles, plan.pf_tiles) * H_kv <= INT_MAX,
                    msg("T = ", T, " tokens are too many for the launch grid"));
  at::Tensor workspace;
  if (plan.workspace_floats > 0) {
    workspace = at::empty({plan.workspace_floats}, query.options().dtype(at::kFloat));
    workspace.narrow(0, plan.workspace_floats - 4ll * plan.units, 4ll * plan.units).zero_();  // the unit heads
  }

  sm70attn::PagedAttnParams p{};
  p.q = reinterpret_cast<const __half*>(query.data_ptr<at::Half>());
  p.q_stride_b = query.stride(0), p.q_stride_h = query.stride(1), p.q_stride_r = 0;
  p.k = reinterpret_cast<const unsigned char*>(key_cache.data_ptr());
  p.v = reinterpret_cast<const unsigned char*>(value_cache.data_ptr());
  p.k_stride_page = key_cache.stride(0), p.k_stride_tok = key_cache.stride(1), p.k_stride_head = key_cache.stride(2);
  p.v_stride_page = value_cache.stride(0), p.v_stride_tok = value_cache.stride(1);
  p.v_stride_head = value_cache.stride(2);
  p.block_table = block_table.data_ptr<int>();
  p.bt_stride_b = block_table.stride(0);
  p.seq_lens = seq_lens.data_ptr<int>();
  p.seq_lens_stride = seq_lens.stride(0);
  p.qsl = query_start_loc.data_ptr<int>();
  p.k_scale = k_scale.data_ptr<float>(), p.v_scale = v_scale.data_ptr<float>();
  p.k_scale_stride = ks_stride, p.v_scale_stride = vs_stride;
  p.out = reinterpret_cast<__half*>(out.data_ptr<at::Half>());
  p.B = (int)B, p.H_q = (int)H_q, p.H_kv = (int)H_kv, p.G = (int)G, p.Q = 1, p.D = (int)D, p.T = (int)T;
  p.page_size = (int)page_size, p.max_pages = (int)max_pages, p.num_pages = (int)P;
  p.rows = (int)G, p.row_groups = 1, p.num_splits = 1;
  p.split_cap = plan.split_cap, p.split_tokens = plan.split_tokens, p.split_q = plan.split_q;
  p.split_target = plan.split_target, p.units = plan.units;
  p.pf_min_q = plan.pf_min_q, p.pf_split_target = plan.pf_split_target;
  p.scale_log2 = (float)(scale * 1.4426950408889634);
  p.q_vec16 = ptr_aligned(query, 16) && strides_aligned(query, 2, 8);
  sm70attn::set_varlen_workspace(p, plan.workspace_floats > 0 ? workspace.data_ptr<float>() : nullptr);
  check_cu(sm70attn::launch_paged_attention_varlen(l, p, plan, vec, prefill), "paged_attention_varlen launch");
  return out;
}

void store_kv(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
              const at::Tensor& value_cache, const at::Tensor& slot_mapping, const at::Tensor& k_scale,
              const at::Tensor& v_scale) {
  TORCH_CHECK_TYPE(key.scalar_type() == at::kHalf, msg("key must be float16, got ", key.scalar_type()));
  TORCH_CHECK_TYPE(value.scalar_type() == at::kHalf, msg("value must be float16, got ", value.scalar_type()));
  TORCH_CHECK_TYPE(key_cache.scalar_type() == at::kFloat8_e4m3fn, msg("key_cache must be float8_e4m3fn, got ",
                   key_cache.scalar_type()));
  TORCH_CHECK_TYPE(value_cache.scalar_type() == at::kFloat8_e4m3fn, msg("value_cache must be float8_e4m3fn, got ",
                   value_cache.scalar_type()));
  TORCH_CHECK_TYPE(slot_mapping.scalar_type() == at::kLong, msg("slot_mapping must be int64, got ",
                   slot_mapping.scalar_type()));
  TORCH_CHECK_VALUE(key.dim() == 3, msg("key must be [T, H_kv, D], got shape ", key.sizes()));
  TORCH_CHECK_VALUE(value.sizes() == key.sizes(), msg("value shape ", value.sizes(), " != key shape ", key.sizes()));
  TORCH_CHECK_VALUE(key_cache.dim() == 4, msg("key_cache must be [P, page_size, H_kv, D], got shape ",
                    key_cache.sizes()));
  TORCH_CHECK_VALUE(value_cache.sizes() == key_cache.sizes(), msg("value_cache shape ", value_cache.sizes(),
                    " != key_cache shape ", key_cache.sizes()));
  const i64 T = key.size(0), H_kv = key.size(1), D = key.size(2);
  const i64 P = key_cache.size(0), page_size = key_cache.size(1);
  TORCH_CHECK_VALUE(key_cache.size(2) == H_kv && key_cache.size(3) == D, msg("key_cache [P, page_size, H_kv, D] = ",
                    key_cache.sizes(), " does not match key [T, H_kv, D] = ", key.sizes()));
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.size(0) == T, msg("slot_mapping must be [T = ", T,
                    "], got shape ", slot_mapping.sizes()));
  check_last_dim_contiguous(key, "key");
  check_last_dim_contiguous(value, "value");
  check_last_dim_contiguous(key_cache, "key_cache");
  check_last_dim_contiguous(value_cache, "value_cache");
  TORCH_CHECK_VALUE(key.is_cuda(), msg("key must be a CUDA tensor, got ", key.device()));
  check_device(value, key, "value");
  check_device(key_cache, key, "key_cache");
  check_device(value_cache, key, "value_cache");
  check_device(slot_mapping, key, "slot_mapping");
  const int ks_stride = scale_stride(k_scale, H_kv, key, "k_scale");
  const int vs_stride = scale_stride(v_scale, H_kv, key, "v_scale");
  TORCH_CHECK_VALUE(T <= INT_MAX && P <= INT_MAX && page_size <= INT_MAX && H_kv <= INT_MAX && D <= INT_MAX, msg("store_kv sizes must fit in int32"));
  if (T == 0 || H_kv == 0 || D == 0) return;
  const i64 items = T * H_kv * D;
  TORCH_CHECK_VALUE(items / sm70attn::StoreKVTraits::THREADS < INT_MAX, msg("store_kv: too many elements"));

  sm70attn::StoreKVParams p{};
  p.key = reinterpret_cast<const __half*>(key.data_ptr<at::Half>());
  p.value = reinterpret_cast<const __half*>(value.data_ptr<at::Half>());
  p.key_stride_t = key.stride(0), p.key_stride_h = key.stride(1);
  p.value_stride_t = value.stride(0), p.value_stride_h = value.stride(1);
  p.k_cache = reinterpret_cast<unsigned char*>(key_cache.data_ptr());
  p.v_cache = reinterpret_cast<unsigned char*>(value_cache.data_ptr());
  p.kc_stride_page = key_cache.stride(0), p.kc_stride_tok = key_cache.stride(1);
  p.kc_stride_head = key_cache.stride(2);
  p.vc_stride_page = value_cache.stride(0), p.vc_stride_tok = value_cache.stride(1);
  p.vc_stride_head = value_cache.stride(2);
  p.slot_mapping = reinterpret_cast<const i64*>(slot_mapping.data_ptr<int64_t>());
  p.slot_stride = slot_mapping.stride(0);
  p.k_scale = k_scale.data_ptr<float>(), p.v_scale = v_scale.data_ptr<float>();
  p.k_scale_stride = ks_stride, p.v_scale_stride = vs_stride;
  p.T = (int)T, p.H_kv = (int)H_kv, p.D = (int)D, p.page_size = (int)page_size, p.num_pages = (int)P;
  // 16-byte fp16 loads and 8-byte e4m3 stores when every row allows them.
  p.vec8 = D % 8 == 0 && ptr_aligned(key, 16) && ptr_aligned(value, 16) && strides_aligned(key, 2, 8) &&
           strides_aligned(value, 2, 8) && ptr_aligned(key_cache, 8) && ptr_aligned(value_cache, 8) &&
           strides_aligned(key_cache, 3, 8) && strides_aligned(value_cache, 3, 8);

  const c10::cuda::CUDAGuard guard(key.device());
  const int device = key.get_device();
  const sm70attn::Launcher l{&driver().launch, &load_kernel, device, c10::cuda::getCurrentCUDAStream(device).stream()};
  check_cu(sm70attn::launch_store_kv(l, p), "store_kv launch");
}

// Test hook (mma_atom_check): D = A B + C through one MMA atom and its element maps.
// Its operands' shapes, from the atom (csrc/sm70attn/mma_atoms.h: device code, not included here).
template <int SHAPE>
struct Atom {
  static constexpr int GROUPS = SHAPE == 16816 ? 1 : 4, M = SHAPE == 16816 ? 16 : 8, N = 8, K = SHAPE == 16816 ? 16 : 4;
};

template <int SHAPE>
at::Tensor mma_atom_check_t(const at::Tensor& A, const at::Tensor& B, const at::Tensor& C) {
  using At = Atom<SHAPE>;
  const std::vector<int64_t> sa{At::GROUPS, At::M, At::K}, sb{At::GROUPS, At::K, At::N}, sc{At::GROUPS, At::M, At::N};
  TORCH_CHECK_VALUE(A.is_cuda() && B.is_cuda() && C.is_cuda() && A.device() == B.device() && A.device() == C.device(),
                    "mma_atom_check: A, B and C must be on one CUDA device");
  TORCH_CHECK_VALUE(A.scalar_type() == at::kHalf && B.scalar_type() == at::kHalf && C.scalar_type() == at::kFloat,
                    "mma_atom_check: A and B float16, C float32");
  TORCH_CHECK_VALUE(A.sizes().vec() == sa && B.sizes().vec() == sb && C.sizes().vec() == sc && A.is_contiguous() &&
                        B.is_contiguous() && C.is_contiguous(),
                    msg("mma_atom_check: contiguous A [", At::GROUPS, ", ", At::M, ", ", At::K, "], B [", At::GROUPS,
                        ", ", At::K, ", ", At::N, "], C [", At::GROUPS, ", ", At::M, ", ", At::N, "]"));
  const c10::cuda::CUDAGuard guard(A.device());
  at::Tensor D = at::empty_like(C);
  D.fill_(std::nanf(""));  // poisoned: an element no lane writes stays NaN
  const sm70attn::Launcher l = launcher(A.get_device());
  using K = sm70attn::MmaCheckKernel<SHAPE>;
  CUfunction f = nullptr;
  check_cu(sm70attn::function<K>(l, &f), "mma_atom_check");
  const void *a = A.data_ptr(), *b = B.data_ptr(), *c = C.data_ptr();
  void* d = D.data_ptr();
  void* args[] = {&a, &b, &c, &d};
  check_cu(l.drv->launch(f, 1, 1, 1, K::THREADS, 1, 1, 0, l.stream, args, nullptr), "mma_atom_check launch");
  return D;
}

at::Tensor mma_atom_check(int64_t shape, const at::Tensor& A, const at::Tensor& B, const at::Tensor& C) {
  TORCH_CHECK_VALUE(shape == 884 || shape == 8844 || shape == 16816,
                    "mma_atom_check: shape 884 (m8n8k4), 8844 (m8n8k4 with B row-major) or 16816 (m16n8k16)");
  if (shape == 884) return mma_atom_check_t<884>(A, B, C);
  if (shape == 8844) return mma_atom_check_t<8844>(A, B, C);
  TORCH_CHECK_VALUE(A.is_cuda(), "mma_atom_check: A, B and C must be on one CUDA device");
  TORCH_CHECK_VALUE(device_info(A.get_device()).cc >= 80, "mma_atom_check: m16n8k16 needs SM80 or newer");
  return mma_atom_check_t<16816>(A, B, C);
}

}  // namespace
