#pragma once
#include "emu_runtime.h"
struct __half { unsigned short x; };
inline __half __float2half_rn(float f) { _Float16 h = (_Float16)f; __half r; memcpy(&r.x, &h, 2); return r; }
// By a table of the 65536 conversions: libgcc's _Float16 -> float call took up to a third of the run.
inline const std::vector<float> half_to_float = [] {
  std::vector<float> t(1 << 16);
  for (unsigned u = 0; u < t.size(); ++u) {
    const unsigned short x = (unsigned short)u;
    _Float16 v;
    memcpy(&v, &x, 2);
    t[u] = (float)v;
  }
  return t;
}();
inline float __half2float(__half h) { return half_to_float[h.x]; }
inline __half __ushort_as_half(unsigned short u) { return __half{u}; }
inline unsigned short __half_as_ushort(__half h) { return h.x; }
