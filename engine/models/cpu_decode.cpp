// The whole forward of a decode step (one new token for each of up to max_rows sequences),
// float32, in one call and one OpenMP parallel region.
//
// A batch-1 decode step of a small model runs ~120 matrix products and ~100 element-wise ops of
// a few hundred floats each. Issued one by one from Python, each pays the interpreter, torch's
// dispatcher and a parallel region of its own, and pays them with cold caches: the products
// stream the weights through every cache level, evicting the interpreter's working set (a
// fused RMSNorm call right after a weight stream takes several times what it takes in a loop:
// ops/bench/journal.md, "The decode step as one C++ call"). Here the layers run back to back
// on the OpenMP threads, with barriers between the phases that need every thread's output.
//
// Weights are in panels: a matrix W [N, K] (out, in features) is stored as [N / 16][K][16], so a
// product walks each panel once, front to back, with one multiply-add of 16 outputs per input
// element and no horizontal sums; the gate and up projections interleave their panels
// (gate 0, up 0, gate 1, ...) so that a thread computes SiLU-and-multiply on the panels it just
// produced. engine/models/cpu_decode.py packs them and calls this.
//
// A matrix may instead be held quantized as GGUF stores it (engine/models/quantized/panels.py):
// the same panels of 16 outputs, cut along the inputs into blocks of 32, each block a scale
// (and, for 4 bits, a minimum) per output, in float16 as GGUF stores them (for K-quants, the
// super-block's float16 and the sub-block's 6-bit factor), and the 32 x 16 quantized values,
// k-major like the float panels. A product dequantizes each block in registers as it reads it
// (the values times the scale, plus the minimum) and multiplies as for float weights, so it
// reads 0.27 (8 bits) or 0.16-0.17 (4 bits) of the float32 bytes: about the blocks' own size.
// Products of more than 2 rows take their activations in int8 instead (see kInt8Rows).
//
// Rows may run on LoRA adapters (BGMV style, inside the products): for each product an adapter
// of the step targets, a shrink h[m] = A x[m] for the rows on such adapters (one more parallel
// loop and its barrier), then each thread adds B h[m] to its own share of the product's output
// panels right after computing them, before anything reads them (q/k norms and RoPE, the KV
// write, SiLU-and-multiply). A step with no row on an adapter passes no adapters and runs no
// more than without them. engine/models/cpu_decode_lora.py packs the adapters.
//
// Built at first use by engine/attention/cpp_build.py; no torch headers.

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "paged_attention.h"
#include "row_ops.h"
#include "vec8.h"

using namespace tiergate;  // NOLINT: the shared row and vector helpers

