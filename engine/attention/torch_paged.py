"""Paged attention in plain PyTorch: the CPU path for prefill chunks (and for everything where
the C++ kernel does not apply), usable on any device.

The cache layout is [num_blocks, block_size, Hkv, D] per layer. Sequence b owns the query rows
query_start_loc[b]:query_start_loc[b+1]: the last q_len of its context_lens[b] tokens, whose
K/V are already in the cache. Attention is causal (a row sees keys up to its own position) and,
with a sliding window W, sees only the W newest of those keys (itself included, as HF does).

Without a fused kernel each sequence's blocks are gathered into contiguous memory first.
`plan_attention` does the host-side work once per step (the layers of one forward share it):
prefill chunks run one sequence at a time through SDPA; decodes of similar length are batched
into padded groups, each one gather of K and V into a buffer small enough to stay in the CPU's
cache and one SDPA call, the G query heads of a KV head acting as G query rows (no K/V repeat).

(Reading the cache in place with torch.sparse.sampled_addmm and torch.sparse.mm over a CSR
pattern of each head's key rows was tried: faster in isolation, slower end to end.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata, StepBinding

__all__ = [
    "AttentionPlan",
    "TorchPagedAttention",
    "paged_attention",
    "paged_attention_planned",
    "plan_attention",
    "write_kv",
]

# Cost model of a padded decode group, in units of one (sequence, key) pair gathered and
# attended: a group costs GROUP_OVERHEAD + num_seqs * padded_len. The overhead is the host time
# of a group's few tensor ops expressed in pairs, as measured on a CPU.
GROUP_OVERHEAD = 1024
# A group's gathered K and V stay under this many bytes, so that SDPA reads them back from the
# CPU's cache instead of memory (faster than one big group).
MAX_GROUP_BYTES = 4 << 20


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # int64[T]; block_id * block_size + offset; -1 skips the token
) -> None:
    """Write each token's K and V into its cache slot, in place."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


@dataclass
class _DecodeGroup:
    """Single-row sequences of similar context length, attended as one padded batch."""

    row_start: int  # first query row; rows row_start .. row_start+num_seqs-1 when contiguous
    rows: torch.Tensor | None  # int64[num_seqs] query rows; None when contiguous from row_start
    num_seqs: int
    block_ids: torch.Tensor  # int64[num_seqs * num_blocks] blocks of each sequence, row-major
    num_blocks: int  # blocks gathered per sequence (the longest sequence's)
    context_lens: torch.Tensor  # int64[num_seqs]


@dataclass
class _PrefillSeq:
    """A sequence with several query rows (a prefill chunk), attended on its own."""

    row_start: int  # its query rows are row_start .. row_start+num_rows-1
    num_rows: int
    block_ids: torch.Tensor  # int64[num_blocks] blocks covering its context
    context_len: int


