// The registration list: every kernel family and every instance of it the launcher can pick,
// written once. Read by the launcher (csrc/launch.h: each kernel's name for the loader, and the
// switches of static_switch.h from runtime values to traits), by the binding (the attention
// kernel kinds set_kernel_override and plan() name: csrc/binding/call_plan.h), by NVRTC's
// loader and the SM70 gate (torch_sm70attn/nvrtc.py parses the X(...) entries below: edit only
// here), by the CPU emulator (tests/emu/kernel_shard.cpp) and by the sanitizer cells
// (tools/sanitize_cells.py); tests/test_registry.py holds them together. DESIGN.md, "To change X,
// touch Y", says what adding a kernel takes.
#pragma once

// X(ID, family, kind, header, kernel, traits, name, instances), one entry a family:
//   ID         its enumerator (Family below); the attention kernel kinds come first
//   family     its name for the loader (nvrtc.Kernel.family, KernelKey) and its cache files
//   kind       the attention kernel kind it is (set_kernel_override, plan()), "" for others
//   header     the header NVRTC compiles it from, in csrc/sm70attn/
//   kernel     its C++ name in namespace sm70attn; {t}: the instance's traits type
//   traits     the traits template, instantiated with the instance's parameters (its
//              THREADS and SMEM_BYTES: the launch shape and the gate's shared memory)
//   name       its display name (the build's table, docs/data/sass.json); {0}, {1}, {2}: the
//              parameters, {atom}: the MMA atom's name (nvrtc.py)
//   instances  the X-list of its instances, X(parameters) each
#define SM70ATTN_FAMILIES(X)                                                                          \
  X(ATTN_WMMA, "attn", "wmma", "paged_attention.cuh", "paged_attention_kernel<{t}>", AttnTraits,      \
    "attn D{0} MB{1} VEC{2}", SM70ATTN_ATTN_KERNELS)                                                  \
  X(ATTN_RF_M8N8K4, "attn-rf-m8n8k4", "rf-m8n8k4", "paged_attention_rf.cuh",                          \
    "paged_attention_rf_kernel<{t}, sm70attn::MmaM8N8K4>", AttnRfTraits, "attn-rf D{0} MB{1} VEC{2} m8n8k4", \
    SM70ATTN_RF_KERNELS)                                                                              \
  X(ATTN_RF_M16N8K16, "attn-rf-m16n8k16", "rf-m16n8k16", "paged_attention_rf.cuh",                    \
    "paged_attention_rf_kernel<{t}, sm70attn::MmaM16N8K16>", AttnRfTraits,                            \
    "attn-rf D{0} MB{1} VEC{2} m16n8k16", SM70ATTN_RF_KERNELS)                                        \
  X(COMBINE, "combine", "", "combine.cuh", "combine_kernel<{t}>", CombineTraits, "combine D{0} WPR{1}", \
    SM70ATTN_COMBINE_KERNELS)                                                                         \
  X(ATTN_VARLEN, "attn-varlen", "", "varlen.cuh", "paged_attention_varlen_kernel<{t}>", AttnTraits,   \
    "attn-varlen D{0} MB{1} VEC{2}", SM70ATTN_VARLEN_KERNELS)                                         \
  X(COMBINE_VARLEN, "combine-varlen", "", "varlen.cuh", "combine_varlen_kernel<{t}>", CombineVarlenTraits, \
    "combine-varlen D{0}", SM70ATTN_COMBINE_VARLEN_KERNELS)                                           \
  X(PREFILL_M8N8K4, "prefill-m8n8k4", "", "prefill.cuh", "prefill_kernel<{t}, sm70attn::MmaM8N8K4>",    \
    PrefillTraits, "prefill D{0} VEC{1} m8n8k4", SM70ATTN_PREFILL_KERNELS)                            \
  X(PREFILL_M16N8K16, "prefill-m16n8k16", "", "prefill.cuh", "prefill_kernel<{t}, sm70attn::MmaM16N8K16>", \
    PrefillTraits, "prefill D{0} VEC{1} m16n8k16", SM70ATTN_PREFILL_KERNELS)                          \
  X(STORE_KV, "store_kv", "", "store_kv.cuh", "store_kv_kernel", StoreKVTraitsOf, "store_kv",         \
    SM70ATTN_STORE_KV_KERNELS)                                                                        \
  X(MMA_CHECK, "mma", "", "mma_check.cuh", "mma_check_kernel<{t}::Atom>", MmaCheckTraits, "mma atom {atom}", \
    SM70ATTN_MMA_CHECK_KERNELS)

// Attention kernels (paged_attention.cuh): X(head dim D, 16-row blocks per CTA MB, KV load bytes
// VEC). MB runs to attn_max_row_blocks(D); VEC 8 serves caches that are only 8-byte aligned.
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

// paged_attention_varlen's prefill kernel (prefill.cuh), for its requests of more than
// kPrefillMinQ tokens: X(D, VEC), each family on its MMA atom (m8n8k4: SM70's; m16n8k16: SM80+,
// before SM80 it compiles to a trap).
#define SM70ATTN_PREFILL_KERNELS(X) \
  X(64, 16) X(64, 8) \
  X(128, 16) X(128, 8) \
  X(256, 16) X(256, 8)

// store_kv: one kernel, no parameters.
#define SM70ATTN_STORE_KV_KERNELS(X) X()

// The MMA atom check (tests): X(SHAPE): 884 (m8n8k4), 8844 (m8n8k4 with B row-major), 16816
// (m16n8k16; before SM80 it compiles to a trap).
#define SM70ATTN_MMA_CHECK_KERNELS(X) X(884) X(8844) X(16816)

namespace sm70attn {

// The families, in the list's order. The attention kernel kinds (AttnKind, traits.h) are the
// first kAttnKinds of them.
enum Family : int {
#define SM70ATTN_ENUM(ID, ...) ID,
  SM70ATTN_FAMILIES(SM70ATTN_ENUM)
#undef SM70ATTN_ENUM
  kFamilies
};

#ifndef __CUDACC_RTC__
constexpr const char* kFamilyNames[] = {
#define SM70ATTN_NAME(ID, family, ...) family,
    SM70ATTN_FAMILIES(SM70ATTN_NAME)
#undef SM70ATTN_NAME
};
constexpr const char* kFamilyKinds[] = {
#define SM70ATTN_KIND(ID, family, kind, ...) kind,
    SM70ATTN_FAMILIES(SM70ATTN_KIND)
#undef SM70ATTN_KIND
};

// The family's name for the loader (KernelKey::family).
constexpr const char* family_name(int f) { return kFamilyNames[f]; }

// How many families lead the list with a kind name; none after them has one.
constexpr int count_kinds(int i = 0) { return i < kFamilies && kFamilyKinds[i][0] ? 1 + count_kinds(i + 1) : 0; }
constexpr int kAttnKinds = count_kinds();
constexpr bool kinds_lead(int i = kAttnKinds) { return i == kFamilies || (!kFamilyKinds[i][0] && kinds_lead(i + 1)); }
static_assert(kAttnKinds > 0 && kinds_lead(), "registry.h: the attention kernel kinds come first");
#endif  // __CUDACC_RTC__

}  // namespace sm70attn
