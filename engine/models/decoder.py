"""One decoder for Llama, Mistral, Qwen2 and Qwen3, over a paged KV cache (gpt-fast style).

Differences between architectures are flags of ModelConfig (biases, q/k norm, sliding windows).
Projections are fused at load time: q/k/v into one qkv_proj, gate/up into one gate_up_proj, so
each layer runs four matmuls. All tokens of a step form one flat batch [T, E].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import PagedAttention
from engine.models.batch import ForwardBatch
from engine.models.config import ModelConfig
from engine.models.rope import RotaryTable, apply_rope

# One layer's cache: (k_cache, v_cache), each [num_blocks, block_size, Hkv, D].
KVCache = tuple[torch.Tensor, torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Half precision: normalise in float32, round, then scale (HF's order of operations).
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.head_dim**-0.5
        self.sliding_window = config.sliding_windows[layer_index]
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.has_qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.has_o_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.has_qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.has_qk_norm else None

    def forward(
        self,
        x: torch.Tensor,  # [T, E]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D]
        slot_mapping: torch.Tensor,  # int64[T]
        kv_cache: KVCache,
        attention: PagedAttention,
    ) -> torch.Tensor:  # [T, E]
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) D]
        num_qk_heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, num_qk_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(qk[:, : self.num_heads])
            k = self.k_norm(qk[:, self.num_heads :])
            qk = torch.cat([q, k], dim=1)
        qk = apply_rope(qk, cos, sin)  # [T, H + Hkv, D], q and k rotated in one pass
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        k_cache, v_cache = kv_cache
        attention.write_kv(k, v, k_cache, v_cache, slot_mapping)
        out = attention.attend(q, k_cache, v_cache, self.scale, self.sliding_window)  # [T, H, D]
        return self.o_proj(out.view(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        bias = config.has_mlp_bias
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, E] -> [T, E]
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        gate, up = gate_up[:, : self.intermediate_size], gate_up[:, self.intermediate_size :]
        hidden = F.silu(gate, inplace=True).mul_(up)  # [T, I], a view into gate_up
        return self.down_proj(hidden)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,  # [T, E]
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache: KVCache,
        attention: PagedAttention,
    ) -> torch.Tensor:  # [T, E]
        h = self.self_attn(self.input_layernorm(x), cos, sin, slot_mapping, kv_cache, attention)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and lm_head; logits only for sampled rows."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.max_positions = max_positions
        self.rotary: RotaryTable | None = None

    def build_rotary_table(self) -> None:
        """Precompute cos/sin in the model's dtype and device; call after moving the model."""
        weight = self.embed_tokens.weight
        self.rotary = RotaryTable(
            self.config.rope,
            self.config.head_dim,
            self.max_positions,
            self.config.max_position_embeddings,
            weight.dtype,
            weight.device,
        )

    def forward(
        self, batch: ForwardBatch, kv_caches: list[KVCache], attention: PagedAttention
    ) -> torch.Tensor:  # float32[S, V], logits of rows batch.logits_indices
        """Run every token of the step; attention.prepare() must have bound the batch."""
        assert self.rotary is not None, "build_rotary_table() first"
        cos, sin = self.rotary.lookup(batch.positions)  # [T, 1, D] each
        x = self.embed_tokens(batch.input_ids)  # [T, E]
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, batch.slot_mapping, kv_cache, attention)
        x = self.norm(x.index_select(0, batch.logits_indices))  # [S, E]
        return self.lm_head(x).float()  # [S, V]
