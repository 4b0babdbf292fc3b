// 8-float vectors and the helpers the engine's C++ CPU kernels share (the attention kernel,
// the row ops, the decode forward). engine/attention/cpp_build.py builds every kernel with this
// directory on the include path and keys its cache on this file too.

#pragma once

#include <cstdint>

namespace tiergate {

// 8 floats in whatever registers the target has (two SSE or one AVX register); unaligned and
// allowed to alias float memory, so loads and stores are plain dereferences.
typedef float vec8 __attribute__((vector_size(32), aligned(4), may_alias));
typedef int32_t ivec8 __attribute__((vector_size(32), aligned(4), may_alias));

inline vec8 load8(const float* p) { return *reinterpret_cast<const vec8*>(p); }
inline void store8(float* p, vec8 v) { *reinterpret_cast<vec8*>(p) = v; }

inline float sum8(vec8 v) {
  float sum = 0.0f;
  for (int i = 0; i < 8; ++i) sum += v[i];
  return sum;
}

// exp(x) on [-87, 88] (inputs outside are clamped): 2^k * e^r with k = round(x / ln2),
// |r| <= ln2/2, and a degree-7 Taylor polynomial (its truncation error is below float
// rounding). Inputs under -87 give ~1e-38 instead of smaller values; a caller that needs
// exact zeros sets them itself.
inline vec8 exp8(vec8 x) {
  const vec8 lo = vec8{} - 87.0f, hi = vec8{} + 88.0f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const float round_magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const vec8 k = (x * 1.44269504088896341f + round_magic) - round_magic;
  const vec8 r = (x - k * 0.693145751953125f) - k * 1.42860682030941723e-6f;
  vec8 p = r * (1.0f / 5040.0f) + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const ivec8 exponent = (__builtin_convertvector(k, ivec8) + 127) << 23;
  return p * reinterpret_cast<const vec8&>(exponent);
}

}  // namespace tiergate