namespace {

constexpr int64_t kPanel = 16;  // outputs per weight panel
// A product keeps M rows x P panels of accumulators, P weight vectors and one broadcast input
// in registers, 16 floats each: one register with AVX-512 (32 of them), two without (16 of
// 8 floats). Past what the registers hold the accumulators spill to memory on every input
// element, several times slower (ops/bench/journal.md, "The engine in rooms"), so the rows
// and panels a product takes at once follow the register file.
#if defined(__AVX512F__)
constexpr int kVectors = 32;  // 16-float vectors the registers hold
constexpr int64_t kRowBlock = 8;  // rows one panel product takes at a time
#else
constexpr int kVectors = 8;
constexpr int64_t kRowBlock = 4;
#endif
// The products' lane vectors: kLanes of a panel's 16 outputs in one register, native to the
// target (16 with AVX-512, 8 with AVX2). GCC keeps 16-float vectors in memory where no
// register holds them, and moved the accumulators through the stack and general registers on
// every input: on AVX2 a one-row Q8_0 product took twice float32's time, and the float products
// were bound by those moves from 8 rows on (ops/bench/journal.md, "Products in lane
// registers"). The products take a panel in halves there.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float lvec __attribute__((vector_size(4 * kLanes)));
typedef int32_t ilvec __attribute__((vector_size(4 * kLanes)));
// kLanes floats at p (unaligned): one load (a memcpy into an lvec went through the stack).
typedef float unaligned_lvec __attribute__((vector_size(4 * kLanes), aligned(4), may_alias));
inline lvec load_lanes(const float* p) { return *reinterpret_cast<const unaligned_lvec*>(p); }
inline void store_lanes(float* p, lvec v) { *reinterpret_cast<unaligned_lvec*>(p) = v; }
// *p in every lane: one broadcast load (`lvec{} + *p` adds +0.0 first, an instruction more).
inline lvec splat(const float* p) {
#if defined(__AVX512F__)
  return (lvec)_mm512_set1_ps(*p);
#elif defined(__AVX__)
  return (lvec)_mm256_broadcast_ss(p);
#else
  return lvec{} + *p;
#endif
}

// Panels a product of M rows takes at once: one or two rows are bound by the weights' streams,
// and take 8 at once even where their accumulators spill; more rows take what the registers
// hold.
template <int M>
constexpr int panels_at_once() {
  if (M <= 2) return 8;
  if (kVectors >= 32) return M <= 4 ? 4 : 3;
  return std::max(1, (kVectors * 16 / kLanes - 1) / (M + 1));  // registers of kLanes floats
}
// Panel rows (64-byte lines) a product prefetches ahead in each panel it walks: the panels are
// separate streams, more than the hardware prefetchers follow well (ops/bench/journal.md, "The
// decode step as one C++ call").
constexpr int64_t kPrefetchRows = 16;

typedef float vec16 __attribute__((vector_size(64), aligned(4), may_alias));

// How a matrix's panels hold its weights (TiergateMatrix::format). Scales are float16, as
// GGUF stores them. The 4-, 5- and 6-bit formats keep a block's values as nibbles, q[16][16]
// whose low nibbles are inputs 0..15 of the block and high nibbles 16..31, and the 5- and
// 6-bit ones their high bits apart, 16 lanes to a 32-bit word.
enum WeightFormat : int64_t {
  kF32 = 0,  // float32, [N / 16][K][16]
  kQ8 = 1,   // per block of 32 inputs: scale[16], int8 q[32][16]; w = scale q
  kQ4 = 2,   // per block: scale[16], min[16], q; w = scale q + min
  kQ4K = 3,  // per block: d[16], dmin[16], uint8 sc[16], uint8 m[16], q;
             // w = (d sc) q - dmin m in float32 (the K-quants' super-block scale times a
             // sub-block's, which float16 does not hold exactly)
  kQ5 = 4,   // per block: scale[16], min[16], uint32 high[16], q; the fifth bit of input i
             // (of i + 16) of lane l is bit l (16 + l) of high[i]; w = scale q + min
  kQ5K = 5,  // per block: d, dmin, sc, m as kQ4K, high as kQ5, q; w as kQ4K
  kQ6K = 6,  // per block: d[16], int8 sc[2][16] (inputs 0..15, 16..31), uint32 high[32]
             // (bits 2 l and 2 l + 1 of high[k]: input k's bits 4 and 5 of lane l), q;
             // w = (d sc) q - 32 (d sc)
};
constexpr int64_t kQBlock = 32;  // inputs per quantized block

template <WeightFormat F>
constexpr int64_t high_offset() {  // where a block's high bits start, after its scales
  return F == kQ8 ? 2 * kPanel : (F == kQ4 || F == kQ5 || F == kQ6K) ? 4 * kPanel : 6 * kPanel;
}
template <WeightFormat F>
constexpr int64_t high_bytes() {  // 32-bit words of high bits: 16 lanes of one or two bits
  return F == kQ5 || F == kQ5K ? 4 * kQBlock / 2 : F == kQ6K ? 4 * kQBlock : 0;
}
template <WeightFormat F>
constexpr int64_t values_offset() {  // where a block's values start
  return high_offset<F>() + high_bytes<F>();
}
template <WeightFormat F>
constexpr int64_t block_bytes() {
  return values_offset<F>() + (F == kQ8 ? kQBlock : kQBlock / 2) * kPanel;
}
// One float16 (IEEE binary16) as float32, without F16C.
inline float half_to_float(uint16_t half) {
  const uint32_t sign = static_cast<uint32_t>(half & 0x8000) << 16;
  const uint32_t exponent = (half >> 10) & 0x1f, mantissa = half & 0x3ff;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000 | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else {  // zero or subnormal: mantissa * 2^-24
    float value = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    std::memcpy(&bits, &value, 4);
    bits |= sign;
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

inline float lane_half(const uint8_t* p, int64_t lane) {
  uint16_t half;
  std::memcpy(&half, p + 2 * lane, 2);
  return half_to_float(half);
}

inline uint32_t load_word(const uint8_t* p) {
  uint32_t word;
  std::memcpy(&word, p, 4);
  return word;
}

// One output lane's scale and minimum of a block's half (inputs 0..15 or 16..31).
template <WeightFormat F>
inline float lane_scale(const uint8_t* block, int64_t lane, int half) {
  const float first = lane_half(block, lane);
  if constexpr (F == kQ4K || F == kQ5K) {
    return first * static_cast<float>(block[4 * kPanel + lane]);
  } else if constexpr (F == kQ6K) {
    return first * static_cast<float>(static_cast<int8_t>(block[(2 + half) * kPanel + lane]));
  } else {
    return first;
  }
}
template <WeightFormat F>
inline float lane_min(const uint8_t* block, int64_t lane, float scale) {
  if constexpr (F == kQ6K) return -32.0f * scale;
  const float first = lane_half(block + 2 * kPanel, lane);
  return F == kQ4K || F == kQ5K ? -(first * static_cast<float>(block[5 * kPanel + lane]))
                                : first;
}

// The unsigned value of input k (0..31) of one lane of a 4- to 6-bit block.
template <WeightFormat F>
inline int32_t lane_value(const uint8_t* block, int64_t k, int64_t lane) {
  const int64_t i = k % (kQBlock / 2), half = k / (kQBlock / 2);
  const uint8_t q = block[values_offset<F>() + i * kPanel + lane];
  int32_t value = half == 0 ? q & 15 : q >> 4;
  if constexpr (F == kQ5 || F == kQ5K) {
    value |= static_cast<int32_t>((load_word(block + high_offset<F>() + 4 * i) >>
                                   (lane + 16 * half)) & 1) << 4;
  } else if constexpr (F == kQ6K) {
    value |= static_cast<int32_t>((load_word(block + high_offset<F>() + 4 * k) >> (2 * lane)) &
                                  3) << 4;
  }
  return value;
}

// kLanes bytes at p widened to int32s, signed or not.
template <bool Signed>
inline ilvec widen_lanes(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (ilvec)(Signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes));
#elif defined(__AVX2__)
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return (ilvec)(Signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
#else
  ilvec out;
  for (int i = 0; i < kLanes; ++i) out[i] = Signed ? static_cast<int8_t>(p[i]) : p[i];
  return out;
#endif
}

// kLanes float16 at p as float32.
inline lvec load_half_lanes(const uint8_t* p) {
#if defined(__AVX512F__)
  return (lvec)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  return (lvec)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  lvec out;
  for (int i = 0; i < kLanes; ++i) out[i] = lane_half(p, i);
  return out;
#endif
}

inline ilvec broadcast_lanes(const uint8_t* p) {
  return ilvec{} + static_cast<int32_t>(load_word(p));
}

// A block's scales (w = scale q + min) for its inputs 0..15 (half 0) or 16..31 (half 1),
// the same for both halves but in kQ6K; its minimums (w at q = 0), its scales given; and the
// unsigned values of its inputs i (lo) and i + 16 (hi): lanes [lane, lane + kLanes) of the
// panel's 16. GCC's vector widening from bytes is scalar code (16 conversions one at a time),
// hence the intrinsics.
template <WeightFormat F>
inline lvec lane_scales(const uint8_t* block, int half, int64_t lane) {
  if constexpr (F == kQ4K || F == kQ5K) {
    return load_half_lanes(block + 2 * lane) *
           __builtin_convertvector(widen_lanes<false>(block + 4 * kPanel + lane), lvec);
  } else if constexpr (F == kQ6K) {
    return load_half_lanes(block + 2 * lane) *
           __builtin_convertvector(widen_lanes<true>(block + (2 + half) * kPanel + lane), lvec);
  } else {
    return load_half_lanes(block + 2 * lane);
  }
}
template <WeightFormat F>
inline lvec lane_mins(const uint8_t* block, lvec scale, int64_t lane) {
  if constexpr (F == kQ4K || F == kQ5K) {
    return -(load_half_lanes(block + 2 * kPanel + 2 * lane) *
             __builtin_convertvector(widen_lanes<false>(block + 5 * kPanel + lane), lvec));
  } else if constexpr (F == kQ6K) {
    return scale * -32.0f;
  } else {
    return load_half_lanes(block + 2 * kPanel + 2 * lane);
  }
}
template <WeightFormat F>
inline void lane_values(const uint8_t* block, int64_t i, int64_t lane, ilvec& lo, ilvec& hi) {
  const ilvec q = widen_lanes<false>(block + values_offset<F>() + i * kPanel + lane);
  lo = q & 15;
  hi = q >> 4;
  ilvec lanes;
  for (int l = 0; l < kLanes; ++l) lanes[l] = static_cast<int32_t>(lane) + l;
  if constexpr (F == kQ5 || F == kQ5K) {
    const ilvec word = broadcast_lanes(block + high_offset<F>() + 4 * i);
    lo |= ((word >> lanes) & 1) << 4;
    hi |= ((word >> (lanes + 16)) & 1) << 4;
  } else if constexpr (F == kQ6K) {
    const uint8_t* high = block + high_offset<F>();
    lo |= ((broadcast_lanes(high + 4 * i) >> (2 * lanes)) & 3) << 4;
    hi |= ((broadcast_lanes(high + 4 * (i + kQBlock / 2)) >> (2 * lanes)) & 3) << 4;
  }
}

// Panels a product of M rows takes at once over quantized weights (F): besides M x P
// accumulators, each panel's dequantized vectors (two for 4 to 6 bits) and its scales and
// minimums (one pair, two with kQ6K's per 16 inputs) stay in registers.
template <WeightFormat F, int M>
constexpr int quantized_panels_at_once() {
  constexpr int registers = kVectors * 16 / kLanes;  // of kLanes floats
  return std::max(1, std::min(8, (registers - 1) / (M + (F == kQ6K ? 6 : 4))));
}

}  // namespace

extern "C" {

// A weight matrix in panels, float32 or quantized (WeightFormat). A matrix stacked from parts
// of different formats (a GGUF file's q and k in Q4_K, v in Q6_K) is its first part, whose
// `panels` say how many of the stack's panels it holds, and `next` the rest; a matrix of one
// format has next null (panels unread).
struct TiergateMatrix {
  const void* data;
  int64_t format;
  const TiergateMatrix* next;
  int64_t panels;
};

// One decoder layer's weights and cache. Matrices in panels (see above); vectors plain;
// optional ones null when the model has none.
struct TiergateDecodeLayer {
  const float* input_norm;    // [E]
  const float* q_norm;        // [D] per-head norm of q (Qwen3), or null
  const float* k_norm;        // [D] per-head norm of k, or null
  TiergateMatrix qkv;         // panels of [(H + 2 Hkv) D, E]
  const float* qkv_bias;      // [(H + 2 Hkv) D] or null
  TiergateMatrix o;           // panels of [E, H D]
  const float* o_bias;        // [E] or null
  const float* post_norm;     // [E]
  TiergateMatrix gate_up;     // interleaved panels of gate [I, E] and up [I, E]
  const float* gate_up_bias;  // [2 I] in the panels' order, or null
  TiergateMatrix down;        // panels of [E, I]
  const float* down_bias;     // [E] or null
  float* k_cache;             // [num_blocks, block_size, Hkv, D]
  float* v_cache;             // [num_blocks, block_size, Hkv, D]
  int64_t window;             // sliding window, 0 for none
};

// The model: sizes and the weights outside the layers.
struct TiergateDecodeModel {
  int64_t num_layers;
  int64_t hidden;        // E
  int64_t num_heads;     // H
  int64_t num_kv_heads;  // Hkv
  int64_t head_dim;      // D
  int64_t intermediate;  // I
  int64_t vocab;         // V
  int64_t block_size;
  int64_t num_blocks;
  int64_t max_positions;  // rows of the rotary tables
  int64_t max_rows;       // rows (sequences) the caller's workspace holds
  float eps;             // RMSNorm epsilon
  float scale;           // attention softmax scale
  const float* embed;       // [V, E] row-major, or null: the embedding is embed_panels
  TiergateMatrix embed_panels;  // the embedding in panels (a GGUF file's blocks), when embed
                                // is null
  const float* final_norm;  // [E]
  TiergateMatrix lm_head;  // panels of [V, E]
  const float* cos_table;   // [max positions, D] (engine.models.rope.RotaryTable)
  const float* sin_table;   // [max positions, D], first half negated
  const TiergateDecodeLayer* layers;
};

// One adapter's update of one fused product of one layer (engine/models/cpu_decode_lora.py).
// B is block-diagonal over the product's targets (q, k, v; gate, up): each output panel keeps
// only the block of the target it belongs to, and where it finds that target's h rows.
struct TiergateLoraProduct {
  const float* a;           // A in panels of 16 ranks, [R16 / 16][in][16] (zero rows past R),
                            // or null: the adapter does not target this product
  int64_t a_panels;         // R16 / 16
  const float* b;           // B per output panel (the product's panel order): [rank][16] each
  const int64_t* b_panels;  // [N / 16][3]: per output panel its first h row, its rank (0: no
                            // update) and where its block starts in b (floats)
};

// An adapter slot: its products per layer.
struct TiergateLoraSlot {
  const TiergateLoraProduct* products;  // [num_layers][4]: qkv, o, gate_up, down; null: empty
  int64_t h_floats;                     // the widest a_panels * 16 of its products
};

// A step's adapters: the slots and each row's slot.
struct TiergateLoraStep {
  const TiergateLoraSlot* slots;  // [num_slots]
  int64_t num_slots;
  const int64_t* row_slots;  // [M]: each row's slot, -1: the base model
  float* h;                  // [M, h_stride]: the shrinks' output, one product at a time
  int64_t h_stride;          // floats per row of h, at least every used slot's h_floats
};

}  // extern "C"

namespace {

// out[m, p * 16 + i] = sum_k x[m, k] * W[p * 16 + i, k] for panels p of [first, first + P),
// kLanes outputs of a panel at a time (see lvec).
template <int M, int P>
inline void panel_product(const float* x, int64_t K, const float* panels, int64_t first,
                          float* out, int64_t out_stride) {
  const float* w[P];
  for (int j = 0; j < P; ++j) w[j] = panels + (first + j) * K * kPanel;
  for (int64_t lane = 0; lane < kPanel; lane += kLanes) {
    lvec acc[M][P] = {};
    for (int64_t k = 0; k < K; ++k) {
      lvec wv[P];
      for (int j = 0; j < P; ++j) {
        if (k + kPrefetchRows < K) {
          __builtin_prefetch(w[j] + (k + kPrefetchRows) * kPanel + lane, 0, 3);
        }
        wv[j] = load_lanes(w[j] + k * kPanel + lane);
      }
      for (int64_t m = 0; m < M; ++m) {
        const lvec xm = splat(x + m * K + k);
        for (int j = 0; j < P; ++j) acc[m][j] += wv[j] * xm;
      }
    }
    for (int64_t m = 0; m < M; ++m) {
      for (int j = 0; j < P; ++j) {
        store_lanes(out + m * out_stride + (first + j) * kPanel + lane, acc[m][j]);
      }
    }
  }
}

// panel_product over quantized panels (any quantized F), K a multiple of kQBlock: each
// block's weights dequantized in registers, kLanes outputs of one input at a time (the
// panel's 16 in one pass with AVX-512, in two with AVX2).
template <WeightFormat F, int M, int P>
inline void quantized_panel_product(const float* x, int64_t K, const uint8_t* panels,
                                    int64_t first, float* out, int64_t out_stride) {
  constexpr int64_t kBytes = block_bytes<F>(), kValues = values_offset<F>();
  const int64_t num_blocks = K / kQBlock;
  const uint8_t* w[P];
  for (int j = 0; j < P; ++j) w[j] = panels + (first + j) * num_blocks * kBytes;
  for (int64_t lane = 0; lane < kPanel; lane += kLanes) {
    lvec acc[M][P] = {};
    for (int64_t b = 0; b < num_blocks; ++b) {
      // No software prefetch: with it (two blocks ahead) one row's products took 12 % longer
      // (ops/bench/journal.md, "GGUF blocks as stored"); the float panels' streams need it.
      const float* xb = x + b * kQBlock;
      if constexpr (F == kQ8) {
        lvec scale[P];
        for (int j = 0; j < P; ++j) scale[j] = lane_scales<F>(w[j] + b * kBytes, 0, lane);
        for (int64_t i = 0; i < kQBlock; ++i) {
          lvec wv[P];
          for (int j = 0; j < P; ++j) {
            const ilvec q = widen_lanes<true>(w[j] + b * kBytes + kValues + i * kPanel + lane);
            wv[j] = __builtin_convertvector(q, lvec) * scale[j];
          }
          for (int m = 0; m < M; ++m) {
            const lvec xm = splat(xb + m * K + i);
            for (int j = 0; j < P; ++j) acc[m][j] += wv[j] * xm;
          }
        }
      } else {
        // Scales and minimums (w at q = 0) of inputs 0..15 and 16..31 of the block.
        lvec scale_lo[P], scale_hi[P], min_lo[P], min_hi[P];
        for (int j = 0; j < P; ++j) {
          const uint8_t* block = w[j] + b * kBytes;
          scale_lo[j] = lane_scales<F>(block, 0, lane);
          scale_hi[j] = F == kQ6K ? lane_scales<F>(block, 1, lane) : scale_lo[j];
          min_lo[j] = lane_mins<F>(block, scale_lo[j], lane);
          min_hi[j] = F == kQ6K ? lane_mins<F>(block, scale_hi[j], lane) : min_lo[j];
        }
        for (int64_t i = 0; i < kQBlock / 2; ++i) {
          lvec lo[P], hi[P];
          for (int j = 0; j < P; ++j) {
            ilvec q_lo, q_hi;
            lane_values<F>(w[j] + b * kBytes, i, lane, q_lo, q_hi);
            lo[j] = __builtin_convertvector(q_lo, lvec) * scale_lo[j] + min_lo[j];
            hi[j] = __builtin_convertvector(q_hi, lvec) * scale_hi[j] + min_hi[j];
          }
          for (int m = 0; m < M; ++m) {
            const lvec xl = splat(xb + m * K + i);
            const lvec xh = splat(xb + m * K + i + kQBlock / 2);
            for (int j = 0; j < P; ++j) acc[m][j] += lo[j] * xl + hi[j] * xh;
          }
        }
      }
    }
    for (int m = 0; m < M; ++m) {
      for (int j = 0; j < P; ++j) {
        store_lanes(out + m * out_stride + (first + j) * kPanel + lane, acc[m][j]);
      }
    }
  }
}

// out[0:K] = row `lane` of panel p of quantized panels (F), dequantized.
template <WeightFormat F>
inline void quantized_row(const uint8_t* panels, int64_t p, int64_t lane, int64_t K,
                          float* out) {
  constexpr int64_t kBytes = block_bytes<F>(), kValues = values_offset<F>();
  const int64_t num_blocks = K / kQBlock;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint8_t* block = panels + (p * num_blocks + b) * kBytes;
    if constexpr (F == kQ8) {
      const float scale = lane_scale<F>(block, lane, 0);
      for (int64_t i = 0; i < kQBlock; ++i) {
        const auto q = static_cast<int8_t>(block[kValues + i * kPanel + lane]);
        out[b * kQBlock + i] = static_cast<float>(q) * scale;
      }
    } else {
      for (int half = 0; half < 2; ++half) {
        const float scale = lane_scale<F>(block, lane, half);
        const float low = lane_min<F>(block, lane, scale);
        for (int64_t i = half * kQBlock / 2; i < (half + 1) * kQBlock / 2; ++i) {
          out[b * kQBlock + i] = static_cast<float>(lane_value<F>(block, i, lane)) * scale + low;
        }
      }
    }
  }
}

// out[0:K] = row n of W [N, K] in panels of any format, dequantized (an embedding lookup).
inline void panel_row(const TiergateMatrix& w, int64_t n, int64_t K, float* out) {
  const int64_t p = n / kPanel, lane = n % kPanel;
  const auto* bytes = static_cast<const uint8_t*>(w.data);
  switch (w.format) {
    case kQ8: quantized_row<kQ8>(bytes, p, lane, K, out); break;
    case kQ4: quantized_row<kQ4>(bytes, p, lane, K, out); break;
    case kQ4K: quantized_row<kQ4K>(bytes, p, lane, K, out); break;
    case kQ5: quantized_row<kQ5>(bytes, p, lane, K, out); break;
    case kQ5K: quantized_row<kQ5K>(bytes, p, lane, K, out); break;
    case kQ6K: quantized_row<kQ6K>(bytes, p, lane, K, out); break;
    default: {
      const float* panel = static_cast<const float*>(w.data) + p * K * kPanel;
      for (int64_t k = 0; k < K; ++k) out[k] = panel[k * kPanel + lane];
    }
  }
}

// The panel product of M rows and P panels for the weight format F.
template <WeightFormat F, int M, int P>
inline void format_product(const float* x, int64_t K, const void* panels, int64_t first,
                           float* out, int64_t out_stride) {
  if constexpr (F == kF32) {
    panel_product<M, P>(x, K, static_cast<const float*>(panels), first, out, out_stride);
  } else {
    quantized_panel_product<F, M, P>(x, K, static_cast<const uint8_t*>(panels), first, out,
                                     out_stride);
  }
}

template <WeightFormat F, int M>
constexpr int format_panels_at_once() {
  return F == kF32 ? panels_at_once<M>() : quantized_panels_at_once<F, M>();
}

// Rows m of out[rows, N] for panels [first, first + P): the product for a runtime row count.
template <WeightFormat F, int P>
inline void row_block(int64_t rows, const float* x, int64_t K, const void* panels, int64_t first,
                      float* out, int64_t out_stride) {
  switch (rows) {
    case 1: format_product<F, 1, P>(x, K, panels, first, out, out_stride); break;
    case 2: format_product<F, 2, P>(x, K, panels, first, out, out_stride); break;
    case 3: format_product<F, 3, P>(x, K, panels, first, out, out_stride); break;
    case 4: format_product<F, 4, P>(x, K, panels, first, out, out_stride); break;
#if defined(__AVX512F__)
    case 5: format_product<F, 5, P>(x, K, panels, first, out, out_stride); break;
    case 6: format_product<F, 6, P>(x, K, panels, first, out, out_stride); break;
    case 7: format_product<F, 7, P>(x, K, panels, first, out, out_stride); break;
    default: format_product<F, 8, P>(x, K, panels, first, out, out_stride); break;
#else
    default: format_product<F, 4, P>(x, K, panels, first, out, out_stride); break;
#endif
  }
}

// Panels [begin, end) of out[M, N] for M <= kRowBlock rows, P panels at a time: P streams of
// weights in flight, M x P accumulators in registers (more streams read faster, up to what the
// registers hold: ops/bench/journal.md, "The decode step as one C++ call").
template <WeightFormat F, int M>
void few_rows(const float* x, int64_t K, const void* panels, int64_t N, float* out,
              int64_t begin, int64_t end) {
  constexpr int P = format_panels_at_once<F, M>();
  int64_t p = begin;
  for (; p + P <= end; p += P) format_product<F, M, P>(x, K, panels, p, out, N);
  for (; p < end; ++p) format_product<F, M, 1>(x, K, panels, p, out, N);
}

// Panels [begin, end) of a product: one thread's share.
struct Share {
  int64_t begin;
  int64_t end;
};

// A thread's share of a product's N / 16 panels, in whole units of `unit` panels.
inline Share share_of(int64_t N, int64_t unit, int64_t thread, int64_t num_threads) {
  const int64_t num_units = N / kPanel / unit;
  return {num_units * thread / num_threads * unit, num_units * (thread + 1) / num_threads * unit};
}

// This thread's share of out[M, N] = x[M, K] W^T (+ bias): panels [begin, end) of the N / 16,
// whole units of `unit` panels; returns it. Above kRowBlock rows, each group of panels is taken
// by every block of kRowBlock rows in turn while it is in cache: the weights are read from
// memory once.
inline bool valid_format(const TiergateMatrix& w) {
  for (const TiergateMatrix* part = &w; part != nullptr; part = part->next) {
    if (part->format < kF32 || part->format > kQ6K || part->data == nullptr) return false;
    if (part->next != nullptr && part->panels < 1) return false;
  }
  return true;
}

// Panel p of quantized panels (F), dequantized into float32 panel layout: dst [K][16].
template <WeightFormat F>
void dequantize_panel(const uint8_t* panels, int64_t p, int64_t K, float* dst) {
  constexpr int64_t kBytes = block_bytes<F>(), kValues = values_offset<F>();
  const int64_t num_blocks = K / kQBlock;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint8_t* block = panels + (p * num_blocks + b) * kBytes;
    float* rows = dst + b * kQBlock * kPanel;
    for (int64_t lane = 0; lane < kPanel; lane += kLanes) {
      if constexpr (F == kQ8) {
        const lvec scale = lane_scales<F>(block, 0, lane);
        for (int64_t i = 0; i < kQBlock; ++i) {
          const ilvec q = widen_lanes<true>(block + kValues + i * kPanel + lane);
          store_lanes(rows + i * kPanel + lane, __builtin_convertvector(q, lvec) * scale);
        }
      } else {
        const lvec scale_lo = lane_scales<F>(block, 0, lane);
        const lvec scale_hi = lane_scales<F>(block, 1, lane);
        const lvec min_lo = lane_mins<F>(block, scale_lo, lane);
        const lvec min_hi = lane_mins<F>(block, scale_hi, lane);
        for (int64_t i = 0; i < kQBlock / 2; ++i) {
          ilvec q_lo, q_hi;
          lane_values<F>(block, i, lane, q_lo, q_hi);
          store_lanes(rows + i * kPanel + lane,
                      __builtin_convertvector(q_lo, lvec) * scale_lo + min_lo);
          store_lanes(rows + (i + kQBlock / 2) * kPanel + lane,
                      __builtin_convertvector(q_hi, lvec) * scale_hi + min_hi);
        }
      }
    }
  }
}

// Rows above which a quantized product dequantizes each group of panels once (below, it
// dequantizes in registers for each block of kRowBlock rows): two blocks of rows with
// AVX-512, one with AVX2, where 8 rows in registers took twice 4 rows' time and 16 rows over
// the scratch 1.4 times (ops/bench/quantized_decode.py; journal, "Products in lane registers").
#if defined(__AVX512F__)
constexpr int64_t kScratchRows = 2 * kRowBlock;
#else
constexpr int64_t kScratchRows = kRowBlock;
#endif

// Panels [begin, end) of out[M, N] for M above kScratchRows over quantized panels: each group of
// panels dequantized once into the thread's float32 scratch (in L2), then taken by every block
// of kRowBlock rows as float panels are, instead of dequantized again for each block of rows.
template <WeightFormat F>
void quantized_many_rows(int64_t M, const float* x, int64_t K, const uint8_t* panels,
                         int64_t N, float* out, int64_t begin, int64_t end) {
  constexpr int P = panels_at_once<kRowBlock>();
  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(P * K * kPanel));
  for (int64_t p = begin; p < end; p += P) {
    const int64_t count = std::min<int64_t>(P, end - p);
    for (int64_t j = 0; j < count; ++j) {
      dequantize_panel<F>(panels, p + j, K, scratch.data() + j * K * kPanel);
    }
    for (int64_t m = 0; m < M; m += kRowBlock) {
      const int64_t rows = std::min(kRowBlock, M - m);
      float* tile = out + m * N + p * kPanel;
      if (count == P) {
        row_block<kF32, P>(rows, x + m * K, K, scratch.data(), 0, tile, N);
      } else {
        for (int64_t j = 0; j < count; ++j) {
          row_block<kF32, 1>(rows, x + m * K, K, scratch.data(), j, tile, N);
        }
      }
    }
  }
}

