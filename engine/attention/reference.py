"""Paged attention in plain PyTorch: the CPU path, and the reference the Triton kernels match.

The cache layout is [num_blocks, block_size, Hkv, D] per layer. Sequence b owns the query rows
query_start_loc[b]:query_start_loc[b+1]: the last q_len of its context_lens[b] tokens, whose
K/V are already in the cache. Attention is causal (a row sees keys up to its own position) and,
with a sliding window W, sees only the W newest of those keys (itself included, as HF does).

Without a fused kernel each sequence's blocks must be gathered into contiguous memory, so the
cost is memory traffic. `plan_attention` does the host-side work once per step (the layers of
one forward share it): decodes of similar length are batched into padded groups (one gather and
two batched matmuls per group), prefill chunks run one sequence at a time through SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

__all__ = ["AttentionPlan", "paged_attention", "paged_attention_planned", "plan_attention",
           "write_kv"]

# Cost model of a padded decode group, in units of one (sequence, key) pair gathered and
# attended: a group costs GROUP_OVERHEAD + num_seqs * padded_len. The overhead is the host time
# of a group's ~10 tensor ops expressed in pairs (measured on a 2-core CPU).
GROUP_OVERHEAD = 2048


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
    # (kind, index, sliding_window) -> additive or boolean mask, built on first use.
    masks: dict[tuple[str, int, int | None], torch.Tensor] = field(default_factory=dict)


def plan_attention(
    block_tables: torch.Tensor,  # int32[B, max_blocks_per_seq]
    query_start_loc: torch.Tensor,  # int32[B + 1]
    context_lens: torch.Tensor,  # int32[B]
    block_size: int,
) -> AttentionPlan:
    """Split the batch into padded decode groups and per-sequence prefills."""
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    device = block_tables.device
    tables = block_tables.to(torch.int64)
    decodes: list[int] = []
    prefills: list[_PrefillSeq] = []
    for seq, ctx in enumerate(lens):
        num_rows = starts[seq + 1] - starts[seq]
        assert 1 <= num_rows <= ctx, "every sequence needs 1..context_len query rows"
        if num_rows == 1:
            decodes.append(seq)
        else:
            num_blocks = -(-ctx // block_size)
            prefills.append(_PrefillSeq(starts[seq], num_rows, tables[seq, :num_blocks], ctx))
    groups = []
    for members in _group_by_length(decodes, lens):
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
    return AttentionPlan(starts[-1], block_size, groups, prefills)


def _group_by_length(seqs: list[int], lens: list[int]) -> list[list[int]]:
    """Partition sequences into groups minimising sum(GROUP_OVERHEAD + size * longest).

    Sorted by length the optimal groups are contiguous runs, found by a small dynamic program.
    Groups keep ascending sequence order, so a run of decodes keeps contiguous query rows.
    """
    if not seqs:
        return []
    order = sorted(seqs, key=lambda s: lens[s])
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[i]: cost of grouping order[:i]
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        longest = lens[order[end - 1]]
        for start in range(end):
            cost = best[start] + GROUP_OVERHEAD + (end - start) * longest
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
    block_tables: torch.Tensor,  # int32[B, max_blocks_per_seq]
    query_start_loc: torch.Tensor,  # int32[B + 1]
    context_lens: torch.Tensor,  # int32[B]
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [T, H, D]
    """Causal attention of each sequence's last q_len tokens over its cached context."""
    plan = plan_attention(block_tables, query_start_loc, context_lens, k_cache.shape[1])
    return paged_attention_planned(query, k_cache, v_cache, plan, scale, sliding_window)


def paged_attention_planned(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    plan: AttentionPlan,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [T, H, D]
    """paged_attention over a plan made by plan_attention for the same batch."""
    assert query.shape[0] == plan.num_rows, "plan made for another batch"
    out = torch.empty_like(query)
    for index, group in enumerate(plan.decode_groups):
        _decode_group(query, k_cache, v_cache, plan, index, group, scale, sliding_window, out)
    for index, seq in enumerate(plan.prefills):
        _prefill_seq(query, k_cache, v_cache, plan, index, seq, scale, sliding_window, out)
    return out


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
    if group.rows is None:
        q = query[group.row_start : group.row_start + num_seqs]  # [Bg, H, D]
    else:
        q = query.index_select(0, group.rows)
    q = q.view(num_seqs, num_kv_heads, num_groups, head_dim)  # [Bg, Hkv, G, D]
    # [Bg * nblk, bs, Hkv, D] -> [Bg, Hkv, Lp, D]: one gather, one transposing copy each.
    shape = (num_seqs, padded_len, num_kv_heads, head_dim)
    k = k_cache.index_select(0, group.block_ids).view(shape).transpose(1, 2).contiguous()
    v = v_cache.index_select(0, group.block_ids).view(shape).transpose(1, 2).contiguous()
    bias = _decode_bias(plan, index, group, padded_len, sliding_window, query)  # [Bg, 1, 1, Lp]
    scores = torch.matmul(q, k.transpose(2, 3))  # [Bg, Hkv, G, Lp]
    scores = torch.add(bias, scores, alpha=scale)
    probs = torch.softmax(scores, dim=-1)
    result = torch.matmul(probs, v).view(num_seqs, -1, head_dim)  # [Bg, H, D]
    if group.rows is None:
        out[group.row_start : group.row_start + num_seqs] = result
    else:
        out.index_copy_(0, group.rows, result)


def _decode_bias(
    plan: AttentionPlan,
    index: int,
    group: _DecodeGroup,
    padded_len: int,
    sliding_window: int | None,
    query: torch.Tensor,
) -> torch.Tensor:  # [Bg, 1, 1, Lp], 0 where a key is visible, -inf elsewhere
    key = ("decode", index, sliding_window)
    bias = plan.masks.get(key)
    if bias is None:
        pos = torch.arange(padded_len, device=query.device)[None, :]  # [1, Lp]
        ctx = group.context_lens[:, None]  # [Bg, 1]
        hidden = pos >= ctx
        if sliding_window is not None:
            hidden |= pos < ctx - sliding_window
        bias = torch.zeros(hidden.shape, dtype=query.dtype, device=query.device)
        bias.masked_fill_(hidden, float("-inf"))
        bias = bias.view(group.num_seqs, 1, 1, padded_len)
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
