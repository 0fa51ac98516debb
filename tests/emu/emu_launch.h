// What kernels.cpp and kernel_shard.cpp share: the CUDA stand-ins, the kernel parameters, the
// kernel lists and the launchers. The kernels compile apart from the tests (kernel_shard.cpp,
// one shard per core), so that the build runs on every core.
#pragma once
#include "emu_runtime.h"
#include "cuda_fp16.h"
#include "sm70attn/params.h"
#include "sm70attn/static_switch.h"

namespace sm70attn { extern unsigned char smem[100 * 1024]; }

// Each launch notes its kernel's family (registry.h); a run prints the families it launched
// ("families: ..."), and tests/test_emulated_kernels.py checks that its cases launch every one.
void emu_ran(sm70attn::Family f);

// Each run every CTA of the grid, one after another, on shared memory poisoned with NaN bytes.
template <class KT> void launch_attn(dim3 grid, const sm70attn::PagedAttnParams& a);
template <class KT, class At> void launch_attn_rf(dim3 grid, const sm70attn::PagedAttnParams& a);
template <class CT> void launch_combine(dim3 grid, const sm70attn::PagedAttnParams& a);
template <class KT> void launch_varlen(dim3 grid, const sm70attn::PagedAttnParams& a);
template <class CT> void launch_combine_varlen(dim3 grid, const sm70attn::PagedAttnParams& a);
template <class PT, class At> void launch_prefill(dim3 grid, const sm70attn::PagedAttnParams& a);