// Products of more than kInt8Rows rows over quantized panels take their activations in int8:
// each row's block of 32 inputs rounded to 127 steps of its largest magnitude (d = max |x| /
// 127, q = round(x / d)), as llama.cpp's Q8 activations, so a product is integer dot products
// of the weights' unsigned values and those bytes, four inputs of one output in one 32-bit lane
// (VNNI's vpdpbusd; vpmaddubsw and vpmaddwd without it), and per block, in float,
//   out += (scale d) sum_k u_k q_k + min d sum_k q_k,
// which is the dequantized weights times the rounded activations x^ = d q, in another order.
// With VNNI it took 0.41-0.47 of float32 panels' time at 32-128 rows (ops/bench/journal.md,
// "Int8 activations"). The weights of a group of panels are first repacked into kInt8Block layout
// (unsigned values, float scales and minimums), once for all the rows. Without VNNI the byte
// products' pairs are summed in 16 bits (vpmaddubsw), which 8-bit unsigned values would
// saturate: 8-bit weights stay signed there, and a product takes |w| times x with w's sign.
#if (defined(__AVX512F__) && defined(__AVX512BW__)) || (!defined(__AVX512F__) && defined(__AVX2__))
#define TIERGATE_INT8_DOTS 1
#if defined(__AVX512F__) ? defined(__AVX512VNNI__) : defined(__AVXVNNI__)
#define TIERGATE_INT8_VNNI 1
#endif
#endif

