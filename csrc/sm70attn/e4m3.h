// E4M3FN <-> FP16/FP32 by bit manipulation (SM70 has no FP8 instructions; cuda_fp8.hpp would
// emulate per element). E4M3FN: sign, 4 exponent bits (bias 7), 3 mantissa bits, no
// infinities, 0x7F/0xFF NaN, max 448, subnormals m * 2^-9.
#pragma once

namespace sm70attn {

// Four e4m3 bytes (element i in byte i of x) to four fp16 holding value * 2^-8:
// fp16 bits = (b & 0x80) << 8 | (b & 0x7F) << 7. The e4m3 exponent field lands in the fp16
// exponent with bias 15 - 7 = 8 too few, i.e. every value is scaled by 2^-8 exactly; e4m3
// subnormals become fp16 normals. Callers fold 2^8 into their scales. The NaN code 0x7F maps
// to the finite 1.875 (480 after the fold): NaN stored in the cache is not propagated.
// lo holds elements 0, 1; hi elements 2, 3 (fp16 pairs, low half first).
__device__ __forceinline__ void e4m3x4_to_half4(unsigned x, unsigned& lo, unsigned& hi) {
  const unsigned a = __byte_perm(x, 0u, 0x1404);  // b1 << 24 | b0 << 8
  const unsigned b = __byte_perm(x, 0u, 0x3424);  // b3 << 24 | b2 << 8
  lo = (a & 0x80008000u) | ((a >> 1) & 0x3F803F80u);
  hi = (b & 0x80008000u) | ((b >> 1) & 0x3F803F80u);
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
