// The launchers of one shard of the kernels of the registration list (registry.h: the instance
// lists below; store_kv and the atom check compile in kernels.cpp): with -DEMU_SHARDS=n
// -DEMU_SHARD=i, the kernels whose place in the lists (counted by __COUNTER__) is i mod n; without
// them, one shard of all. The test compiles the shards in parallel and links them with kernels.cpp.
#include <type_traits>

#include "emu_launch.h"
#include "sm70attn/combine.cuh"
#include "emu_atoms.h"
#include "sm70attn/paged_attention.cuh"
#include "sm70attn/paged_attention_rf.cuh"
#include "sm70attn/varlen.cuh"
#include "sm70attn/prefill.cuh"

#ifndef EMU_SHARDS
#define EMU_SHARDS 1
#define EMU_SHARD 0
#endif

using namespace sm70attn;

template <class F>
static void launch(dim3 grid, int threads, F kernel) {
  for (unsigned y = 0; y < grid.y; ++y)
    for (unsigned x = 0; x < grid.x; ++x) {
      memset(smem, 0xFF, sizeof smem);
      emu::run_block(dim3(x, y), grid, threads, kernel);
    }
}

template <class KT>
void launch_attn(dim3 grid, const PagedAttnParams& a) {
  static_assert(KT::SMEM_BYTES <= sizeof(smem), "");
  emu_ran(ATTN_WMMA);
  launch(grid, KT::THREADS, [&] { paged_attention_kernel<KT>(a); });
}

template <class KT, class At>
void launch_attn_rf(dim3 grid, const PagedAttnParams& a) {
  static_assert(KT::SMEM_BYTES <= sizeof(smem), "");
  emu_ran(std::is_same<At, MmaM8N8K4>::value ? ATTN_RF_M8N8K4 : ATTN_RF_M16N8K16);
  launch(grid, KT::THREADS, [&] { paged_attention_rf_kernel<KT, At>(a); });
}

template <class CT>
void launch_combine(dim3 grid, const PagedAttnParams& a) {
  static_assert(CT::SMEM_BYTES <= sizeof(smem), "");
  emu_ran(COMBINE);
  launch(grid, CT::THREADS, [&] { combine_kernel<CT>(a); });
}

template <class KT>
void launch_varlen(dim3 grid, const PagedAttnParams& a) {
  static_assert(KT::SMEM_BYTES + kVarlenSmemExtra <= sizeof(smem), "");
  emu_ran(ATTN_VARLEN);
  launch(grid, KT::THREADS, [&] { paged_attention_varlen_kernel<KT>(a); });
}

template <class CT>
void launch_combine_varlen(dim3 grid, const PagedAttnParams& a) {
  emu_ran(COMBINE_VARLEN);
  launch(grid, CT::THREADS, [&] { combine_varlen_kernel<CT>(a); });
}

template <class PT, class At>
void launch_prefill(dim3 grid, const PagedAttnParams& a) {
  static_assert(PT::SMEM_BYTES <= sizeof(smem), "");
  launch(grid, PT::THREADS, [&] { prefill_kernel<PT, At>(a); });
  emu_ran(std::is_same<At, MmaM8N8K4>::value ? PREFILL_M8N8K4 : PREFILL_M16N8K16);
}

// Instantiating Shard<T, true> compiles the launcher of T; Shard<T, false> compiles nothing.
template <class T, bool mine>
struct Shard {
  static void* launcher() { return nullptr; }
};
template <int D, int MB, int VEC>
struct Shard<AttnTraits<D, MB, VEC>, true> {
  static void* launcher() { return (void*)&launch_attn<AttnTraits<D, MB, VEC>>; }
};
template <class KT, class At>
struct RfKernel {};  // a register-fragment kernel: traits and MMA atom
template <class KT, class At>
struct Shard<RfKernel<KT, At>, true> {
  static void* launcher() { return (void*)&launch_attn_rf<KT, At>; }
};
template <int D, int WPR>
struct Shard<CombineTraits<D, WPR>, true> {
  static void* launcher() { return (void*)&launch_combine<CombineTraits<D, WPR>>; }
};
template <class KT>
struct VarlenKernel {};  // the varlen tile loop of these traits
template <class KT>
struct Shard<VarlenKernel<KT>, true> {
  static void* launcher() { return (void*)&launch_varlen<KT>; }
};
template <int D>
struct Shard<CombineVarlenTraits<D>, true> {
  static void* launcher() { return (void*)&launch_combine_varlen<CombineVarlenTraits<D>>; }
};
template <class PT, class At>
struct PrefillKernel {};  // the prefill kernel: traits and MMA atom
template <class PT, class At>
struct Shard<PrefillKernel<PT, At>, true> {
  static void* launcher() { return (void*)&launch_prefill<PT, At>; }
};
#define EMU_PREFILL(D, VEC)                                                                                          \
  template struct Shard<PrefillKernel<PrefillTraits<D, VEC>, MmaM8N8K4>, __COUNTER__ % EMU_SHARDS == EMU_SHARD>; \
  template struct Shard<PrefillKernel<PrefillTraits<D, VEC>, MmaM16N8K16>, __COUNTER__ % EMU_SHARDS == EMU_SHARD>;
#define EMU_VARLEN(D, MB, VEC) \
  template struct Shard<VarlenKernel<AttnTraits<D, MB, VEC>>, __COUNTER__ % EMU_SHARDS == EMU_SHARD>;
#define EMU_COMBINE_VARLEN(D) template struct Shard<CombineVarlenTraits<D>, __COUNTER__ % EMU_SHARDS == EMU_SHARD>;
#define EMU_ATTN(D, MB, VEC) template struct Shard<AttnTraits<D, MB, VEC>, __COUNTER__ % EMU_SHARDS == EMU_SHARD>;
#define EMU_ATTN_RF(D, MB, VEC)                                                                                   \
  template struct Shard<RfKernel<AttnRfTraits<D, MB, VEC>, MmaM8N8K4>, __COUNTER__ % EMU_SHARDS == EMU_SHARD>; \
  template struct Shard<RfKernel<AttnRfTraits<D, MB, VEC>, MmaM16N8K16>, __COUNTER__ % EMU_SHARDS == EMU_SHARD>;
#define EMU_COMBINE(D, WPR) template struct Shard<CombineTraits<D, WPR>, __COUNTER__ % EMU_SHARDS == EMU_SHARD>;
SM70ATTN_ATTN_KERNELS(EMU_ATTN)
SM70ATTN_RF_KERNELS(EMU_ATTN_RF)
SM70ATTN_COMBINE_KERNELS(EMU_COMBINE)
SM70ATTN_VARLEN_KERNELS(EMU_VARLEN)
SM70ATTN_COMBINE_VARLEN_KERNELS(EMU_COMBINE_VARLEN)
SM70ATTN_PREFILL_KERNELS(EMU_PREFILL)