// Rows above which the int8 products pay: from 3 rows with VNNI and without it (two stay
// bound by the weights' stream, dequantized in registers; journal, "Int8 activations").
constexpr int64_t kInt8Rows = 2;

template <WeightFormat F>
constexpr bool int8_activations() {
#if defined(TIERGATE_INT8_DOTS)
  return F != kF32;
#else
  return false;
#endif
}

#if defined(TIERGATE_INT8_DOTS)

// One panel's block in int8 layout: scale[2][16] and min[2][16] (inputs 0..15, 16..31; w =
// scale u + min), then the values u (unsigned; 8-bit ones signed without VNNI, min 0) as 8
// groups of 4 inputs, [group][16 lanes][4].
constexpr int64_t kInt8Scales = 0, kInt8Mins = 2 * kPanel * 4, kInt8Values = 4 * kPanel * 4;
constexpr int64_t kInt8Block = kInt8Values + kQBlock * kPanel;

typedef uint32_t ulvec __attribute__((vector_size(4 * kLanes)));
inline ilvec load_int_lanes(const uint8_t* p) {
#if defined(__AVX512F__)
  return (ilvec)_mm512_loadu_si512(p);
#else
  return (ilvec)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
#endif
}
inline void store_int_lanes(uint8_t* p, ilvec v) {
#if defined(__AVX512F__)
  _mm512_storeu_si512(p, (__m512i)v);
#else
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)v);
#endif
}

#if defined(TIERGATE_INT8_VNNI)
// acc + the sums of four byte products (u unsigned, s signed) in each 32-bit lane.
inline ilvec dot_bytes(ilvec acc, ilvec u, ilvec s) {
#if defined(__AVX512F__)
  return (ilvec)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)u, (__m512i)s);
#else
  return (ilvec)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)u, (__m256i)s);
#endif
}
#else
// Without VNNI: pairs + the sums of two byte products (u unsigned, s signed) in each 16-bit
// lane (vpmaddubsw, which saturates: the caller keeps the sums in range), and acc + the
// 16-bit lanes' pairs summed into the 32-bit lanes.
inline ilvec add_byte_pairs(ilvec pairs, ilvec u, ilvec s) {
#if defined(__AVX512F__)
  return (ilvec)_mm512_add_epi16((__m512i)pairs, _mm512_maddubs_epi16((__m512i)u, (__m512i)s));
#else
  return (ilvec)_mm256_add_epi16((__m256i)pairs, _mm256_maddubs_epi16((__m256i)u, (__m256i)s));
#endif
}
// add_byte_pairs for signed w: |w| (at most 128) times s with w's sign.
inline ilvec add_signed_byte_pairs(ilvec pairs, ilvec w, ilvec s) {
#if defined(__AVX512F__)
  const __mmask64 negative = _mm512_movepi8_mask((__m512i)w);
  const __m512i signed_s = _mm512_mask_sub_epi8((__m512i)s, negative, _mm512_setzero_si512(),
                                                (__m512i)s);
  return add_byte_pairs(pairs, (ilvec)_mm512_abs_epi8((__m512i)w), (ilvec)signed_s);
#else
  return add_byte_pairs(pairs, (ilvec)_mm256_abs_epi8((__m256i)w),
                        (ilvec)_mm256_sign_epi8((__m256i)s, (__m256i)w));
#endif
}
inline ilvec widen_pairs(ilvec acc, ilvec pairs) {
#if defined(__AVX512F__)
  return acc + (ilvec)_mm512_madd_epi16((__m512i)pairs, _mm512_set1_epi16(1));
#else
  return acc + (ilvec)_mm256_madd_epi16((__m256i)pairs, _mm256_set1_epi16(1));
#endif
}
// Groups of four inputs whose byte products a 16-bit lane holds without saturating: two
// products a group, each at most 127 times the largest value (15, 31, 63 or |-128|).
template <WeightFormat F>
constexpr int64_t groups_in_16_bits() {
  return F == kQ4 || F == kQ4K ? 8 : F == kQ5 || F == kQ5K ? 4 : F == kQ6K ? 2 : 1;
}
#endif

inline float lanes_max(lvec v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps((__m512)v);
#else
  __m128 m = _mm_max_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
#endif
}

