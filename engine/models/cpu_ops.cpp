// Fused element-wise steps of the decoder for the CPU, float32: RMSNorm (with the residual add
// before it), RoPE with the KV-cache write, SiLU-and-multiply.
//
// Built at first use by engine/attention/cpp_build.py and called through engine/models/cpu_ops.py.
// Each replaces several torch ops (and their passes over memory) by one pass; on few rows (decode
// steps) it runs on the calling thread, on many it spreads rows over torch's OpenMP threads.

#include <cstdint>

#include "row_ops.h"

using namespace tiergate;  // NOLINT: the shared row helpers

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
    rms_norm_row(x + t * dim, residual == nullptr ? nullptr : residual + t * dim, weight, eps,
                 dim, out + t * dim);
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
  const int64_t kv_size = num_kv_heads * head_dim;
#pragma omp parallel for if (num_tokens * qkv_row_stride >= kParallelElements)
  for (int64_t t = 0; t < num_tokens; ++t) {
    float* row = qkv + t * qkv_row_stride;
    rope_heads(row, num_heads + num_kv_heads, head_dim, cos_table + positions[t] * head_dim,
               sin_table + positions[t] * head_dim);
    if (slot_mapping[t] < 0) continue;
    const float* k = row + num_heads * head_dim;
    write_kv_slot(k, k + kv_size, slot_mapping[t], kv_size, k_cache, v_cache);
  }
}

// out[t, i] = silu(gate_up[t, i]) * gate_up[t, dim + i] for rows of 2 * dim floats (dim % 8 == 0).
void tiergate_silu_and_mul_f32(const float* gate_up, int64_t num_rows, int64_t dim, float* out) {
#pragma omp parallel for if (num_rows * dim >= kParallelElements)
  for (int64_t t = 0; t < num_rows; ++t) {
    const float* gate = gate_up + t * 2 * dim;
    silu_and_mul_row(gate, gate + dim, dim, out + t * dim);
  }
}

}  // extern "C"
