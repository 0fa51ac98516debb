#pragma once
#include "emu_runtime.h"
struct __half { unsigned short x; };
inline __half __float2half_rn(float f) { _Float16 h = (_Float16)f; __half r; memcpy(&r.x, &h, 2); return r; }
inline float __half2float(__half h) { _Float16 v; memcpy(&v, &h.x, 2); return (float)v; }
inline __half __ushort_as_half(unsigned short u) { return __half{u}; }
inline unsigned short __half_as_ushort(__half h) { return h.x; }