inline int32_t lanes_sum(ilvec v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_epi32((__m512i)v);
#else
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128((__m256i)v),
                            _mm256_extracti128_si256((__m256i)v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
#endif
}

// kLanes int32 in [-127, 127] stored as bytes at p.
inline void store_byte_lanes(int8_t* p, ilvec q) {
#if defined(__AVX512F__)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8((__m512i)q));
#else
  const __m256i words = _mm256_packs_epi32((__m256i)q, (__m256i)q);  // per 128-bit half
  const __m256i bytes = _mm256_packs_epi16(words, words);
  const __m128i low = _mm256_castsi256_si128(bytes), high = _mm256_extracti128_si256(bytes, 1);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_unpacklo_epi32(low, high));
#endif
}

// Floats per row and block that a product's rows carry beside their bytes: d, and d sum q of
// inputs 0..15, of 16..31 and of all 32.
constexpr int64_t kRowScales = 4;

// Rows x[M, K] in int8 (see above): q[M, K], and per row and block its kRowScales floats.
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* scales) {
  constexpr int kVecs = kQBlock / kLanes;
  const int64_t num_blocks = K / kQBlock;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < num_blocks; ++b) {
      const float* xb = x + m * K + b * kQBlock;
      lvec v[kVecs], amax = {};
      for (int i = 0; i < kVecs; ++i) {
        v[i] = load_lanes(xb + i * kLanes);
        const lvec magnitude = v[i] < 0.0f ? -v[i] : v[i];
        amax = magnitude > amax ? magnitude : amax;
      }
      const float largest = lanes_max(amax);
      const float d = largest / 127.0f, inverse = largest > 0.0f ? 127.0f / largest : 0.0f;
      ilvec sums[2] = {};
      for (int i = 0; i < kVecs; ++i) {
#if defined(__AVX512F__)
        const ilvec rounded = (ilvec)_mm512_cvtps_epi32((__m512)(v[i] * inverse));
#else
        const ilvec rounded = (ilvec)_mm256_cvtps_epi32((__m256)(v[i] * inverse));
#endif
        store_byte_lanes(q + m * K + b * kQBlock + i * kLanes, rounded);
        sums[i * kLanes / (kQBlock / 2)] += rounded;
      }
      float* s = scales + (m * num_blocks + b) * kRowScales;
      const int32_t low = lanes_sum(sums[0]), high = lanes_sum(sums[1]);
      s[0] = d;
      s[1] = d * static_cast<float>(low);
      s[2] = d * static_cast<float>(high);
      s[3] = d * static_cast<float>(low + high);
    }
  }
}

// What 8-bit values add in int8 layout: 128 with VNNI (its byte products take unsigned
// weights), none without (signed weights: add_signed_byte_pairs).
#if defined(TIERGATE_INT8_VNNI)
constexpr int32_t kQ8Offset = 128;
#else
constexpr int32_t kQ8Offset = 0;
#endif

// Panel p of quantized panels (F) in int8 layout: dst [K / 32][kInt8Block].
template <WeightFormat F>
void int8_panel(const uint8_t* panels, int64_t p, int64_t K, uint8_t* dst) {
  constexpr int64_t kBytes = block_bytes<F>(), kValues = values_offset<F>();
  const int64_t num_blocks = K / kQBlock;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint8_t* block = panels + (p * num_blocks + b) * kBytes;
    uint8_t* out = dst + b * kInt8Block;
    auto* scales = reinterpret_cast<float*>(out + kInt8Scales);
    auto* mins = reinterpret_cast<float*>(out + kInt8Mins);
    for (int64_t lane = 0; lane < kPanel; lane += kLanes) {
      for (int half = 0; half < 2; ++half) {
        const lvec scale = lane_scales<F>(block, half, lane);
        store_lanes(scales + half * kPanel + lane, scale);
        if constexpr (F == kQ8) {  // u = q + 128 with VNNI, else q (signed)
          store_lanes(mins + half * kPanel + lane, scale * (kQ8Offset == 0 ? 0.0f : -128.0f));
        } else {
          store_lanes(mins + half * kPanel + lane, lane_mins<F>(block, scale, lane));
        }
      }
      for (int64_t group = 0; group < kQBlock / 8; ++group) {  // inputs 4 group + 0..3
        ilvec lo_word = {}, hi_word = {};  // of inputs i and i + 16
        for (int j = 0; j < 4; ++j) {
          const int64_t i = 4 * group + j;
          ilvec lo, hi;
          if constexpr (F == kQ8) {
            lo = (widen_lanes<true>(block + kValues + i * kPanel + lane) + kQ8Offset) & 255;
            hi = (widen_lanes<true>(block + kValues + (i + kQBlock / 2) * kPanel + lane) +
                  kQ8Offset) & 255;
          } else {
            lane_values<F>(block, i, lane, lo, hi);
          }
          lo_word |= (ilvec)((ulvec)lo << (8 * j));
          hi_word |= (ilvec)((ulvec)hi << (8 * j));
        }
        store_int_lanes(out + kInt8Values + (group * kPanel + lane) * 4, lo_word);
        store_int_lanes(out + kInt8Values + ((group + kQBlock / 8) * kPanel + lane) * 4, hi_word);
      }
    }
  }
}

// out[m, p * 16 + i] for M rows and panels p of [first, first + P) of int8 panels (from
// F's): per block, integer dot products of four inputs at a time, then scaled in float, per
// half where the halves have scales of their own (kQ6K).
template <WeightFormat F, int M, int P>
inline void int8_panel_product(const int8_t* q, const float* row_scales, int64_t K,
                               const uint8_t* panels, int64_t first, float* out,
                               int64_t out_stride) {
  constexpr bool kHalves = F == kQ6K;
  const int64_t num_blocks = K / kQBlock;
  for (int64_t lane = 0; lane < kPanel; lane += kLanes) {
    lvec acc[M][P] = {};
    for (int64_t b = 0; b < num_blocks; ++b) {
      const uint8_t* block[P];
      for (int j = 0; j < P; ++j) block[j] = panels + ((first + j) * num_blocks + b) * kInt8Block;
      ilvec dots[M][P] = {};
#if !defined(TIERGATE_INT8_VNNI)
      ilvec pairs[M][P] = {};
#endif
      for (int64_t group = 0; group < kQBlock / 4; ++group) {
        ilvec w[P];
        for (int j = 0; j < P; ++j) {
          w[j] = load_int_lanes(block[j] + kInt8Values + (group * kPanel + lane) * 4);
        }
        for (int m = 0; m < M; ++m) {
          const ilvec s = broadcast_lanes(
              reinterpret_cast<const uint8_t*>(q + m * K + b * kQBlock + 4 * group));
          for (int j = 0; j < P; ++j) {
#if defined(TIERGATE_INT8_VNNI)
            dots[m][j] = dot_bytes(dots[m][j], w[j], s);
#else
            pairs[m][j] = F == kQ8 ? add_signed_byte_pairs(pairs[m][j], w[j], s)
                                   : add_byte_pairs(pairs[m][j], w[j], s);
            if ((group + 1) % groups_in_16_bits<F>() == 0) {
              dots[m][j] = widen_pairs(dots[m][j], pairs[m][j]);
              pairs[m][j] = ilvec{};
            }
#endif
          }
        }
        if (kHalves ? group % 4 == 3 : group == kQBlock / 4 - 1) {  // a half's or block's end
          const int half = kHalves ? static_cast<int>(group / 4) : 0;
          for (int j = 0; j < P; ++j) {
            const auto* floats = reinterpret_cast<const float*>(block[j]);
            const lvec scale = load_lanes(floats + half * kPanel + lane);
            const lvec low = load_lanes(floats + (2 + half) * kPanel + lane);
            for (int m = 0; m < M; ++m) {
              const float* s = row_scales + (m * num_blocks + b) * kRowScales;
              const float sum = s[kHalves ? 1 + half : 3];
              acc[m][j] += __builtin_convertvector(dots[m][j], lvec) * (scale * s[0]) +
                           low * sum;
              dots[m][j] = ilvec{};
            }
          }
        }
      }
    }
    for (int m = 0; m < M; ++m) {
      for (int j = 0; j < P; ++j) {
        store_lanes(out + m * out_stride + (first + j) * kPanel + lane, acc[m][j]);
      }
    }
  }
}

// Rows an int8 product takes at once, and panels: with AVX2 (two passes of 8 lanes a panel)
// 3 or 4 rows took 0.63-0.65 of float32 panels' time at 32 rows, 2 rows 0.82 (ops/bench/
// journal.md, "Int8 activations").
constexpr int kInt8RowBlock = 4, kInt8Panels = 2;

// int8_panel_product for rows <= R rows.
template <WeightFormat F, int P, int R = kInt8RowBlock>
inline void int8_row_block(int64_t rows, const int8_t* q, const float* row_scales, int64_t K,
                           const uint8_t* panels, int64_t first, float* out, int64_t stride) {
  if constexpr (R > 1) {
    if (rows < R) {
      int8_row_block<F, P, R - 1>(rows, q, row_scales, K, panels, first, out, stride);
      return;
    }
  }
  int8_panel_product<F, R, P>(q, row_scales, K, panels, first, out, stride);
}

