// Register-fragment MMA atoms (PTX mma.sync, fp16 inputs, fp32 accumulators) and the matrix
// element each lane's register holds, from the PTX ISA's "Matrix fragments for mma.m8n8k4 with
// .f16 floating point type" and "... for mma.m16n8k16 with floating point type":
//   M8N8K4   (SM70's shape): the warp's four quad-pairs (lanes 4q..4q+3 and 4q+16..4q+19) each
//            compute their own D[8x8] = A[8x4] B[4x8] + C; a lane holds one row of A, one
//            column of B and 8 of D's elements.
//            MmaM8N8K4RowRow takes B row-major (.row.row): a lane holds one row of B instead,
//            which is how the register-fragment kernel reads V ([token][d] in shared memory).
//   M16N8K16 (SM80+): one D[16x8] = A[16x16] B[16x8] + C per warp; a lane holds 8 of A, 4 of B
//            and 4 of D's elements.
// Element i of a lane's fragment is at (X_row(lane, i), X_col(lane, i)) of its quad-pair's
// (M8N8K4) or the warp's (M16N8K16) matrix. tests/test_cuda.py checks these maps against a GPU
// (newer GPUs run m8n8k4 as ptxas emulates it) and tests/emu/ runs the atoms by them on the CPU.
// A kernel that keeps its fragments in registers needs nothing else from the atom, so everything
// above it can be shared between the two shapes: paged_attention_rf.cuh is that kernel.
#pragma once

#include "sm70attn/utils.h"

namespace sm70attn {

struct MmaM8N8K4 {
  static constexpr int A = 4, B = 4, C = 8;  // fp16, fp16 and fp32 elements per lane
  static constexpr int M = 8, N = 8, K = 4, GROUPS = 4;  // GROUPS products per warp (quad-pairs)
  __host__ __device__ static constexpr int group(int lane) { return lane % 16 / 4; }
  __host__ __device__ static constexpr int half(int lane) { return lane / 16; }  // rows 0-3 or 4-7
  __host__ __device__ static constexpr int a_row(int lane, int) { return lane % 4 + 4 * half(lane); }
  __host__ __device__ static constexpr int a_col(int, int i) { return i; }
  __host__ __device__ static constexpr int b_row(int, int i) { return i; }
  __host__ __device__ static constexpr int b_col(int lane, int) { return lane % 4 + 4 * half(lane); }
  __host__ __device__ static constexpr int c_row(int lane, int i) { return (lane & 1) + (i & 2) + 4 * half(lane); }
  __host__ __device__ static constexpr int c_col(int lane, int i) { return (i & 4) + (lane & 2) + (i & 1); }
};

struct MmaM8N8K4RowRow : MmaM8N8K4 {
  __host__ __device__ static constexpr int b_row(int lane, int) { return lane % 4; }
  __host__ __device__ static constexpr int b_col(int lane, int i) { return i + 4 * half(lane); }
};

struct MmaM16N8K16 {
  static constexpr int A = 8, B = 4, C = 4;
  static constexpr int M = 16, N = 8, K = 16, GROUPS = 1;
  __host__ __device__ static constexpr int group(int) { return 0; }
  __host__ __device__ static constexpr int a_row(int lane, int i) { return lane / 4 + 8 * (i / 2 % 2); }
  __host__ __device__ static constexpr int a_col(int lane, int i) { return lane % 4 * 2 + i % 2 + 8 * (i / 4); }
  __host__ __device__ static constexpr int b_row(int lane, int i) { return lane % 4 * 2 + i % 2 + 8 * (i / 2); }
  __host__ __device__ static constexpr int b_col(int lane, int) { return lane / 4; }
  __host__ __device__ static constexpr int c_row(int lane, int i) { return lane / 4 + 8 * (i / 2); }
  __host__ __device__ static constexpr int c_col(int lane, int i) { return lane % 4 * 2 + i % 2; }
};

// Elements 2j and 2j + 1 of a fragment in one register (2j in the low half), as mma_atom takes them.
__device__ __forceinline__ unsigned pack_halves(__half lo, __half hi) {
  return (unsigned)__half_as_ushort(lo) | (unsigned)__half_as_ushort(hi) << 16;
}

#if defined(__CUDACC__)
// d = a b + c on the fragments above (CPU builds: tests/emu/emu_atoms.h, by the same maps).
__device__ __forceinline__ void mma_atom(MmaM8N8K4, float (&d)[8], const unsigned (&a)[2],
                                         const unsigned (&b)[2], const float (&c)[8]) {
  asm volatile(
      "mma.sync.aligned.m8n8k4.row.col.f32.f16.f16.f32 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%11}, {%12,%13,%14,%15,%16,%17,%18,%19};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]),
        "f"(c[4]), "f"(c[5]), "f"(c[6]), "f"(c[7]));
}

__device__ __forceinline__ void mma_atom(MmaM8N8K4RowRow, float (&d)[8], const unsigned (&a)[2],
                                         const unsigned (&b)[2], const float (&c)[8]) {
  asm volatile(
      "mma.sync.aligned.m8n8k4.row.row.f32.f16.f16.f32 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%11}, {%12,%13,%14,%15,%16,%17,%18,%19};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]),
        "f"(c[4]), "f"(c[5]), "f"(c[6]), "f"(c[7]));
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
__device__ __forceinline__ void mma_atom(MmaM16N8K16, float (&d)[4], const unsigned (&a)[4],
                                         const unsigned (&b)[2], const float (&c)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%11,%12,%13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),
        "f"(c[2]), "f"(c[3]));
}

// Four 8x8 fp16 matrices from shared memory, transposed (ldmatrix .x4 .trans, SM75+): lane l
// gives the address of row l % 8 of matrix l / 8 (16 bytes, 16-byte aligned) and gets
// r[j] = (M_j[2 (l % 4)][l / 4], M_j[2 (l % 4) + 1][l / 4]): an m16n8k16 B fragment of a
// row-major [k][n] matrix, two per ldmatrix.
__device__ __forceinline__ void ldsm_x4_trans(unsigned (&r)[4], const __half* row) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(row);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// Four 8x8 fp16 matrices from shared memory (ldmatrix .x4, SM75+): lane l gives the address of
// row l % 8 of matrix l / 8 and gets r[j] = (M_j[l / 4][2 (l % 4)], M_j[l / 4][2 (l % 4) + 1]):
// an m16n8k16 A fragment of a row-major [m][k] tile, or two B fragments of a [n][k] one.
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const __half* row) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(row);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
#else
// No m16n8k16 before SM80 (the SM70 gate refuses its PTX): callers check the arch first
// (mma_atom_check in the binding does); reaching this traps.
__device__ __forceinline__ void mma_atom(MmaM16N8K16, float (&d)[4], const unsigned (&)[4], const unsigned (&)[2],
                                         const float (&)[4]) {
  for (float& x : d) x = 0.f;
  __trap();
}
__device__ __forceinline__ void ldsm_x4_trans(unsigned (&r)[4], const __half*) {
  for (unsigned& x : r) x = 0u;
  __trap();
}
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const __half*) {
  for (unsigned& x : r) x = 0u;
  __trap();
}
#endif
#endif

}  // namespace sm70attn
