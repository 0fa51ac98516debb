// Host-side launches through the CUDA driver API (torch-free, built by a host compiler): the
// binding checks inputs, fills the params, allocates the workspace the plan (plan.h) asks for and
// calls these on its current stream. The kernels are not compiled here: NVRTC compiles each at its
// first use (torch_sm70attn/nvrtc.py) and a loader the binding installs hands it over as a
// CUfunction, cached per kernel and device.
#pragma once

#include <cuda.h>

#include <atomic>

#include "sm70attn/params.h"
#include "sm70attn/plan.h"
#include "sm70attn/registry.h"
#include "sm70attn/static_switch.h"
#include "sm70attn/traits.h"

namespace sm70attn {

// The driver entry points a launch needs, resolved by the binding (torch binds none of them).
struct Driver {
  decltype(&::cuLaunchKernel) launch = nullptr;
  decltype(&::cuFuncSetAttribute) set_attribute = nullptr;
  decltype(&::cuOccupancyMaxActiveBlocksPerMultiprocessor) occupancy = nullptr;
};

// A kernel as the loader names it (torch_sm70attn.nvrtc.Kernel): family (registry.h) and integer
// parameters.
struct KernelKey {
  const char* family;
  int params[3];
  int n;
};

// The loader: the CUfunction of a kernel in `device`'s context (the current one); throws when the
// kernel cannot be had (no NVRTC, a compile error), never returns null.
using KernelLoader = CUfunction (*)(const KernelKey& key, int device);

// What every launch needs: the driver, the loader, the device (its context current) and a stream.
struct Launcher {
  const Driver* drv;
  KernelLoader load;
  int device;
  CUstream stream;
};

constexpr int kMaxDevices = 64;

// The kernels, as types: each names itself for the loader (its family in registry.h) and knows
// its launch shape. A family of the registry without one here has no launcher
// (tests/test_registry.py).
template <class KT, int KIND>  // KIND: the attention kind, which is the kernel's family
struct AttnKernel {
  static constexpr int THREADS = KT::THREADS, SMEM = KT::SMEM_BYTES;
  static KernelKey key() { return {family_name(KIND), {KT::D, KT::MB, KT::VEC}, 3}; }
};

template <class KT>
struct VarlenKernel {
  static constexpr int THREADS = KT::THREADS, SMEM = KT::SMEM_BYTES + kVarlenSmemExtra;
  static KernelKey key() { return {family_name(ATTN_VARLEN), {KT::D, KT::MB, KT::VEC}, 3}; }
};

// The prefill kernel (prefill.cuh) of family PREFILL_M8N8K4 (SM70's atom) or PREFILL_M16N8K16
// (SM80+); kNoPrefill: none (paged_attention_varlen's tile loop takes every request).
constexpr int kNoPrefill = -1;

template <class PT, int FAMILY>
struct PrefillKernel {
  static constexpr int THREADS = PT::THREADS, SMEM = PT::SMEM_BYTES;
  static KernelKey key() { return {family_name(FAMILY), {PT::D, PT::VEC, 0}, 2}; }
};

// Calls f(K{}) for the (family, D, vec) prefill kernel; false when none is built.
template <class F>
inline bool prefill_kernel(int family, int d, int vec, F&& f) {
  if (family != PREFILL_M8N8K4 && family != PREFILL_M16N8K16) return false;
  return prefill_switch(d, vec, [&](auto pt) {
    if (family == PREFILL_M8N8K4)
      f(PrefillKernel<decltype(pt), PREFILL_M8N8K4>{});
    else
      f(PrefillKernel<decltype(pt), PREFILL_M16N8K16>{});
  });
}

template <class CT>
struct CombineVarlenKernel {
  static constexpr int THREADS = CT::THREADS, SMEM = CT::SMEM_BYTES;
  static KernelKey key() { return {family_name(COMBINE_VARLEN), {CT::D, 0, 0}, 1}; }
};

template <class CT>
struct CombineKernel {
  static constexpr int THREADS = CT::THREADS, SMEM = CT::SMEM_BYTES;
  static KernelKey key() { return {family_name(COMBINE), {CT::D, CT::WPR, 0}, 2}; }
};

struct StoreKVKernel {
  static constexpr int THREADS = StoreKVTraits::THREADS, SMEM = 0;
  static KernelKey key() { return {family_name(STORE_KV), {0, 0, 0}, 0}; }
};

// The MMA atom check (tests): SHAPE 884 (m8n8k4), 8844 (m8n8k4 with B row-major), 16816 (m16n8k16).
template <int SHAPE>
struct MmaCheckKernel {
  static constexpr int THREADS = MmaCheckTraits<SHAPE>::THREADS, SMEM = MmaCheckTraits<SHAPE>::SMEM_BYTES;
  static KernelKey key() { return {family_name(MMA_CHECK), {SHAPE, 0, 0}, 1}; }
};

// The CUfunction of kernel K on the launcher's device: loaded at its first use there, then read
// from a per-device slot (one atomic load a launch). A kernel that needs more than the default
// 48 KB of dynamic shared memory is allowed its own amount once, when it is loaded.
template <class K>
inline CUresult function(const Launcher& l, CUfunction* out) {
  static std::atomic<CUfunction> slots[kMaxDevices];
  std::atomic<CUfunction>* slot = l.device >= 0 && l.device < kMaxDevices ? &slots[l.device] : nullptr;
  CUfunction f = slot ? slot->load(std::memory_order_acquire) : nullptr;
  if (!f) {
    f = l.load(K::key(), l.device);
    if (K::SMEM > 48 * 1024) {
      const CUresult err = l.drv->set_attribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, K::SMEM);
      if (err != CUDA_SUCCESS) return err;
    }
    if (slot) slot->store(f, std::memory_order_release);
  }
  *out = f;
  return CUDA_SUCCESS;
}

