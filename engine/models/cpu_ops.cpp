// Fused element-wise steps of the decoder for the CPU, float32: RMSNorm (with the residual add
// before it), RoPE with the KV-cache write, SiLU-and-multiply.
//
// Built at first use by engine/attention/native.py and called through engine/models/cpu_ops.py.
// Each replaces several torch ops (and their passes over memory) by one pass; on few rows (decode
// steps) it runs on the calling thread, on many it spreads rows over torch's OpenMP threads.

#include <cmath>
#include <cstdint>

#include "vec8.h"

using namespace tiergate;  // NOLINT: the shared vector helpers

namespace {

// Rows of work below which a call stays on one thread (a parallel region costs more).
constexpr int64_t kParallelElements = 1 << 16;

}  // namespace

extern "C" {

// out[t] = weight * x[t] / sqrt(mean(x[t]^2) + eps) over rows of dim floats (dim % 8 == 0).
// With residual: residual[t] += x[t] first, and the sum is what gets normalised.
void tiergate_rms_norm_f32(const float* x, float* residual, const float* weight, float eps,
                           int64_t num_rows, int64_t dim, float* out) {
#pragma omp parallel for if (num_rows * dim >= kParallelElements)
  for (int64_t t = 0; t < num_rows; ++t) {
    const float* in = x + t * dim;
    if (residual != nullptr) {
      float* res = residual + t * dim;
      for (int64_t c = 0; c < dim; c += 8) store8(res + c, load8(res + c) + load8(in + c));
      in = res;
    }
    vec8 squares = {};
    for (int64_t c = 0; c < dim; c += 8) squares += load8(in + c) * load8(in + c);
    const float inverse_rms = 1.0f / std::sqrt(sum8(squares) / static_cast<float>(dim) + eps);
    for (int64_t c = 0; c < dim; c += 8) {
      store8(out + t * dim + c, load8(weight + c) * (load8(in + c) * inverse_rms));
    }
  }
}

// Rotates the q and k heads of each qkv row in place ("rotate half" RoPE with the rows of
// cos_table/sin_table at the token's position; sin_table's first half is negated), then writes
// the rotated k and the v of each token into its cache slot (slot -1: no write).
// qkv rows: [q: num_heads * D | k: num_kv_heads * D | v: num_kv_heads * D], D % 16 == 0.
void tiergate_rope_write_kv_f32(float* qkv, int64_t qkv_row_stride, int64_t num_tokens,
                                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                const int64_t* positions, const float* cos_table,
                                const float* sin_table, const int64_t* slot_mapping,
                                float* k_cache, float* v_cache) {
  const int64_t half = head_dim / 2, kv_size = num_kv_heads * head_dim;
  const int64_t rotated_heads = num_heads + num_kv_heads;
#pragma omp parallel for if (num_tokens * qkv_row_stride >= kParallelElements)
  for (int64_t t = 0; t < num_tokens; ++t) {
    float* row = qkv + t * qkv_row_stride;
    const float* cos = cos_table + positions[t] * head_dim;
    const float* sin = sin_table + positions[t] * head_dim;
    for (int64_t h = 0; h < rotated_heads; ++h) {
      float* x = row + h * head_dim;
      for (int64_t c = 0; c < half; c += 8) {
        const vec8 x1 = load8(x + c), x2 = load8(x + half + c);
        store8(x + c, x1 * load8(cos + c) + x2 * load8(sin + c));
        store8(x + half + c, x2 * load8(cos + half + c) + x1 * load8(sin + half + c));
      }
    }
    const int64_t slot = slot_mapping[t];
    if (slot < 0) continue;
    const float* k = row + num_heads * head_dim;
    for (int64_t c = 0; c < kv_size; c += 8) {
      store8(k_cache + slot * kv_size + c, load8(k + c));
      store8(v_cache + slot * kv_size + c, load8(k + kv_size + c));
    }
  }
}

// out[t, i] = silu(gate_up[t, i]) * gate_up[t, dim + i] for rows of 2 * dim floats (dim % 8 == 0).
void tiergate_silu_and_mul_f32(const float* gate_up, int64_t num_rows, int64_t dim, float* out) {
#pragma omp parallel for if (num_rows * dim >= kParallelElements)
  for (int64_t t = 0; t < num_rows; ++t) {
    const float* gate = gate_up + t * 2 * dim;
    for (int64_t c = 0; c < dim; c += 8) {
      const vec8 g = load8(gate + c);
      store8(out + t * dim + c, g / (1.0f + exp8(vec8{} - g)) * load8(gate + dim + c));
    }
  }
}

}  // extern "C"
