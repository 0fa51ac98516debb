// The plan of a paged_attention call on its device: the attention kernel kind, the occupancy it
// is sized for (cached per device) and sm70attn::plan_paged_attention's split of the work.
#pragma once

#include <algorithm>

#include "host.h"

namespace {

// Names of the kernel kinds, by sm70attn::AttnKind (set_kernel_override takes them, plan() reports
// them): the registry's (csrc/sm70attn/registry.h).
constexpr const char* const* kKindNames = sm70attn::kFamilyKinds;
constexpr int kKinds = sm70attn::kAttnKinds;

// The attention kernel kind of a call (sm70attn::attn_default_kind), or the one
// set_kernel_override forces where it applies (tests and A/B runs). Shapes outside
// attn_uses_rf have the WMMA kernel only.
int kernel_kind(int device, int d, int mb, i64 capacity) {
  if (!sm70attn::attn_uses_rf(d, mb)) return sm70attn::ATTN_WMMA;
  const int cc = device_info(device).cc, forced = g_kernel.load();
  if (forced < 0) return sm70attn::attn_default_kind(d, mb, cc, capacity);
  TORCH_CHECK_VALUE(forced != sm70attn::ATTN_RF_M16N8K16 || cc >= 80,
                    msg("paged_attention: set_kernel_override('rf-m16n8k16') needs SM80 or newer, device ", device,
                        " is SM", cc, "; set 'auto' or 'rf-m8n8k4'"));
  return forced;
}

// The prefill kernel paged_attention_varlen launches for its long requests on a device: the
// m16n8k16 twin on SM80 and newer, m8n8k4 below (SM70's atom), or what set_prefill_override says.
int prefill_kind(int device) {
  const int forced = g_prefill.load();
  const int cc = device_info(device).cc;
  if (forced == kPrefillAuto) return cc >= 80 ? sm70attn::PREFILL_M16N8K16 : sm70attn::PREFILL_M8N8K4;
  TORCH_CHECK_VALUE(forced != sm70attn::PREFILL_M16N8K16 || cc >= 80,
                    msg("paged_attention_varlen: set_prefill_override('m16n8k16') needs SM80 or newer, device ", device,
                        " is SM", cc, "; set 'auto' or 'm8n8k4'"));
  return forced;
}

// sm70attn::prefill_ctas_per_sm, cached per (device, family, D, vec): the query loads the kernel.
int prefill_occupancy(const sm70attn::Launcher& l, int family, int d, int vec) {
  static std::atomic<int> cache[sm70attn::kMaxDevices][2][3][2];  // 0: not yet asked
  const int device = l.device, m16 = family == sm70attn::PREFILL_M16N8K16;
  if (device < 0 || device >= sm70attn::kMaxDevices || (!m16 && family != sm70attn::PREFILL_M8N8K4) ||
      (d != 64 && d != 128 && d != 256))
    return sm70attn::prefill_ctas_per_sm(l, family, d, vec);
  std::atomic<int>& c = cache[device][m16][d == 64 ? 0 : d == 128 ? 1 : 2][vec == 16];
  int n = c.load(std::memory_order_relaxed);
  if (n == 0) {
    n = std::max(sm70attn::prefill_ctas_per_sm(l, family, d, vec), 1);
    c.store(n, std::memory_order_relaxed);
  }
  return n;
}

// sm70attn::attn_ctas_per_sm, cached per (device, kind, D, mb, vec): the query loads the kernel.
int ctas_per_sm(const sm70attn::Launcher& l, int kind, int d, int mb, int vec) {
  static std::atomic<int> cache[sm70attn::kMaxDevices][kKinds][3][9][2];  // 0: not yet asked
  const int device = l.device;
  if (device < 0 || device >= sm70attn::kMaxDevices || kind < 0 || kind >= kKinds || mb < 1 || mb > 8 ||
      (d != 64 && d != 128 && d != 256))
    return sm70attn::attn_ctas_per_sm(l, kind, d, mb, vec);
  std::atomic<int>& c = cache[device][kind][d == 64 ? 0 : d == 128 ? 1 : 2][mb][vec == 16];
  int n = c.load(std::memory_order_relaxed);
  if (n == 0) {
    n = std::max(sm70attn::attn_ctas_per_sm(l, kind, d, mb, vec), 1);
    c.store(n, std::memory_order_relaxed);
  }
  return n;
}

// The plan of a call on this device, with the occupancy it was sized for and the dynamic shared
// memory to launch with (0: the kernel's own).
struct CallPlan {
  sm70attn::AttnPlan plan;
  int kind = 0, num_sms = 0, ctas_per_sm = 0, smem_bytes = 0;
};

CallPlan plan_call(const sm70attn::Launcher& l, i64 B, i64 H_q, i64 H_kv, i64 Q, i64 D, i64 capacity, int vec) {
  CallPlan c;
  const int device = l.device;
  c.num_sms = device_info(device).num_sms;
  // (set the override while no other thread launches: the two values are read separately)
  if (const int sms = g_plan_sms.load(); sms > 0) c.num_sms = sms;
  // Splits follow the kernel's occupancy on this device (a property of (D, mb, vec), the kind and the GPU
  // only: the plan stays independent of B and of seq_lens values).
  const int mb = sm70attn::plan_paged_attention((int)B, (int)H_q, (int)H_kv, (int)Q, (int)D, capacity, c.num_sms).mb;
  c.kind = kernel_kind(device, (int)D, mb, capacity);
  c.ctas_per_sm = ctas_per_sm(l, c.kind, (int)D, mb, vec);
  if (const int sm_smem = g_plan_sm_smem.load(); sm_smem > 0) {
    // As many CTAs as sm_smem holds, and a padded launch so that this device holds no more.
    const int own = sm70attn::attn_smem_bytes(c.kind, (int)D, mb, vec);
    TORCH_CHECK_VALUE(sm_smem >= own, msg("set_plan_override: sm_smem_bytes = ", sm_smem,
                      " holds no CTA of the D = ", D, " kernel (", own, " bytes of shared memory); a V100 has 98304"));
    const int dev_smem = device_attribute(device, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR);
    const int reserved = device_attribute(device, CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK);
    const int optin = device_attribute(device, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN);
    const int want = std::max(1, std::min(c.ctas_per_sm, sm_smem / std::max(own, 1)));
    c.smem_bytes = std::max(own, std::min(optin, dev_smem / want - reserved));
    c.ctas_per_sm = std::max(1, sm70attn::attn_ctas_per_sm(l, c.kind, (int)D, mb, vec, c.smem_bytes));
  }
  c.plan = sm70attn::plan_paged_attention((int)B, (int)H_q, (int)H_kv, (int)Q, (int)D, capacity, c.num_sms,
                                          c.ctas_per_sm);
  return c;
}

}  // namespace