// Calls f(K{}) for the (kind, D, mb, vec) attention kernel; false when none is built (an RF kind
// only where attn_uses_rf(D, mb)).
template <class F>
inline bool attn_kernel(int kind, int d, int mb, int vec, F&& f) {
  if (kind == ATTN_WMMA)
    return attn_switch(d, mb, vec, [&](auto kt) { f(AttnKernel<decltype(kt), ATTN_WMMA>{}); });
  if (kind != ATTN_RF_M8N8K4 && kind != ATTN_RF_M16N8K16) return false;
  return attn_rf_switch(d, mb, vec, [&](auto kt) {
    if (kind == ATTN_RF_M8N8K4)
      f(AttnKernel<decltype(kt), ATTN_RF_M8N8K4>{});
    else
      f(AttnKernel<decltype(kt), ATTN_RF_M16N8K16>{});
  });
}

// Shared memory of the (kind, D, mb, vec) attention kernel (0: not built).
inline int attn_smem_bytes(int kind, int d, int mb, int vec) {
  int n = 0;
  attn_kernel(kind, d, mb, vec, [&](auto k) { n = decltype(k)::SMEM; });
  return n;
}

// Launches kernel K with its params struct (by value, as the kernel takes it); smem bytes of
// dynamic shared memory, raised past the kernel's own where asked (a benchmark's stand-in for a
// smaller SM: set_plan_override).
template <class K, class P>
inline CUresult launch(const Launcher& l, unsigned gx, unsigned gy, int smem, P& params) {
  CUfunction f = nullptr;
  CUresult err = function<K>(l, &f);
  if (err == CUDA_SUCCESS && smem > K::SMEM && smem > 48 * 1024)
    err = l.drv->set_attribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem);
  if (err != CUDA_SUCCESS) return err;
  void* args[] = {&params};
  return l.drv->launch(f, gx, gy, 1, (unsigned)K::THREADS, 1, 1, (unsigned)smem, l.stream, args, nullptr);
}

// p.num_splits / p.row_groups from the plan. CUDA_ERROR_INVALID_VALUE: (kind, D, mb, vec) not
// built. smem_bytes: dynamic shared memory per CTA, at least the kernel's (0: the kernel's);
// more only caps how many CTAs share an SM.
inline CUresult launch_paged_attention(const Launcher& l, const PagedAttnParams& params, int kind, int mb, int vec,
                                       int smem_bytes = 0) {
  PagedAttnParams p = params;
  set_divisors(p);
  CUresult err = CUDA_ERROR_INVALID_VALUE;
  attn_kernel(kind, p.D, mb, vec, [&](auto k) {
    using K = decltype(k);
    const int smem = smem_bytes > K::SMEM ? smem_bytes : K::SMEM;
    err = launch<K>(l, (unsigned)(p.B * p.H_kv * p.row_groups), (unsigned)p.num_splits, smem, p);
  });
  if (err != CUDA_SUCCESS || p.num_splits == 1) return err;
  err = CUDA_ERROR_INVALID_VALUE;
  combine_switch(p.D, p.num_splits, [&](auto ct) {
    using CT = decltype(ct);
    const unsigned rows = (unsigned)(((i64)p.B * p.H_q * p.Q + CT::ROWS - 1) / CT::ROWS);
    err = launch<CombineKernel<CT>>(l, rows, (unsigned)(CT::D / CT::CW), CT::SMEM_BYTES, p);
  });
  return err;
}

