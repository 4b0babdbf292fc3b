// Paged attention for the CPU: reads K and V where they lie in the block cache (no gather).
//
// Built at first use by engine/attention/cpu_kernel.py (g++ -O3 -march=native -fopenmp) and
// called through ctypes, so it needs no torch headers. Same contract as
// engine/attention/reference.py: sequence b owns query rows query_start_loc[b] ..
// query_start_loc[b+1]-1, the last q_len of its context_lens[b] tokens; a row at position p sees
// keys max(0, p - window + 1) .. p (window 0: no window). float32; head_dim a multiple of 8, at
// most 256.
//
// Work items are (sequence, tile of up to kRowTile query rows, range of KV heads), spread over the
// OpenMP threads (torch's own pool: the library links the libgomp torch has loaded). Items take
// all KV heads, so that a token's K and V rows are fetched whole and in order, unless there are
// too few items to keep the threads busy. Within an item, each query vector (row, query head)
// walks the keys of its KV head with its query, or its output accumulator, held in registers;
// keys are taken a tile of blocks at a time so that the vectors sharing them (the G query heads
// of a KV head under GQA, the item's other heads and rows) find them in cache. Softmax is exact:
// the scores of the whole span, one max, then the weighted sum of the values.

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "paged_attention.h"

using namespace tiergate::paged;  // NOLINT: the shared attention helpers

// Attends the query rows of sequences seq_ids[0 .. num_selected-1] (all num_seqs sequences when
// seq_ids is null) into out; other rows of out are left as they are. Returns 0, or -1 without
// touching out when a selected sequence's rows or blocks fall outside the given sizes.
extern "C" int tiergate_paged_attention_f32(
    const float* query, int64_t query_row_stride, int64_t num_tokens, const float* k_cache,
    const float* v_cache, int64_t num_blocks, const int32_t* block_tables, int64_t table_stride,
    const int32_t* query_start_loc, const int32_t* context_lens, int64_t num_seqs,
    const int32_t* seq_ids, int64_t num_selected, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, float scale, int64_t window, float* out) {
  const Layout layout{query,        query_row_stride, k_cache,         v_cache,
                      block_tables, table_stride,     query_start_loc, context_lens,
                      num_heads,    num_kv_heads,     head_dim,        block_size,
                      scale,        window,           out};
  const int64_t count = seq_ids == nullptr ? num_seqs : num_selected;
  int64_t num_tiles = 0;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t b = seq_ids == nullptr ? i : seq_ids[i];
    if (!valid_sequence(layout, b, num_seqs, num_tokens, num_blocks)) return -1;
    num_tiles += (query_start_loc[b + 1] - query_start_loc[b] + kRowTile - 1) / kRowTile;
  }
  // Whole token rows per item, unless that leaves fewer than kItemsPerThread items per thread.
  const int64_t heads_per_item =
      num_tiles >= kItemsPerThread * omp_get_max_threads() ? num_kv_heads : 1;
  std::vector<Item> items;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t b = seq_ids == nullptr ? i : seq_ids[i];
    const int64_t q_len = query_start_loc[b + 1] - query_start_loc[b];
    for (int64_t row = 0; row < q_len; row += kRowTile) {
      for (int64_t h = 0; h < num_kv_heads; h += heads_per_item) {
        items.push_back({b, row, std::min(row + kRowTile, q_len), h,
                         std::min(h + heads_per_item, num_kv_heads)});
      }
    }
  }
  auto run = head_dim == 64 ? attend<64> : head_dim == 128 ? attend<128> : attend<0>;
  const int64_t num_items = static_cast<int64_t>(items.size());
#pragma omp parallel
  {
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i) run(layout, items[i], scratch);
  }
  return 0;
}