@dataclass
class AttentionPlan:
    """Host-side layout of one step's attention, shared by every layer of the forward."""

    num_rows: int  # total query rows T
    block_size: int
    decode_groups: list[_DecodeGroup]
    prefills: list[_PrefillSeq]
    # int32[K] sequences left to a kernel (see plan_attention's kernel_max_pairs); their rows are
    # not in decode_groups or prefills. None when the plan covers every sequence.
    kernel_seq_ids: torch.Tensor | None = None
    # (kind, index, sliding_window) -> additive or boolean mask, built on first use.
    masks: dict[tuple[str, int, int | None], torch.Tensor] = field(default_factory=dict)
    # Gather buffers for K and V, [max group blocks, block_size, Hkv, D] each, reused by every
    # group of every layer; allocated on first use.
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None

    def gather_buffers(
        self, k_cache: torch.Tensor, num_blocks: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of num_blocks blocks of the K and V workspace."""
        if self.workspace is None:
            most = max((g.num_seqs * g.num_blocks for g in self.decode_groups), default=0)
            shape = (most, *k_cache.shape[1:])
            self.workspace = (k_cache.new_empty(shape), k_cache.new_empty(shape))
        return self.workspace[0][:num_blocks], self.workspace[1][:num_blocks]


def plan_attention(
    metadata: AttentionMetadata,
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] of any layer (layout and dtype)
    kernel_max_pairs: int | None = None,
) -> AttentionPlan:
    """Split the batch into padded decode groups and per-sequence prefills. With
    kernel_max_pairs, decodes and the sequences of at most kernel_max_pairs query rows x
    context tokens go to plan.kernel_seq_ids instead, for a kernel to attend."""
    block_tables, query_start_loc = metadata.block_tables, metadata.query_start_loc
    context_lens = metadata.context_lens
    block_size = k_cache.shape[1]
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    device = block_tables.device
    tables = block_tables.to(torch.int64)
    decodes: list[int] = []
    prefills: list[_PrefillSeq] = []
    kernel_seqs: list[int] = []
    for seq, ctx in enumerate(lens):
        num_rows = starts[seq + 1] - starts[seq]
        assert 1 <= num_rows <= ctx, "every sequence needs 1..context_len query rows"
        if kernel_max_pairs is not None and (num_rows == 1
                                             or num_rows * ctx <= kernel_max_pairs):
            kernel_seqs.append(seq)
        elif num_rows == 1:
            decodes.append(seq)
        else:
            num_blocks = -(-ctx // block_size)
            prefills.append(_PrefillSeq(starts[seq], num_rows, tables[seq, :num_blocks], ctx))
    groups = []
    # K + V bytes of one token in one layer.
    kv_bytes_per_token = 2 * k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()
    max_pairs = max(1, MAX_GROUP_BYTES // kv_bytes_per_token)
    for members in _group_by_length(decodes, lens, block_size, max_pairs):
        seqs = torch.tensor(members, dtype=torch.int64, device=device)
        num_blocks = -(-max(lens[s] for s in members) // block_size)
        rows = [starts[s] for s in members]
        is_contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
        groups.append(
            _DecodeGroup(
                row_start=rows[0],
                rows=None if is_contiguous else torch.tensor(rows, device=device),
                num_seqs=len(members),
                block_ids=tables.index_select(0, seqs)[:, :num_blocks].reshape(-1),
                num_blocks=num_blocks,
                context_lens=context_lens.to(torch.int64).index_select(0, seqs),
            )
        )
    kernel_seq_ids = (
        torch.tensor(kernel_seqs, dtype=torch.int32, device=device) if kernel_seqs else None
    )
    return AttentionPlan(starts[-1], block_size, groups, prefills, kernel_seq_ids)


def _group_by_length(
    seqs: list[int], lens: list[int], block_size: int, max_pairs: int
) -> list[list[int]]:
    """Partition sequences into groups minimising sum(GROUP_OVERHEAD + size * padded_longest),
    each group within max_pairs (sequence, key) pairs unless it is a single sequence.

    Sorted by length the optimal groups are contiguous runs, found by a small dynamic program.
    """
    if not seqs:
        return []
    order = sorted(seqs, key=lambda s: lens[s])
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[i]: cost of grouping order[:i]
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        padded = -(-lens[order[end - 1]] // block_size) * block_size
        for start in range(end - 1, -1, -1):
            size = end - start
            if size > 1 and size * padded > max_pairs:
                break
            cost = best[start] + GROUP_OVERHEAD + size * padded
            if cost < best[end]:
                best[end], cut[end] = cost, start
    groups = []
    end = n
    while end > 0:
        groups.append(sorted(order[cut[end] : end]))
        end = cut[end]
    return groups


def paged_attention(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [T, H, D]
    """Causal attention of each sequence's last q_len tokens over its cached context."""
    plan = plan_attention(metadata, k_cache)
    return paged_attention_planned(query, k_cache, v_cache, plan, scale, sliding_window)


def paged_attention_planned(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    plan: AttentionPlan,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,  # [T, H, D] to write into; rows of kernel_seq_ids are kept
) -> torch.Tensor:  # [T, H, D]
    """paged_attention over a plan made by plan_attention for the same batch."""
    assert query.shape[0] == plan.num_rows, "plan made for another batch"
    if out is None:
        assert plan.kernel_seq_ids is None, "this plan leaves sequences to a kernel"
        out = torch.empty_like(query)
    for index, group in enumerate(plan.decode_groups):
        _decode_group(query, k_cache, v_cache, plan, index, group, scale, sliding_window, out)
    for index, seq in enumerate(plan.prefills):
        _prefill_seq(query, k_cache, v_cache, plan, index, seq, scale, sliding_window, out)
    return out


def _group_queries(query: torch.Tensor, group: _DecodeGroup) -> torch.Tensor:  # [Bg, H, D]
    if group.rows is None:
        return query[group.row_start : group.row_start + group.num_seqs]
    return query.index_select(0, group.rows)


def _store(out: torch.Tensor, group: _DecodeGroup, result: torch.Tensor) -> None:
    if group.rows is None:
        out[group.row_start : group.row_start + group.num_seqs] = result
    else:
        out.index_copy_(0, group.rows, result)


def _decode_group(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    index: int,
    group: _DecodeGroup,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    num_seqs, padded_len = group.num_seqs, group.num_blocks * plan.block_size
    num_groups = query.shape[1] // num_kv_heads  # query heads per KV head
    q = _group_queries(query, group).view(num_seqs, num_kv_heads, num_groups, head_dim)
    # [Bg * nblk, bs, Hkv, D] gathered -> [Bg, Hkv, Lp, D] views (SDPA reads them strided).
    k_buffer, v_buffer = plan.gather_buffers(k_cache, group.block_ids.shape[0])
    torch.index_select(k_cache, 0, group.block_ids, out=k_buffer)
    torch.index_select(v_cache, 0, group.block_ids, out=v_buffer)
    shape = (num_seqs, padded_len, num_kv_heads, head_dim)
    k = k_buffer.view(shape).transpose(1, 2)
    v = v_buffer.view(shape).transpose(1, 2)
    bias = _decode_bias(plan, index, group, sliding_window, query)  # [Bg, 1, Lp]
    # The G query heads of a KV head act as G query rows: no K/V repeat for GQA.
    result = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.unsqueeze(1), scale=scale)
    _store(out, group, result.reshape(num_seqs, -1, head_dim))


def _decode_bias(
    plan: AttentionPlan,
    index: int,
    group: _DecodeGroup,
    sliding_window: int | None,
    query: torch.Tensor,
) -> torch.Tensor:  # [Bg, 1, Lp], 0 where a key is visible, -inf elsewhere
    key = ("decode", index, sliding_window)
    bias = plan.masks.get(key)
    if bias is None:
        padded_len = group.num_blocks * plan.block_size
        pos = torch.arange(padded_len, device=query.device)[None, :]  # [1, Lp]
        ctx = group.context_lens[:, None]  # [Bg, 1]
        hidden = pos >= ctx
        if sliding_window is not None:
            hidden |= pos < ctx - sliding_window
        bias = torch.zeros(hidden.shape, dtype=query.dtype, device=query.device)
        bias.masked_fill_(hidden, float("-inf"))
        bias = bias.view(group.num_seqs, 1, padded_len)
        plan.masks[key] = bias
    return bias


def _prefill_seq(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    index: int,
    seq: _PrefillSeq,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    ctx, num_rows = seq.context_len, seq.num_rows
    rows = slice(seq.row_start, seq.row_start + num_rows)
    q = query[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    k = k_cache.index_select(0, seq.block_ids).view(-1, num_kv_heads, head_dim)[:ctx]
    v = v_cache.index_select(0, seq.block_ids).view(-1, num_kv_heads, head_dim)[:ctx]
    k = k.transpose(0, 1).unsqueeze(0)  # [1, Hkv, ctx, D]
    v = v.transpose(0, 1).unsqueeze(0)
    if num_rows == ctx and sliding_window is None:
        result = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                enable_gqa=True)
    else:
        mask = _prefill_mask(plan, index, seq, sliding_window, query.device)
        result = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                enable_gqa=True)
    out[rows] = result[0].transpose(0, 1)  # [n, H, D]


def _prefill_mask(
    plan: AttentionPlan,
    index: int,
    seq: _PrefillSeq,
    sliding_window: int | None,
    device: torch.device,
) -> torch.Tensor:  # bool[n, ctx], True where row i may see key j
    key = ("prefill", index, sliding_window)
    mask = plan.masks.get(key)
    if mask is None:
        ctx, num_rows = seq.context_len, seq.num_rows
        row_pos = torch.arange(ctx - num_rows, ctx, device=device)[:, None]  # [n, 1]
        key_pos = torch.arange(ctx, device=device)[None, :]  # [1, ctx]
        mask = key_pos <= row_pos
        if sliding_window is not None:
            mask &= key_pos > row_pos - sliding_window
        plan.masks[key] = mask
    return mask


class TorchPagedAttention(StepBinding):
    """The PyTorch path as an attention backend: one plan per step, made at the first layer's
    attend (it needs the cache's layout) and shared by the others."""

    def __init__(self) -> None:
        super().__init__()
        self._plan: AttentionPlan | None = None

    def prepare(self, metadata: AttentionMetadata) -> None:
        super().prepare(metadata)
        self._plan = None

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor) -> None:
        write_kv(key, value, k_cache, v_cache, self.metadata.slot_mapping)

    def attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               scale: float, sliding_window: int | None) -> torch.Tensor:
        return paged_attention_planned(query, k_cache, v_cache, self.plan(k_cache), scale,
                                       sliding_window)

    def plan(self, k_cache: torch.Tensor) -> AttentionPlan:
        """The bound step's plan (made once)."""
        if self._plan is None:
            self._plan = self._make_plan(k_cache)
        return self._plan

    def _make_plan(self, k_cache: torch.Tensor) -> AttentionPlan:
        return plan_attention(self.metadata, k_cache)
