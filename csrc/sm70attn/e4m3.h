// E4M3FN <-> FP16/FP32 by bit manipulation (SM70 has no FP8 instructions; cuda_fp8.hpp would
// emulate per element). E4M3FN: sign, 4 exponent bits (bias 7), 3 mantissa bits, no
// infinities, 0x7F/0xFF NaN, max 448, subnormals m * 2^-9.
#pragma once

namespace sm70attn {

// Four e4m3 bytes x = [b3 b2 b1 b0] (b0 lowest) to four fp16 holding value * 2^-8, in the order
// b0, b2, b1, b3: D is permuted within each group of 4 (a permutation that is its own inverse;
// the kernel permutes Q the same way and un-permutes O). fp16 bits = (b & 0x80) << 8 |
// (b & 0x7F) << 7: the e4m3 exponent field lands in the fp16 exponent with bias 15 - 7 = 8 too
// few, i.e. every value is scaled by 2^-8 exactly (the e4m3 subnormals m * 2^-9 become the fp16
// subnormals m * 2^-17). Callers fold 2^8 into their scales. Every byte decodes to a finite
// fp16; the NaN code 0x7F maps to 1.875 (480 after the fold): NaN stored in the cache is not
// propagated. The odd bytes sit where a 1-bit shift puts them, the even ones after 8 more bits:
// 7 instructions, no byte permutes.
// lo = fp16 pair (b0, b2), hi = (b1, b3), low half first.
__device__ __forceinline__ void e4m3x4_to_half4(unsigned x, unsigned& lo, unsigned& hi) {
  hi = (x & 0x80008000u) | ((x >> 1) & 0x3F803F80u);
  const unsigned y = x << 8;
  lo = (y & 0x80008000u) | ((y >> 1) & 0x3F803F80u);
}

// RNE float -> e4m3 after saturation to +-448, bit-equal to torch's
// `f.clamp(-448, 448).to(torch.float8_e4m3fn)` (same algorithm as c10 fp8e4m3fn_from_fp32_value).
// nan_sign: 0x80 or 0, the sign written for a NaN (taken from the fp16 input: the GPU's division
// returns a canonical NaN, the CPU keeps the operand's sign).
__device__ __forceinline__ unsigned e4m3_from_float(float f, unsigned nan_sign) {
  if (f != f) return 0x7Fu | nan_sign;
  f = fminf(fmaxf(f, -448.0f), 448.0f);
  unsigned bits = __float_as_uint(f);
  const unsigned sign = (bits >> 24) & 0x80u;
  bits &= 0x7FFFFFFFu;
  unsigned r;
  if (bits < (121u << 23)) {
    // Below 2^-6 (smallest normal): adding 2^14 rounds to a multiple of 2^-9 (the e4m3
    // subnormal step) with the FPU's round-to-nearest-even; the low bits are the code.
    r = __float_as_uint(__fadd_rn(__uint_as_float(bits), __uint_as_float(141u << 23))) - (141u << 23);
  } else {
    // Rebias the exponent (127 -> 7) and round the 20 dropped mantissa bits to nearest even.
    r = (bits - (120u << 23) + 0x7FFFFu + ((bits >> 20) & 1u)) >> 20;
  }
  return r | sign;
}

}  // namespace sm70attn
