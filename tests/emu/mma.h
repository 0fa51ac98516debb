// WMMA mock: every lane holds the whole 16x16 tile (element (i, j) at x[16 i + j]); the math of
// a warp-wide mma is done once per warp and shared (inputs compared lane by lane).
#pragma once
#include "cuda_fp16.h"
namespace nvcuda { namespace wmma {
struct row_major {}; struct col_major {}; struct matrix_a {}; struct matrix_b {}; struct accumulator {};
enum layout_t { mem_row_major, mem_col_major };
template <class Use, int M, int N, int K, class T, class L = void>
struct fragment { enum { num_elements = 256 }; T x[256]; };
template <class Use, class T, class L>
inline void load_matrix_sync(fragment<Use, 16, 16, 16, T, L>& f, const T* p, unsigned ldm) {
  for (int i = 0; i < 16; ++i) for (int j = 0; j < 16; ++j)
    f.x[16 * i + j] = std::is_same<L, row_major>::value ? p[i * ldm + j] : p[i + j * ldm];
}
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p, unsigned ldm, layout_t l) {
  for (int i = 0; i < 16; ++i) for (int j = 0; j < 16; ++j)
    f.x[16 * i + j] = l == mem_row_major ? p[i * ldm + j] : p[i + j * ldm];
}
inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ldm, layout_t l) {
  for (int i = 0; i < 16; ++i) for (int j = 0; j < 16; ++j)
    (l == mem_row_major ? p[i * ldm + j] : p[i + j * ldm]) = f.x[16 * i + j];
}
template <class F, class T> inline void fill_fragment(F& f, T v) { for (auto& e : f.x) e = v; }
}}  // namespace nvcuda::wmma

namespace emu {
struct MmaEntry { float a[256], b[256], c[256], d[256]; int uses; };
inline std::map<std::pair<int, long long>, MmaEntry> mma_cache;  // (warp, call #) -> entry
inline std::vector<long long> mma_count;
inline void reset_mma_cache() { mma_cache.clear(); mma_count.assign(1024, 0); }
}
namespace nvcuda { namespace wmma {
template <class LA, class LB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const fragment<matrix_a, 16, 16, 16, __half, LA>& a,
                     const fragment<matrix_b, 16, 16, 16, __half, LB>& b, const fragment<accumulator, 16, 16, 16, float>& c) {
  const int t = emu::cur, warp = t / 32, lanes = std::min<int>(32, (int)emu::block_dim.x - warp * 32);
  float fa[256], fb[256];
  for (int i = 0; i < 256; ++i) fa[i] = __half2float(a.x[i]), fb[i] = __half2float(b.x[i]);
  auto key = std::make_pair(warp, emu::mma_count[t]++);
  ++emu::mma_calls;
  auto it = emu::mma_cache.find(key);
  if (it != emu::mma_cache.end()) {
    emu::MmaEntry& e = it->second;
    if (memcmp(e.a, fa, sizeof fa) || memcmp(e.b, fb, sizeof fb) || memcmp(e.c, c.x, sizeof fa)) {
      fprintf(stderr, "WMMA inputs differ between lanes of warp %d\n", warp);
      abort();
    }
    memcpy(d.x, e.d, sizeof fa);
    if (++e.uses == lanes) emu::mma_cache.erase(it);
    return;
  }
  ++emu::mma_computed;
  emu::MmaEntry& e = emu::mma_cache[key];
  memcpy(e.a, fa, sizeof fa), memcpy(e.b, fb, sizeof fb), memcpy(e.c, c.x, sizeof fa);
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) {
      float s = e.c[16 * i + j];
      for (int k = 0; k < 16; ++k) s += fa[16 * i + k] * fb[16 * k + j];
      e.d[16 * i + j] = s;
    }
  memcpy(d.x, e.d, sizeof fa);
  e.uses = 1;
  if (lanes == 1) emu::mma_cache.erase(key);
}
}}
