// Paged attention over the block cache, shared by the CPU kernels that attend: the attention
// entry point (cpu_paged_attention.cpp) and the small-batch decode forward
// (engine/models/cpu_decode.cpp). See cpu_paged_attention.cpp for the contract and the method.

#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vec8.h"

namespace tiergate::paged {

constexpr int64_t kRowTile = 8;          // query rows of one prefill sequence per item
constexpr int64_t kItemsPerThread = 4;   // fewer (sequence, tile) pairs than this: split heads
constexpr int64_t kBlocksPerTile = 16;   // KV blocks walked by every query vector in turn
constexpr int64_t kMaxChunks = 32;       // 8-float chunks of the largest head_dim (256)

struct Layout {
  const float* query;              // [T, H, D], rows query_row_stride floats apart
  int64_t query_row_stride;        // floats from one query row to the next (>= H * D)
  const float* k_cache;            // [num_blocks, block_size, Hkv, D]
  const float* v_cache;            // [num_blocks, block_size, Hkv, D]
  const int32_t* block_tables;     // [B, table_stride]
  int64_t table_stride;            // entries per block table row
  const int32_t* query_start_loc;  // [B + 1]
  const int32_t* context_lens;     // [B]
  int64_t num_heads;               // H
  int64_t num_kv_heads;            // Hkv
  int64_t head_dim;                // D
  int64_t block_size;              // tokens per block
  float scale;                     // softmax scale
  int64_t window;                  // sliding window, 0 for none
  float* out;                      // [T, H, D]
};

struct Item {
  int64_t seq;         // sequence b
  int64_t row_begin;   // first row of the tile, relative to the sequence's first row
  int64_t row_end;     // one past the tile's last row
  int64_t head_begin;  // first KV head h (query heads h*G .. h*G+G-1)
  int64_t head_end;    // one past the last KV head
};

// One thread's buffers, reused across items.
struct Scratch {
  std::vector<float> scores;   // [vecs, stride]: a query vector's scores over the item's span
  std::vector<float> queries;  // [vecs, D]: the item's query vectors, scaled
};

// The keys of one item: positions key_lo .. key_hi of one sequence's cache.
struct Span {
  const int32_t* table;  // the sequence's block table
  int64_t key_lo;        // first key any row of the item sees
  int64_t key_hi;        // last key (inclusive): the last row's own position
  int64_t stride;        // floats per score row: the span rounded up to 8
};

// Calls visit(j, slot) for the keys j of blocks [first_block, end_block) that lie in the span,
// slot being the key's index into a [num_blocks * block_size, ...] view of the cache. With
// prefetch_cache (a cache, offset to the item's first head), it also prefetches row_floats
// floats of the same token one block ahead: blocks are scattered, so the hardware prefetchers
// lose the stream at every block boundary. The prefetches fill L2, not L1: a block's rows are
// more cache lines than L1 has misses in flight, and prefetches to L1 held up the loads behind
// them, doing no better than none, where L2 ones made decode attention faster
// (ops/bench/journal.md, "Two engine changes before runs 10 and 11").
template <typename Visit>
inline void for_keys(const Layout& L, const Span& span, int64_t first_block, int64_t end_block,
                     Visit visit, const float* prefetch_cache = nullptr, int64_t row_floats = 0) {
  const int64_t bs = L.block_size;
  const int64_t last_block = span.key_hi / bs;
  const int64_t token_stride = L.num_kv_heads * L.head_dim;
  for (int64_t block = first_block; block < end_block; ++block) {
    const int64_t base = static_cast<int64_t>(span.table[block]) * bs - block * bs;
    const int64_t j_end = std::min(span.key_hi + 1, (block + 1) * bs);
    const float* next = nullptr;
    if (prefetch_cache != nullptr && block + 1 <= last_block) {
      next = prefetch_cache + static_cast<int64_t>(span.table[block + 1]) * bs * token_stride;
    }
    for (int64_t j = std::max(span.key_lo, block * bs); j < j_end; ++j) {
      if (next != nullptr) {
        const float* p = next + (j - block * bs) * token_stride;
        for (int64_t f = 0; f < row_floats; f += 16) __builtin_prefetch(p + f, 0, 2);  // to L2
      }
      visit(j, base + j);
    }
  }
}

// kD: head_dim fixed at compile time (register-resident vectors), or 0 for L.head_dim.
template <int64_t kD>
void attend(const Layout& L, const Item& it, Scratch& scratch) {
  const int64_t D = kD ? kD : L.head_dim, num_chunks = D / 8;
  const int64_t G = L.num_heads / L.num_kv_heads;
  const int64_t first_row = L.query_start_loc[it.seq];
  const int64_t q_len = L.query_start_loc[it.seq + 1] - first_row;
  const int64_t ctx = L.context_lens[it.seq];
  const int64_t token_stride = L.num_kv_heads * D;  // floats from one slot to the next
  const int64_t num_rows = it.row_end - it.row_begin, num_heads = it.head_end - it.head_begin;
  const int64_t vecs_per_row = num_heads * G, num_vecs = num_rows * vecs_per_row;
  const int64_t pos_first = ctx - q_len + it.row_begin;  // position of the tile's first row
  Span span{L.block_tables + it.seq * L.table_stride,
            L.window > 0 ? std::max<int64_t>(0, pos_first - L.window + 1) : 0,
            pos_first + num_rows - 1, 0};
  span.stride = (span.key_hi - span.key_lo + 1 + 7) / 8 * 8;
  const int64_t first_block = span.key_lo / L.block_size, end_block = span.key_hi / L.block_size + 1;
  scratch.scores.resize(static_cast<size_t>(num_vecs * span.stride));
  scratch.queries.resize(static_cast<size_t>(num_vecs * D));
  float* const scores = scratch.scores.data();
  float* const queries = scratch.queries.data();
  for (int64_t r = 0; r < num_rows; ++r) {  // the item's query heads are contiguous in a row
    const float* src = L.query + (first_row + it.row_begin + r) * L.query_row_stride +
                       it.head_begin * G * D;
    for (int64_t i = 0; i < vecs_per_row * D; ++i) {
      queries[r * vecs_per_row * D + i] = src[i] * L.scale;
    }
  }
  // Vector v = (row, head, g): its KV head, its position, and its first visible key.
  auto kv_head = [&](int64_t v) { return it.head_begin + (v % vecs_per_row) / G; };
  auto position = [&](int64_t v) { return pos_first + v / vecs_per_row; };
  auto first_visible = [&](int64_t pos) {
    return L.window > 0 ? std::max<int64_t>(0, pos - L.window + 1) : int64_t{0};
  };

  // Scores q . k of the visible keys.
  for (int64_t tile = first_block; tile < end_block; tile += kBlocksPerTile) {
    const int64_t tile_end = std::min(end_block, tile + kBlocksPerTile);
    for (int64_t v = 0; v < num_vecs; ++v) {
      vec8 q[kMaxChunks];
      for (int64_t c = 0; c < num_chunks; ++c) q[c] = load8(queries + v * D + c * 8);
      const int64_t pos = position(v), lo = first_visible(pos);
      const float* keys = L.k_cache + kv_head(v) * D;
      float* row = scores + v * span.stride - span.key_lo;
      const float* prefetch = v == 0 ? L.k_cache + it.head_begin * D : nullptr;  // once per tile
      for_keys(L, span, tile, tile_end, [&](int64_t j, int64_t slot) {
        if (j < lo || j > pos) return;
        const float* k = keys + slot * token_stride;
        vec8 a = {}, b = {};
        for (int64_t c = 0; c + 1 < num_chunks; c += 2) {
          a += q[c] * load8(k + c * 8);
          b += q[c + 1] * load8(k + c * 8 + 8);
        }
        if (num_chunks % 2) a += q[num_chunks - 1] * load8(k + (num_chunks - 1) * 8);
        row[j] = sum8(a + b);
      }, prefetch, num_heads * D);
    }
  }

  // Softmax over each vector's visible keys; every other score of the span becomes 0.
  std::vector<float> inverse_sums(static_cast<size_t>(num_vecs));
  for (int64_t v = 0; v < num_vecs; ++v) {
    float* row = scores + v * span.stride;
    const int64_t lo = first_visible(position(v)) - span.key_lo;
    const int64_t hi = position(v) - span.key_lo;  // inclusive
    float max_score = row[lo];
    for (int64_t i = lo + 1; i <= hi; ++i) max_score = std::max(max_score, row[i]);
    const int64_t lo8 = lo / 8 * 8, end8 = (hi + 8) / 8 * 8;  // whole chunks around lo .. hi
    std::fill(row + lo8, row + lo, max_score);
    std::fill(row + hi + 1, row + end8, max_score);
    for (int64_t i = lo8; i < end8; i += 8) store8(row + i, exp8(load8(row + i) - max_score));
    std::fill(row, row + lo, 0.0f);
    std::fill(row + hi + 1, row + span.stride, 0.0f);
    vec8 sum = {};
    for (int64_t i = lo8; i < end8; i += 8) sum += load8(row + i);
    inverse_sums[v] = 1.0f / sum8(sum);
  }

  // Outputs: the score-weighted sum of the values, accumulated tile by tile.
  for (int64_t v = 0; v < num_vecs; ++v) {
    float* out = L.out + (first_row + it.row_begin + v / vecs_per_row) * L.num_heads * D +
                 (it.head_begin * G + v % vecs_per_row) * D;
    for (int64_t c = 0; c < num_chunks; ++c) store8(out + c * 8, vec8{});
  }
  for (int64_t tile = first_block; tile < end_block; tile += kBlocksPerTile) {
    const int64_t tile_end = std::min(end_block, tile + kBlocksPerTile);
    for (int64_t v = 0; v < num_vecs; ++v) {
      float* out = L.out + (first_row + it.row_begin + v / vecs_per_row) * L.num_heads * D +
                   (it.head_begin * G + v % vecs_per_row) * D;
      vec8 o[kMaxChunks];
      for (int64_t c = 0; c < num_chunks; ++c) o[c] = load8(out + c * 8);
      const float* values = L.v_cache + kv_head(v) * D;
      const float* row = scores + v * span.stride - span.key_lo;
      const float* prefetch = v == 0 ? L.v_cache + it.head_begin * D : nullptr;  // once per tile
      for_keys(L, span, tile, tile_end, [&](int64_t j, int64_t slot) {
        const float p = row[j];
        if (p == 0.0f) return;
        const float* value = values + slot * token_stride;
        for (int64_t c = 0; c < num_chunks; ++c) o[c] += p * load8(value + c * 8);
      }, prefetch, num_heads * D);
      const float inverse = tile_end == end_block ? inverse_sums[v] : 1.0f;
      for (int64_t c = 0; c < num_chunks; ++c) store8(out + c * 8, o[c] * inverse);
    }
  }
}

// Checks that sequence b's rows and blocks lie inside the tensors the kernel will read and write.
inline bool valid_sequence(const Layout& L, int64_t b, int64_t num_seqs, int64_t num_tokens,
                    int64_t num_blocks) {
  if (b < 0 || b >= num_seqs) return false;
  const int64_t first = L.query_start_loc[b], end = L.query_start_loc[b + 1];
  const int64_t ctx = L.context_lens[b];
  if (first < 0 || end > num_tokens || end - first < 1 || ctx < end - first) return false;
  const int64_t blocks = (ctx + L.block_size - 1) / L.block_size;
  if (blocks > L.table_stride) return false;
  const int32_t* table = L.block_tables + b * L.table_stride;
  for (int64_t i = 0; i < blocks; ++i) {
    if (table[i] < 0 || table[i] >= num_blocks) return false;
  }
  return true;
}

}  // namespace tiergate::paged
