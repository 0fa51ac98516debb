// mma_atom (csrc/sm70attn/mma_atoms.h) on the CPU: the lanes of a warp meet at a warp barrier
// with their fragments, each rebuilds its group's A, B and C from every lane's registers by the
// atom's element maps and computes its own D elements (fp32 sums in k order), then the warp
// meets again before the staging is reused. A map that is not a bijection onto the matrix
// aborts. The hardware check of the maps is tests/test_cuda.py's.
#pragma once
#include "cuda_fp16.h"
#include "sm70attn/mma_atoms.h"

namespace emu {
struct AtomStage { float a[8], b[4], c[8]; };
inline std::vector<AtomStage> atom_stage;
inline std::vector<const __half*> ldsm_rows;
}

namespace sm70attn {
template <class At>
inline void emu_mma_atom(float* d, const unsigned* a, const unsigned* b, const float* c) {
  const int t = emu::cur, lane = t & 31, base = t - lane;
  if ((int)emu::block_dim.x < base + 32) { fprintf(stderr, "mma_atom: needs a whole warp\n"); abort(); }
  if ((int)emu::atom_stage.size() < (int)emu::block_dim.x) emu::atom_stage.resize(emu::block_dim.x);
  emu::AtomStage& mine = emu::atom_stage[t];
  for (int i = 0; i < At::A; ++i) mine.a[i] = __half2float(__ushort_as_half((unsigned short)(a[i / 2] >> (16 * (i % 2)))));
  for (int i = 0; i < At::B; ++i) mine.b[i] = __half2float(__ushort_as_half((unsigned short)(b[i / 2] >> (16 * (i % 2)))));
  for (int i = 0; i < At::C; ++i) mine.c[i] = c[i];
  __syncwarp();
  const int g = At::group(lane);
  float A[At::M][At::K], B[At::K][At::N], C[At::M][At::N];
  bool hasA[At::M][At::K] = {}, hasB[At::K][At::N] = {}, hasC[At::M][At::N] = {};
  bool ok = true;
  auto put = [&](auto& m, auto& has, int r, int col, float v) { ok &= !has[r][col]; has[r][col] = true, m[r][col] = v; };
  for (int l = 0; l < 32; ++l) {
    if (At::group(l) != g) continue;
    const emu::AtomStage& s = emu::atom_stage[base + l];
    for (int i = 0; i < At::A; ++i) put(A, hasA, At::a_row(l, i), At::a_col(l, i), s.a[i]);
    for (int i = 0; i < At::B; ++i) put(B, hasB, At::b_row(l, i), At::b_col(l, i), s.b[i]);
    for (int i = 0; i < At::C; ++i) put(C, hasC, At::c_row(l, i), At::c_col(l, i), s.c[i]);
  }
  for (auto& r : hasA) for (bool h : r) ok &= h;
  for (auto& r : hasB) for (bool h : r) ok &= h;
  for (auto& r : hasC) for (bool h : r) ok &= h;
  if (!ok) {
    fprintf(stderr, "mma_atom: a fragment map is not a bijection onto its matrix\n");
    abort();
  }
  for (int i = 0; i < At::C; ++i) {
    const int r = At::c_row(lane, i), col = At::c_col(lane, i);
    float s = C[r][col];
    for (int k = 0; k < At::K; ++k) s += A[r][k] * B[k][col];
    d[i] = s;
  }
  __syncwarp();
}
inline void mma_atom(MmaM8N8K4, float (&d)[8], const unsigned (&a)[2], const unsigned (&b)[2], const float (&c)[8]) {
  emu_mma_atom<MmaM8N8K4>(d, a, b, c);
}
inline void mma_atom(MmaM8N8K4RowRow, float (&d)[8], const unsigned (&a)[2], const unsigned (&b)[2], const float (&c)[8]) {
  emu_mma_atom<MmaM8N8K4RowRow>(d, a, b, c);
}
// ldmatrix .x4 .trans: every lane of the warp passes a row address (lane l: row l % 8 of matrix
// l / 8, 16-byte aligned) and gets r[j] = (M_j[2 (l % 4)][l / 4], M_j[2 (l % 4) + 1][l / 4]).
inline void ldsm_x4_trans(unsigned (&r)[4], const __half* row) {
  const int t = emu::cur, lane = t & 31, base = t - lane;
  if ((int)emu::block_dim.x < base + 32) { fprintf(stderr, "ldsm_x4_trans: needs a whole warp\n"); abort(); }
  if (reinterpret_cast<uintptr_t>(row) % 16) { fprintf(stderr, "ldsm_x4_trans: row not 16-byte aligned\n"); abort(); }
  if ((int)emu::ldsm_rows.size() < (int)emu::block_dim.x) emu::ldsm_rows.resize(emu::block_dim.x);
  emu::ldsm_rows[t] = row;
  __syncwarp();
  auto el = [&](int j, int rr, int col) { return __half_as_ushort(emu::ldsm_rows[base + 8 * j + rr][col]); };
  for (int j = 0; j < 4; ++j)
    r[j] = (unsigned)el(j, 2 * (lane % 4), lane / 4) | (unsigned)el(j, 2 * (lane % 4) + 1, lane / 4) << 16;
  __syncwarp();
}
// ldmatrix .x4 (not transposed): lane l passes row l % 8 of matrix l / 8 and gets
// r[j] = (M_j[l / 4][2 (l % 4)], M_j[l / 4][2 (l % 4) + 1]).
inline void ldsm_x4(unsigned (&r)[4], const __half* row) {
  const int t = emu::cur, lane = t & 31, base = t - lane;
  if ((int)emu::block_dim.x < base + 32) { fprintf(stderr, "ldsm_x4: needs a whole warp\n"); abort(); }
  if (reinterpret_cast<uintptr_t>(row) % 16) { fprintf(stderr, "ldsm_x4: row not 16-byte aligned\n"); abort(); }
  if ((int)emu::ldsm_rows.size() < (int)emu::block_dim.x) emu::ldsm_rows.resize(emu::block_dim.x);
  emu::ldsm_rows[t] = row;
  __syncwarp();
  auto el = [&](int j, int rr, int col) { return __half_as_ushort(emu::ldsm_rows[base + 8 * j + rr][col]); };
  for (int j = 0; j < 4; ++j)
    r[j] = (unsigned)el(j, lane / 4, 2 * (lane % 4)) | (unsigned)el(j, lane / 4, 2 * (lane % 4) + 1) << 16;
  __syncwarp();
}
inline void mma_atom(MmaM16N8K16, float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2], const float (&c)[4]) {
  emu_mma_atom<MmaM16N8K16>(d, a, b, c);
}
}  // namespace sm70attn
