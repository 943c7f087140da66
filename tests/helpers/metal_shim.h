// The part of the Metal language the dflash kernel bodies use, for running them on the CPU.
// Only what the bodies need is defined: a body that uses threadgroup memory, barriers or
// SIMD-group functions fails to compile here instead of being emulated wrongly.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

// Address-space qualifiers have no meaning in one flat CPU address space.
#define device
#define constant
#define thread

typedef unsigned int uint;

struct uint3 {
  uint x, y, z;
};

// Real 16-bit storage, so buffers are bit-identical to the arrays MLX hands to Metal and
// every cast to the output type rounds exactly as on the GPU (round to nearest even).
typedef _Float16 float16_t;
typedef _Float16 half;

struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = uint16_t((u >> 16) | 0x40u);  // quiet NaN
    } else {
      u += 0x7fffu + ((u >> 16) & 1u);
      bits = uint16_t(u >> 16);
    }
  }
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
  }
};
static_assert(sizeof(bfloat16_t) == 2, "bfloat16_t must be 2 bytes");

namespace metal {
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline float sqrt(float x) { return std::sqrt(x); }
inline float cos(float x) { return std::cos(x); }
inline float sin(float x) { return std::sin(x); }
inline float exp(float x) { return std::exp(x); }
inline float abs(float x) { return std::fabs(x); }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }
namespace precise {
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline float sqrt(float x) { return std::sqrt(x); }
inline float cos(float x) { return std::cos(x); }
inline float sin(float x) { return std::sin(x); }
}  // namespace precise
}  // namespace metal
