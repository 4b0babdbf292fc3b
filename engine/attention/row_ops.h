// One row of the decoder's element-wise steps, float32: RMSNorm (with the residual add before
// it), RoPE, the KV-cache write, SiLU-and-multiply. Shared by the fused ops
// (engine/models/cpu_ops.cpp, row loops over torch's threads) and the small-batch decode forward
// (engine/models/cpu_decode.cpp).

#pragma once

#include <cmath>
#include <cstdint>

#include "vec8.h"

namespace tiergate {

// out = weight * x / sqrt(mean(x^2) + eps) over dim floats (dim % 8 == 0). With residual:
// residual += x first, and the sum is what gets normalised.
inline void rms_norm_row(const float* x, float* residual, const float* weight, float eps,
                         int64_t dim, float* out) {
  const float* in = x;
  if (residual != nullptr) {
    for (int64_t c = 0; c < dim; c += 8) store8(residual + c, load8(residual + c) + load8(x + c));
    in = residual;
  }
  vec8 squares = {};
  for (int64_t c = 0; c < dim; c += 8) squares += load8(in + c) * load8(in + c);
  const float inverse_rms = 1.0f / std::sqrt(sum8(squares) / static_cast<float>(dim) + eps);
  for (int64_t c = 0; c < dim; c += 8) {
    store8(out + c, load8(weight + c) * (load8(in + c) * inverse_rms));
  }
}

// Rotates num_heads heads of head_dim floats in place ("rotate half" RoPE with a position's rows
// of the cos and sin tables; the sin row's first half is negated). head_dim % 16 == 0.
inline void rope_heads(float* heads, int64_t num_heads, int64_t head_dim, const float* cos,
                       const float* sin) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < num_heads; ++h) {
    float* x = heads + h * head_dim;
    for (int64_t c = 0; c < half; c += 8) {
      const vec8 x1 = load8(x + c), x2 = load8(x + half + c);
      store8(x + c, x1 * load8(cos + c) + x2 * load8(sin + c));
      store8(x + half + c, x2 * load8(cos + half + c) + x1 * load8(sin + half + c));
    }
  }
}

// Writes one token's k and v (kv_size floats each, kv_size % 8 == 0) into cache slot `slot`.
inline void write_kv_slot(const float* k, const float* v, int64_t slot, int64_t kv_size,
                          float* k_cache, float* v_cache) {
  for (int64_t c = 0; c < kv_size; c += 8) {
    store8(k_cache + slot * kv_size + c, load8(k + c));
    store8(v_cache + slot * kv_size + c, load8(v + c));
  }
}

// out[i] = silu(gate[i]) * up[i] over dim floats (dim % 8 == 0).
inline void silu_and_mul_row(const float* gate, const float* up, int64_t dim, float* out) {
  for (int64_t c = 0; c < dim; c += 8) {
    const vec8 g = load8(gate + c);
    store8(out + c, g / (1.0f + exp8(vec8{} - g)) * load8(up + c));
  }
}

}  // namespace tiergate