// Panels [begin, end) of out[M, N] over quantized panels (F) with int8 activations: the rows
// quantized, then each group of kInt8Panels panels repacked once into the thread's scratch
// and taken by every block of kInt8RowBlock rows.
template <WeightFormat F>
void int8_many_rows(int64_t M, const float* x, int64_t K, const uint8_t* panels, int64_t N,
                    float* out, int64_t begin, int64_t end) {
  constexpr int P = kInt8Panels;
  const int64_t num_blocks = K / kQBlock;
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> row_scales;
  thread_local std::vector<uint8_t> scratch;
  q.resize(static_cast<size_t>(M * K));
  row_scales.resize(static_cast<size_t>(M * num_blocks * kRowScales));
  scratch.resize(static_cast<size_t>(P * num_blocks * kInt8Block));
  quantize_rows(x, M, K, q.data(), row_scales.data());
  for (int64_t p = begin; p < end; p += P) {
    const int64_t count = std::min<int64_t>(P, end - p);
    for (int64_t j = 0; j < count; ++j) {
      int8_panel<F>(panels, p + j, K, scratch.data() + j * num_blocks * kInt8Block);
    }
    for (int64_t m = 0; m < M; m += kInt8RowBlock) {
      const int64_t rows = std::min<int64_t>(kInt8RowBlock, M - m);
      float* tile = out + m * N + p * kPanel;
      if (count == P) {
        int8_row_block<F, P>(rows, q.data() + m * K,
                             row_scales.data() + m * num_blocks * kRowScales, K, scratch.data(),
                             0, tile, N);
      } else {
        for (int64_t j = 0; j < count; ++j) {
          int8_row_block<F, 1>(rows, q.data() + m * K,
                               row_scales.data() + m * num_blocks * kRowScales, K,
                               scratch.data(), j, tile, N);
        }
      }
    }
  }
}

#endif  // TIERGATE_INT8_DOTS

template <WeightFormat F>
void format_share(int64_t M, const float* x, int64_t K, const void* panels, int64_t N,
                  float* out, int64_t begin, int64_t end) {
#if defined(TIERGATE_INT8_DOTS)
  if constexpr (int8_activations<F>()) {
    if (M > kInt8Rows) {
      int8_many_rows<F>(M, x, K, static_cast<const uint8_t*>(panels), N, out, begin, end);
      return;
    }
  }
#endif
  switch (M) {
    case 1: few_rows<F, 1>(x, K, panels, N, out, begin, end); break;
    case 2: few_rows<F, 2>(x, K, panels, N, out, begin, end); break;
    case 3: few_rows<F, 3>(x, K, panels, N, out, begin, end); break;
    case 4: few_rows<F, 4>(x, K, panels, N, out, begin, end); break;
#if defined(__AVX512F__)
    case 5: few_rows<F, 5>(x, K, panels, N, out, begin, end); break;
    case 6: few_rows<F, 6>(x, K, panels, N, out, begin, end); break;
    case 7: few_rows<F, 7>(x, K, panels, N, out, begin, end); break;
    case 8: few_rows<F, 8>(x, K, panels, N, out, begin, end); break;
#endif
    default: {
      if constexpr (F != kF32) {
        if (M > kScratchRows) {
          quantized_many_rows<F>(M, x, K, static_cast<const uint8_t*>(panels), N, out, begin,
                                 end);
          return;
        }
      }
      constexpr int P = format_panels_at_once<F, kRowBlock>();
      int64_t p = begin;
      for (; p + P <= end; p += P) {
        for (int64_t m = 0; m < M; m += kRowBlock) {
          row_block<F, P>(std::min(kRowBlock, M - m), x + m * K, K, panels, p, out + m * N, N);
        }
      }
      for (; p < end; ++p) {
        for (int64_t m = 0; m < M; m += kRowBlock) {
          row_block<F, 1>(std::min(kRowBlock, M - m), x + m * K, K, panels, p, out + m * N, N);
        }
      }
    }
  }
}

Share product_share(int64_t M, const float* x, int64_t K, const TiergateMatrix& w,
                    const float* bias, int64_t N, int64_t unit, float* out, int64_t thread,
                    int64_t num_threads) {
  const auto [begin, end] = share_of(N, unit, thread, num_threads);
  int64_t first = 0;  // the part's first panel in the stack
  for (const TiergateMatrix* part = &w; part != nullptr; part = part->next) {
    const int64_t last = part->next == nullptr ? N / kPanel : first + part->panels;
    const int64_t from = std::max(begin, first) - first, to = std::min(end, last) - first;
    if (from < to) {  // panels [from, to) of the part: columns from `first` of out
      float* part_out = out + first * kPanel;
      const void* data = part->data;
      switch (part->format) {
        case kQ8: format_share<kQ8>(M, x, K, data, N, part_out, from, to); break;
        case kQ4: format_share<kQ4>(M, x, K, data, N, part_out, from, to); break;
        case kQ4K: format_share<kQ4K>(M, x, K, data, N, part_out, from, to); break;
        case kQ5: format_share<kQ5>(M, x, K, data, N, part_out, from, to); break;
        case kQ5K: format_share<kQ5K>(M, x, K, data, N, part_out, from, to); break;
        case kQ6K: format_share<kQ6K>(M, x, K, data, N, part_out, from, to); break;
        default: format_share<kF32>(M, x, K, data, N, part_out, from, to); break;
      }
    }
    first = last;
  }
  if (bias != nullptr) {
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t n = begin * kPanel; n < end * kPanel; n += 8) {
        store8(out + m * N + n, load8(out + m * N + n) + load8(bias + n));
      }
    }
  }
  return {begin, end};
}

// h[0:16] = A[c * 16 : c * 16 + 16] x for one panel of 16 ranks of A ([K][16]); four
// accumulators over k, so one row's short product is not bound by the FMAs' latency.
inline void shrink_panel(const float* x, int64_t K, const float* a, float* h) {
  vec16 acc[4] = {};
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {
    for (int j = 0; j < 4; ++j) {
      acc[j] += *reinterpret_cast<const vec16*>(a + (k + j) * kPanel) * (vec16{} + x[k + j]);
    }
  }
  for (; k < K; ++k) acc[0] += *reinterpret_cast<const vec16*>(a + k * kPanel) * (vec16{} + x[k]);
  *reinterpret_cast<vec16*>(h) = (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

enum LoraProductIndex : int64_t { kQkv = 0, kO = 1, kGateUp = 2, kDown = 3, kLoraProducts = 4 };

// The update of `product` in layer l of row m's adapter, or null (a base row, or an adapter
// that does not target it).
inline const TiergateLoraProduct* lora_product(const TiergateLoraStep& lora, int64_t m,
                                               int64_t l, int64_t product) {
  const int64_t slot = lora.row_slots[m];
  if (slot < 0) return nullptr;
  const TiergateLoraProduct* up = lora.slots[slot].products + l * kLoraProducts + product;
  return up->a == nullptr ? nullptr : up;
}

// Panels of 16 ranks of the widest shrink of each product of layer l over the rows: 0 where
// no row's adapter targets the product, whose shrink and expand (and barrier) then do not run.
// Every thread computes the same.
inline void lora_widths(const TiergateLoraStep* lora, int64_t M, int64_t l,
                        int64_t widths[kLoraProducts]) {
  for (int64_t product = 0; product < kLoraProducts; ++product) widths[product] = 0;
  if (lora == nullptr) return;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t product = 0; product < kLoraProducts; ++product) {
      const TiergateLoraProduct* up = lora_product(*lora, m, l, product);
      if (up != nullptr) widths[product] = std::max(widths[product], up->a_panels);
    }
  }
}

// h[m, 0:R] = A x[m] for the rows whose adapter targets the product, over (row, panel of 16
// ranks) items; the loop's implicit barrier completes h before any thread expands. x [M, K].
void lora_shrink(const TiergateLoraStep& lora, int64_t M, int64_t l, int64_t product,
                 int64_t width, const float* x, int64_t K) {
#pragma omp for schedule(static, 1)
  for (int64_t item = 0; item < M * width; ++item) {
    const int64_t m = item / width, c = item % width;
    const TiergateLoraProduct* up = lora_product(lora, m, l, product);
    if (up == nullptr || c >= up->a_panels) continue;
    shrink_panel(x + m * K, K, up->a + c * K * kPanel, lora.h + m * lora.h_stride + c * kPanel);
  }
}

// out[r] += B block h[r] for R rows at once (h row stride h_stride, out row stride out_stride);
// one row takes two accumulators over the ranks, so its short sum is not bound by the FMAs'
// latency.
template <int R>
inline void expand_rows(const float* h, int64_t h_stride, const float* b, int64_t rank,
                        float* out, int64_t out_stride) {
  constexpr int kAcc = R == 1 ? 2 : R;
  vec16 acc[kAcc] = {};
  int64_t j = 0;
  if constexpr (R == 1) {
    for (; j + 2 <= rank; j += 2) {
      acc[0] += *reinterpret_cast<const vec16*>(b + j * kPanel) * (vec16{} + h[j]);
      acc[1] += *reinterpret_cast<const vec16*>(b + (j + 1) * kPanel) * (vec16{} + h[j + 1]);
    }
  }
  for (; j < rank; ++j) {
    const vec16 bv = *reinterpret_cast<const vec16*>(b + j * kPanel);
    for (int r = 0; r < R; ++r) acc[r] += bv * (vec16{} + h[r * h_stride + j]);
  }
  if constexpr (R == 1) {
    *reinterpret_cast<vec16*>(out) += acc[0] + acc[1];
  } else {
    for (int r = 0; r < R; ++r) *reinterpret_cast<vec16*>(out + r * out_stride) += acc[r];
  }
}