// Resident CTAs per SM of the (kind, D, mb, vec) attention kernel on the launcher's device (0: not
// built or the query failed), for plan_paged_attention's ctas_per_sm; smem_bytes as in
// launch_paged_attention. Loads the kernel (its first use compiles it); enqueues no work.
inline int attn_ctas_per_sm(const Launcher& l, int kind, int d, int mb, int vec, int smem_bytes = 0) {
  int n = 0;
  attn_kernel(kind, d, mb, vec, [&](auto k) {
    using K = decltype(k);
    const int smem = smem_bytes > K::SMEM ? smem_bytes : K::SMEM;
    CUfunction f = nullptr;
    if (function<K>(l, &f) != CUDA_SUCCESS ||
        (smem > K::SMEM && smem > 48 * 1024 &&
         l.drv->set_attribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem) != CUDA_SUCCESS) ||
        l.drv->occupancy(&n, f, K::THREADS, (size_t)smem) != CUDA_SUCCESS)
      n = 0;
  });
  return n;
}

// paged_attention_varlen (plan: plan_paged_attention_varlen, its fields in p): the tile loop over
// tiles x H_kv CTAs and split_cap splits, the prefill kernel of family `prefill` (kNoPrefill: none,
// the tile loop takes every request) over pf_tiles x H_kv CTAs, then the combine of the split
// units. The unit heads must be zero (no unit used) before the launch.
inline CUresult launch_paged_attention_varlen(const Launcher& l, const PagedAttnParams& params, const VarlenPlan& plan,
                                              int vec, int prefill = kNoPrefill) {
  PagedAttnParams p = params;
  set_divisors(p);
  CUresult err = CUDA_ERROR_INVALID_VALUE;
  varlen_switch(p.D, varlen_row_blocks(), vec, [&](auto kt) {
    using K = VarlenKernel<decltype(kt)>;
    err = launch<K>(l, (unsigned)(plan.tiles * p.H_kv), (unsigned)p.split_cap, K::SMEM, p);
  });
  if (err == CUDA_SUCCESS && prefill != kNoPrefill) {
    err = CUDA_ERROR_INVALID_VALUE;
    prefill_kernel(prefill, p.D, vec, [&](auto k) {
      using K = decltype(k);
      err = launch<K>(l, (unsigned)(plan.pf_tiles * p.H_kv), (unsigned)p.split_cap, K::SMEM, p);
    });
  }
  if (err != CUDA_SUCCESS || p.units == 0) return err;
  err = CUDA_ERROR_INVALID_VALUE;
  combine_varlen_switch(p.D, [&](auto ct) { err = launch<CombineVarlenKernel<decltype(ct)>>(l, (unsigned)p.units, 1, 0, p); });
  return err;
}

// Resident CTAs per SM of the varlen tile loop (as attn_ctas_per_sm).
inline int varlen_ctas_per_sm(const Launcher& l, int d, int vec) {
  int n = 0;
  varlen_switch(d, varlen_row_blocks(), vec, [&](auto kt) {
    using K = VarlenKernel<decltype(kt)>;
    CUfunction f = nullptr;
    if (function<K>(l, &f) != CUDA_SUCCESS || l.drv->occupancy(&n, f, K::THREADS, (size_t)K::SMEM) != CUDA_SUCCESS)
      n = 0;
  });
  return n;
}

// Resident CTAs per SM of the (family, D, vec) prefill kernel (as attn_ctas_per_sm).
inline int prefill_ctas_per_sm(const Launcher& l, int family, int d, int vec) {
  int n = 0;
  prefill_kernel(family, d, vec, [&](auto k) {
    using K = decltype(k);
    CUfunction f = nullptr;
    if (function<K>(l, &f) != CUDA_SUCCESS || l.drv->occupancy(&n, f, K::THREADS, (size_t)K::SMEM) != CUDA_SUCCESS)
      n = 0;
  });
  return n;
}

inline CUresult launch_store_kv(const Launcher& l, const StoreKVParams& params) {
  StoreKVParams p = params;
  const i64 items = (i64)p.T * p.H_kv * (p.vec8 ? p.D / 8 : p.D);
  if (items == 0) return CUDA_SUCCESS;
  const i64 blocks = (items + StoreKVTraits::THREADS - 1) / StoreKVTraits::THREADS;
  return launch<StoreKVKernel>(l, (unsigned)blocks, 1, 0, p);
}

}  // namespace sm70attn
