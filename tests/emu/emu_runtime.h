// CPU emulation of the CUDA features the kernels use: one fiber (ucontext) per CUDA thread,
// cooperative scheduling in a random order between barriers, deadlock detection.
#pragma once
#include <sys/mman.h>
#include <ucontext.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <vector>

struct dim3 { unsigned x = 1, y = 1, z = 1; dim3() {} dim3(unsigned a, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {} };
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
struct float2 { float x, y; };
struct int2 { int x, y; };
struct int4 { int x, y, z, w; };
struct float4 { float x, y, z, w; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
inline float2 make_float2(float a, float b) { return {a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__
#define __align__(n)

using std::max;
using std::min;

namespace emu {
enum State { RUN, WAIT_CTA, WAIT_WARP, DONE };
struct Fiber { ucontext_t ctx; dim3 tid; State state; };
inline std::vector<Fiber> fibers;
inline int cur = 0;
inline ucontext_t sched;
inline dim3 block_idx, grid_dim, block_dim;
inline std::vector<float> shfl;
inline std::function<void()> body;
inline std::mt19937 rng(1);
inline bool randomize = true;
inline long long mma_calls = 0, mma_computed = 0;

// Fiber i's stack: 64 KB (the kernels use under 20) above as much inaccessible memory, so that an
// overflow faults rather than corrupts; made once, kept for every later CTA.
constexpr size_t STACK_BYTES = 64 * 1024;
inline std::vector<char*> stacks;
inline char* stack(int i) {
  while ((int)stacks.size() <= i) {
    void* m = mmap(nullptr, 2 * STACK_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED || mprotect(m, STACK_BYTES, PROT_NONE) != 0) { perror("fiber stack"); abort(); }
    stacks.push_back((char*)m + STACK_BYTES);
  }
  return stacks[i];
}

inline void wait(State s) {
  fibers[cur].state = s;
  swapcontext(&fibers[cur].ctx, &sched);
}
inline void entry() {
  body();
  fibers[cur].state = DONE;
  swapcontext(&fibers[cur].ctx, &sched);
}
void reset_mma_cache();

// Runs one CTA of `threads` threads to completion.
inline void run_block(dim3 bidx, dim3 grid, int threads, std::function<void()> fn) {
  block_idx = bidx, grid_dim = grid, block_dim = dim3(threads);
  body = std::move(fn);
  fibers.resize(threads);
  shfl.assign(threads + 32, 0.f);
  reset_mma_cache();
  for (int i = 0; i < threads; ++i) {
    Fiber& f = fibers[i];
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = stack(i);
    f.ctx.uc_stack.ss_size = STACK_BYTES;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, entry, 0);
    // Hidden from ASan's swapcontext, which would clear the shadow of the whole stack at every
    // switch into the fiber: most of the run time, and it drops the redzones of the live frames.
    // Nothing stale to clear: a finished fiber has returned from all of its frames.
    f.ctx.uc_stack = {};
    f.tid = dim3(i);
    f.state = RUN;
  }
  std::vector<int> order(threads);
  for (int i = 0; i < threads; ++i) order[i] = i;
  for (;;) {
    if (randomize) std::shuffle(order.begin(), order.end(), rng);
    for (int i : order)
      if (fibers[i].state == RUN) {
        cur = i;
        swapcontext(&sched, &fibers[i].ctx);
      }
    bool all_done = true, released = false;
    for (auto& f : fibers) all_done &= f.state == DONE;
    if (all_done) break;
    for (int w = 0; w * 32 < threads; ++w) {  // warp barriers
      bool ok = false, all = true;
      for (int l = w * 32; l < std::min(threads, w * 32 + 32); ++l) {
        if (fibers[l].state == WAIT_WARP) ok = true;
        else if (fibers[l].state != DONE) all = false;
      }
      if (ok && all) {
        for (int l = w * 32; l < std::min(threads, w * 32 + 32); ++l)
          if (fibers[l].state == WAIT_WARP) fibers[l].state = RUN;
        released = true;
      }
    }
    if (!released) {  // CTA barrier
      bool all = true;
      for (auto& f : fibers) all &= f.state == WAIT_CTA || f.state == DONE;
      bool any = false;
      for (auto& f : fibers) any |= f.state == WAIT_CTA;
      if (all && any) {
        for (auto& f : fibers) if (f.state == WAIT_CTA) f.state = RUN;
        released = true;
      }
    }
    if (!released) {
      fprintf(stderr, "DEADLOCK in block (%u,%u): mixed barriers\n", bidx.x, bidx.y);
      abort();
    }
  }
}
}  // namespace emu

#define threadIdx (emu::fibers[emu::cur].tid)
#define blockIdx (emu::block_idx)
#define gridDim (emu::grid_dim)
#define blockDim (emu::block_dim)

inline void __syncthreads() { emu::wait(emu::WAIT_CTA); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::wait(emu::WAIT_WARP); }
inline float __shfl_xor_sync(unsigned, float x, int o) {
  const int t = emu::cur, base = t & ~31;
  emu::shfl[t] = x;
  __syncwarp();
  const float y = emu::shfl[base + ((t & 31) ^ o)];
  __syncwarp();
  return y;
}
// An int through the float exchange buffer, bit for bit: from lane src (own lane if out of range).
inline int emu_shfl_int(int x, int src) {
  const int t = emu::cur, base = t & ~31;
  memcpy(&emu::shfl[t], &x, 4);
  __syncwarp();
  int y;
  memcpy(&y, &emu::shfl[base + (src >= 0 && src < 32 ? src : (t & 31))], 4);
  __syncwarp();
  return y;
}
inline int __shfl_up_sync(unsigned, int x, int d) {
  const int lane = emu::cur & 31;
  return emu_shfl_int(x, lane >= d ? lane - d : lane);
}
inline int __shfl_sync(unsigned, int x, int src) { return emu_shfl_int(x, src); }
inline unsigned __ballot_sync(unsigned, int pred) {
  const int t = emu::cur, base = t & ~31;
  emu::shfl[t] = pred ? 1.f : 0.f;
  __syncwarp();
  unsigned m = 0;
  for (int l = base; l < std::min<int>(base + 32, (int)emu::block_dim.x); ++l) m |= (emu::shfl[l] != 0.f ? 1u : 0u) << (l - base);
  __syncwarp();
  return m;
}
inline int __any_sync(unsigned, int pred) {
  const int t = emu::cur, base = t & ~31;
  emu::shfl[t] = pred ? 1.f : 0.f;
  __syncwarp();
  int any = 0;
  for (int l = base; l < std::min<int>(base + 32, (int)emu::block_dim.x); ++l) any |= emu::shfl[l] != 0.f;
  __syncwarp();
  return any;
}
template <class T> inline T __ldg(const T* p) { return *p; }
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  unsigned long long v = (unsigned long long)y << 32 | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i);
  return r;
}
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