// out[m, panel p] += B[p] h[m] for the panels of this thread's share and the rows whose adapter
// targets the product: after the share's base product, before anything reads it. The adapted
// rows are listed first (up to kExpandRows at a time), then panels outer, so a panel's block
// of B stays in L1 for the rows of its adapter. out [M, N].
constexpr int64_t kExpandRows = 64;
void lora_expand(const TiergateLoraStep& lora, int64_t M, int64_t l, int64_t product, float* out,
                 int64_t N, Share share) {
  for (int64_t first = 0; first < M; first += kExpandRows) {
    int64_t rows[kExpandRows];
    const TiergateLoraProduct* ups[kExpandRows];
    int64_t count = 0;
    for (int64_t m = first; m < std::min(M, first + kExpandRows); ++m) {
      const TiergateLoraProduct* up = lora_product(lora, m, l, product);
      if (up != nullptr) rows[count] = m, ups[count++] = up;
    }
    for (int64_t p = share.begin; p < share.end; ++p) {
      for (int64_t i = 0; i < count; ++i) {
        const int64_t* panel = ups[i]->b_panels + p * 3;
        const int64_t rank = panel[1];
        if (rank == 0) continue;
        expand_rows<1>(lora.h + rows[i] * lora.h_stride + panel[0], lora.h_stride,
                       ups[i]->b + panel[2], rank, out + rows[i] * N + p * kPanel, N);
      }
    }
  }
}

// Row m's adapter slot is -1 (the base model) or a slot that holds an adapter whose shrinks
// fit h's rows.
inline bool valid_row_slot(const TiergateLoraStep& lora, int64_t m) {
  const int64_t slot = lora.row_slots[m];
  if (slot < -1 || slot >= lora.num_slots) return false;
  return slot < 0 || (lora.slots[slot].products != nullptr &&
                      lora.slots[slot].h_floats <= lora.h_stride);
}

// The layer path's rows in groups: up to kGroupRows consecutive rows on the same adapter (a
// prompt's tokens), whose shrinks and expands run together, each panel of A and block of B read
// once for the group. Its expands walk rows outer, panels inner: each row's output is written
// front to back (panels outer strode across rows 4 KB multiples apart, gate_up's 12 KB, and
// missed the cache on every panel).
constexpr int64_t kGroupRows = 4;
struct RowGroup {
  int64_t first;  // its first row
  int64_t count;  // 1 .. kGroupRows rows
  const TiergateLoraProduct* up;  // their adapter's update of the product
};

// h[r] = A panel x[r] for R rows of x (row stride K) at once.
template <int R>
inline void shrink_rows(const float* x, int64_t K, const float* a, float* h, int64_t h_stride) {
  vec16 acc[R] = {};
  for (int64_t k = 0; k < K; ++k) {
    const vec16 av = *reinterpret_cast<const vec16*>(a + k * kPanel);
    for (int r = 0; r < R; ++r) acc[r] += av * (vec16{} + x[r * K + k]);
  }
  for (int r = 0; r < R; ++r) *reinterpret_cast<vec16*>(h + r * h_stride) = acc[r];
}

// The shrinks of the groups' rows, over (group, panel of 16 ranks) items; the loop's implicit
// barrier completes h before any thread expands. x [rows, K].
void lora_shrink_groups(const TiergateLoraStep& lora, const RowGroup* groups, int64_t num_groups,
                        int64_t width, const float* x, int64_t K) {
#pragma omp for schedule(static, 1)
  for (int64_t item = 0; item < num_groups * width; ++item) {
    const RowGroup& group = groups[item / width];
    const int64_t c = item % width;
    if (c >= group.up->a_panels) continue;
    const float* a = group.up->a + c * K * kPanel;
    float* h = lora.h + group.first * lora.h_stride + c * kPanel;
    if (group.count == kGroupRows) {
      shrink_rows<kGroupRows>(x + group.first * K, K, a, h, lora.h_stride);
    } else {
      for (int64_t r = 0; r < group.count; ++r) {
        shrink_panel(x + (group.first + r) * K, K, a, h + r * lora.h_stride);
      }
    }
  }
}

// out[rows, panels of the share] += B h for the groups' rows; out [rows, N] in the layers'
// layout (split: as tiergate_lora_update_f32 takes it).
void lora_expand_groups(const TiergateLoraStep& lora, const RowGroup* groups, int64_t num_groups,
                        float* out, int64_t N, Share share, int64_t split) {
  for (int64_t g = 0; g < num_groups; ++g) {
    const RowGroup& group = groups[g];
    for (int64_t p = share.begin; p < share.end; ++p) {
      const int64_t* panel = group.up->b_panels + p * 3;
      const int64_t rank = panel[1];
      if (rank == 0) continue;
      const float* h = lora.h + group.first * lora.h_stride + panel[0];
      const float* b = group.up->b + panel[2];
      const int64_t column = split == 0 ? p * kPanel : (p & 1) * split + (p >> 1) * kPanel;
      float* row = out + group.first * N + column;
      if (group.count == kGroupRows) {
        expand_rows<kGroupRows>(h, lora.h_stride, b, rank, row, N);
      } else {
        for (int64_t r = 0; r < group.count; ++r) {
          expand_rows<1>(h + r * lora.h_stride, lora.h_stride, b, rank, row + r * N, N);
        }
      }
    }
  }
}

struct Step {
  int64_t num_rows;
  const int64_t* token_ids;      // [M]
  const int64_t* positions;      // [M]
  const int64_t* slots;          // [M] cache slot of each new token
  const int32_t* block_tables;   // [M, table_stride]
  int64_t table_stride;
  const int32_t* context_lens;   // [M]
  const int32_t* query_starts;   // [M + 1]: 0 .. M (one row per sequence)
  const TiergateLoraStep* lora;  // the rows' adapters, or null: every row on the base model
};

// Workspace rows: residual, normed input, qkv, attention output, a product's output, gate/up,
// the activations. Sizes in floats per row, for the caller's allocation.
struct Workspace {
  float* residual;   // [M, E]
  float* normed;     // [M, E]
  float* qkv;        // [M, (H + 2 Hkv) D]
  float* attention;  // [M, H D]
  float* product;    // [M, E]
  float* gate_up;    // [M, 2 I]
  float* act;        // [M, I]
};

void forward(const TiergateDecodeModel& model, const Step& step, const Workspace& ws,
             float* logits, int64_t num_threads) {
  const int64_t M = step.num_rows;
  const int64_t E = model.hidden, H = model.num_heads, Hkv = model.num_kv_heads;
  const int64_t D = model.head_dim, I = model.intermediate;
  const int64_t qkv_size = (H + 2 * Hkv) * D, kv_size = Hkv * D;
#pragma omp parallel num_threads(num_threads)
  {
    const int64_t thread = omp_get_thread_num(), threads = omp_get_num_threads();
    paged::Scratch scratch;
#pragma omp single
    for (int64_t m = 0; m < M; ++m) {
      if (model.embed != nullptr) {
        std::memcpy(ws.residual + m * E, model.embed + step.token_ids[m] * E, E * sizeof(float));
      } else {
        panel_row(model.embed_panels, step.token_ids[m], E, ws.residual + m * E);
      }
      rms_norm_row(ws.residual + m * E, nullptr, model.layers[0].input_norm, model.eps, E,
                   ws.normed + m * E);
    }
    for (int64_t l = 0; l < model.num_layers; ++l) {
      const TiergateDecodeLayer& layer = model.layers[l];
      int64_t lora_width[kLoraProducts];  // 0: no row's adapter targets the product
      lora_widths(step.lora, M, l, lora_width);
      if (lora_width[kQkv] > 0) lora_shrink(*step.lora, M, l, kQkv, lora_width[kQkv], ws.normed, E);
      const Share qkv = product_share(M, ws.normed, E, layer.qkv, layer.qkv_bias, qkv_size, 1,
                                      ws.qkv, thread, threads);
      if (lora_width[kQkv] > 0) lora_expand(*step.lora, M, l, kQkv, ws.qkv, qkv_size, qkv);
#pragma omp barrier
#pragma omp single
      for (int64_t m = 0; m < M; ++m) {
        float* row = ws.qkv + m * qkv_size;
        if (layer.q_norm != nullptr) {
          for (int64_t h = 0; h < H; ++h) {
            rms_norm_row(row + h * D, nullptr, layer.q_norm, model.eps, D, row + h * D);
          }
          for (int64_t h = H; h < H + Hkv; ++h) {
            rms_norm_row(row + h * D, nullptr, layer.k_norm, model.eps, D, row + h * D);
          }
        }
        const int64_t position = step.positions[m];
        rope_heads(row, H + Hkv, D, model.cos_table + position * D,
                   model.sin_table + position * D);
        write_kv_slot(row + H * D, row + H * D + kv_size, step.slots[m], kv_size,
                      layer.k_cache, layer.v_cache);
      }
      const paged::Layout layout{ws.qkv, qkv_size, layer.k_cache, layer.v_cache,
                                 step.block_tables, step.table_stride, step.query_starts,
                                 step.context_lens, H, Hkv, D, model.block_size,
                                 model.scale, layer.window, ws.attention};
      auto attend = D == 64 ? paged::attend<64> : D == 128 ? paged::attend<128> : paged::attend<0>;
#pragma omp for schedule(dynamic, 1)
      for (int64_t item = 0; item < M * Hkv; ++item) {
        attend(layout, paged::Item{item / Hkv, 0, 1, item % Hkv, item % Hkv + 1}, scratch);
      }
      if (lora_width[kO] > 0) {
        lora_shrink(*step.lora, M, l, kO, lora_width[kO], ws.attention, H * D);
      }
      const Share o = product_share(M, ws.attention, H * D, layer.o, layer.o_bias, E, 1,
                                    ws.product, thread, threads);
      if (lora_width[kO] > 0) lora_expand(*step.lora, M, l, kO, ws.product, E, o);
#pragma omp barrier
#pragma omp single
      for (int64_t m = 0; m < M; ++m) {
        rms_norm_row(ws.product + m * E, ws.residual + m * E, layer.post_norm, model.eps, E,
                     ws.normed + m * E);
      }
      if (lora_width[kGateUp] > 0) {
        lora_shrink(*step.lora, M, l, kGateUp, lora_width[kGateUp], ws.normed, E);
      }
      const Share pairs = product_share(M, ws.normed, E, layer.gate_up, layer.gate_up_bias,
                                        2 * I, 2, ws.gate_up, thread, threads);
      if (lora_width[kGateUp] > 0) {
        lora_expand(*step.lora, M, l, kGateUp, ws.gate_up, 2 * I, pairs);
      }
      // Shares hold whole (gate, up) panel pairs: activations j * 16 .. j * 16 + 15 come from
      // panels 2j and 2j + 1, which this thread has just computed.
      for (int64_t p = pairs.begin; p < pairs.end; p += 2) {
        for (int64_t m = 0; m < M; ++m) {
          const float* pair = ws.gate_up + m * 2 * I + p * kPanel;
          silu_and_mul_row(pair, pair + kPanel, kPanel, ws.act + m * I + (p / 2) * kPanel);
        }
      }
#pragma omp barrier
      if (lora_width[kDown] > 0) lora_shrink(*step.lora, M, l, kDown, lora_width[kDown], ws.act, I);
      const Share down = product_share(M, ws.act, I, layer.down, layer.down_bias, E, 1,
                                       ws.product, thread, threads);
      if (lora_width[kDown] > 0) lora_expand(*step.lora, M, l, kDown, ws.product, E, down);
#pragma omp barrier
      const float* next_norm =
          l + 1 < model.num_layers ? model.layers[l + 1].input_norm : model.final_norm;
#pragma omp single
      for (int64_t m = 0; m < M; ++m) {
        rms_norm_row(ws.product + m * E, ws.residual + m * E, next_norm, model.eps, E,
                     ws.normed + m * E);
      }
    }
    product_share(M, ws.normed, E, model.lm_head, nullptr, model.vocab, 1, logits, thread,
                  threads);
  }
}

}  // namespace

extern "C" {

// Runs the decode step: one new token (token_ids[m] at positions[m], written to cache slot
// slots[m]) for each of num_rows sequences, whose block tables and context lengths (this token
// included) are given; writes logits [num_rows, V]. workspace: floats for model->max_rows rows
// (tiergate_decode_workspace_floats). Returns 0, or -1 without running when an input is out of
// range: num_rows above max_rows, a token id past the vocabulary, a position past the rotary
// tables, a cache slot or a block table outside the cache, a row's adapter slot neither -1 nor
// a slot that holds an adapter, an adapter wider than h, or a matrix of no known format. lora:
// the rows' adapters (h for num_rows rows), or null when no row is on one.
int tiergate_decode_forward_f32(const TiergateDecodeModel* model, int64_t num_rows,
                                const int64_t* token_ids, const int64_t* positions,
                                const int64_t* slots, const int32_t* block_tables,
                                int64_t table_stride, const int32_t* context_lens,
                                const int32_t* query_starts, const TiergateLoraStep* lora,
                                float* workspace, float* logits, int64_t num_threads) {
  const TiergateDecodeModel& md = *model;
  if (num_rows < 1 || num_rows > md.max_rows) return -1;
  const paged::Layout check{nullptr, 0, nullptr, nullptr, block_tables, table_stride,
                            query_starts, context_lens, md.num_heads, md.num_kv_heads,
                            md.head_dim, md.block_size, 1.0f, 0, nullptr};
  const int64_t num_slots = md.num_blocks * md.block_size;
  for (int64_t m = 0; m < num_rows; ++m) {
    if (!paged::valid_sequence(check, m, num_rows, num_rows, md.num_blocks)) return -1;
    if (slots[m] < 0 || slots[m] >= num_slots) return -1;
    if (token_ids[m] < 0 || token_ids[m] >= md.vocab) return -1;
    if (positions[m] < 0 || positions[m] >= md.max_positions) return -1;
    if (lora != nullptr && !valid_row_slot(*lora, m)) return -1;
  }
  if (!valid_format(md.lm_head)) return -1;
  if (md.embed == nullptr && (!valid_format(md.embed_panels) || md.embed_panels.next)) {
    return -1;  // rows are looked up in one format
  }
  for (int64_t l = 0; l < md.num_layers; ++l) {
    const TiergateDecodeLayer& layer = md.layers[l];
    for (const TiergateMatrix* w : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down}) {
      if (!valid_format(*w)) return -1;
    }
  }
  const int64_t E = md.hidden, I = md.intermediate;
  const int64_t qkv_size = (md.num_heads + 2 * md.num_kv_heads) * md.head_dim;
  float* p = workspace;
  auto take = [&](int64_t floats) { float* out = p; p += num_rows * floats; return out; };
  const Workspace ws{take(E), take(E), take(qkv_size), take(md.num_heads * md.head_dim),
                     take(E), take(2 * I), take(I)};
  const Step step{num_rows, token_ids, positions, slots, block_tables, table_stride,
                  context_lens, query_starts, lora};
  forward(md, step, ws, logits, num_threads);
  return 0;
}

// out[m] += B (A x[m]) for each of num_rows rows on an adapter: the update of `product`
// (0 qkv, 1 o, 2 gate_up, 3 down) of `layer` in the steps that go layer by layer (prefills,
// mixed steps), x [num_rows, K] and out [num_rows, N] row-major in the layers' layout (gate_up
// as gate then up: split = N / 2, and the interleaved panel p is at column (p % 2) split +
// (p / 2) 16; 0 for the others), over the decode forward's layout of the adapters: the shrinks
// over (group of rows, panel of 16 ranks) items, then each thread's share of the output panels.
// h holds num_rows rows (the caller's). Returns 0, or -1 without running when the product or a
// row's slot is out of range.
int tiergate_lora_update_f32(const TiergateLoraStep* lora, int64_t num_rows, int64_t layer,
                             int64_t product, const float* x, int64_t K, float* out, int64_t N,
                             int64_t split, int64_t num_threads) {
  if (product < 0 || product >= kLoraProducts || layer < 0 || num_rows < 1) return -1;
  for (int64_t m = 0; m < num_rows; ++m) {
    if (!valid_row_slot(*lora, m)) return -1;
  }
  std::vector<RowGroup> groups;
  int64_t width = 0;  // panels of 16 ranks of the widest shrink
  for (int64_t m = 0; m < num_rows; ++m) {
    const TiergateLoraProduct* up = lora_product(*lora, m, layer, product);
    if (up == nullptr) continue;
    width = std::max(width, up->a_panels);
    RowGroup* last = groups.empty() ? nullptr : &groups.back();
    if (last != nullptr && last->up == up && last->first + last->count == m &&
        last->count < kGroupRows) {
      ++last->count;
    } else {
      groups.push_back({m, 1, up});
    }
  }
  if (groups.empty()) return 0;
  const int64_t num_groups = static_cast<int64_t>(groups.size());
#pragma omp parallel num_threads(num_threads)
  {
    const int64_t thread = omp_get_thread_num(), threads = omp_get_num_threads();
    lora_shrink_groups(*lora, groups.data(), num_groups, width, x, K);
    lora_expand_groups(*lora, groups.data(), num_groups, out, N,
                       share_of(N, 1, thread, threads), split);
  }
  return 0;
}

// out[M, N] = x[M, K] W^T for W in panels (N % 16 == 0; K % 32 == 0 when quantized), on
// num_threads threads: the lm_head of the steps that go layer by layer, over the panels the
// decode forward already holds, and the quantized products' tests. Returns 0, or -1 for a
// format it does not know.
int tiergate_panel_product(const float* x, int64_t M, int64_t K, const TiergateMatrix* weight,
                           const float* bias, int64_t N, float* out, int64_t num_threads) {
  if (!valid_format(*weight)) return -1;
#pragma omp parallel num_threads(num_threads)
  {
    product_share(M, x, K, *weight, bias, N, 1, out, omp_get_thread_num(),
                  omp_get_num_threads());
  }
  return 0;
}

// out[c] = row ids[c] of W [N, K] in panels, dequantized: embedding lookups in a matrix held in
// panels (a GGUF file's token embedding, tied to the lm_head or not). Returns 0, or -1 without
// writing when an id is outside [0, N) or the format is unknown.
int tiergate_panel_rows(const TiergateMatrix* weight, int64_t N, int64_t K, const int64_t* ids,
                        int64_t count, float* out) {
  if (!valid_format(*weight) || weight->next != nullptr) return -1;
  for (int64_t c = 0; c < count; ++c) {
    if (ids[c] < 0 || ids[c] >= N) return -1;
  }
  for (int64_t c = 0; c < count; ++c) panel_row(*weight, ids[c], K, out + c * K);
  return 0;
}

// Rows above which a product over panels of `format` takes its activations in int8
// (see above), or 0 where it never does: float32 weights, a CPU without AVX2.
int64_t tiergate_int8_rows(int64_t format) {
  const bool quantized = format > kF32 && format <= kQ6K;  // every quantized format alike
  return quantized && int8_activations<kQ4>() ? kInt8Rows : 0;
}

// Floats of workspace the model's max_rows rows need.
int64_t tiergate_decode_workspace_floats(const TiergateDecodeModel* model) {
  const TiergateDecodeModel& md = *model;
  const int64_t qkv_size = (md.num_heads + 2 * md.num_kv_heads) * md.head_dim;
  return md.max_rows * (3 * md.hidden + qkv_size + md.num_heads * md.head_dim +
                        3 * md.intermediate);
}

}  // extern "C"
