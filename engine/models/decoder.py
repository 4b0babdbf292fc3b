"""One decoder for Llama, Mistral, Qwen2 and Qwen3, over a paged KV cache (gpt-fast style).

Differences between architectures are flags of ModelConfig (biases, q/k norm, sliding windows).
Projections are fused at load time: q/k/v into one qkv_proj, gate/up into one gate_up_proj, so
each layer runs four matmuls. All tokens of a step form one flat batch [T, E]. The residual
stream runs beside the layers' outputs (vLLM style), so that each norm can add it in the same
pass; on a float32 CPU model those norms, RoPE with the KV write, and SiLU-and-multiply can run
as fused C++ ops (engine.models.cpu_ops, switched on by CausalLM.use_fused_cpu_ops).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend
from engine.models import cpu_ops
from engine.models.batch import ForwardBatch
from engine.models.config import ModelConfig
from engine.models.lora import LoraSlots
from engine.models.rope import RotaryTable, apply_rope

# One layer's cache: (k_cache, v_cache), each [num_blocks, block_size, Hkv, D].
KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass
class RopeInputs:
    """One forward's rotary inputs, shared by every layer."""

    positions: torch.Tensor  # int64[T] position of each token
    table: RotaryTable  # cos/sin of every position (the fused CPU op reads rows by position)
    cos: torch.Tensor | None = None  # [T, 1, D] rows of table.cos at positions (torch path)
    sin: torch.Tensor | None = None  # [T, 1, D] rows of table.sin at positions (torch path)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = False  # the fused CPU op (set by CausalLM.use_fused_cpu_ops)
        self.fused_cuda = False  # the Triton add-and-norm (set by CausalLM.use_fused_cuda_ops)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T, E] each -> (normalised sum, sum)
        """norm(residual + x) and residual + x (the fused op adds into residual in place)."""
        if self.fused:
            return cpu_ops.rms_norm(x, self.weight, self.eps, residual), residual
        if self.fused_cuda:
            from engine.models.triton_add_norm import add_rms_norm

            return add_rms_norm(x, residual, self.weight, self.eps), residual
        residual = residual + x
        return self(residual), residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        if self.fused and x.is_contiguous():
            return cpu_ops.rms_norm(x.view(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
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
        self.fused = False  # RoPE and the KV write as one CPU op (CausalLM.use_fused_cpu_ops)
        self.layer_index = layer_index
        self.lora: LoraSlots | None = None  # adapters' updates (CausalLM.use_lora_slots)

    def forward(
        self,
        x: torch.Tensor,  # [T, E]
        rope: RopeInputs,
        kv_cache: KVCache,
        attention: AttentionBackend,
    ) -> torch.Tensor:  # [T, E]
        num_tokens = x.shape[0]
        h, h_kv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).contiguous()  # [T, (H + 2 Hkv) D]
        lora = self.lora
        if lora is not None and lora.active:
            lora.add(self.layer_index, "qkv", x, qkv)
        heads = qkv.view(num_tokens, h + 2 * h_kv, self.head_dim)  # q, k, v heads
        if self.q_norm is not None and self.k_norm is not None:
            heads[:, :h] = self.q_norm(heads[:, :h])
            heads[:, h : h + h_kv] = self.k_norm(heads[:, h : h + h_kv])
        k_cache, v_cache = kv_cache
        if self.fused:
            cpu_ops.rope_write_kv(qkv, h, h_kv, rope.positions, rope.table.cos, rope.table.sin,
                                  attention.metadata.slot_mapping, k_cache, v_cache)
            q = heads[:, :h]
        else:
            assert rope.cos is not None and rope.sin is not None
            qk = apply_rope(heads[:, : h + h_kv], rope.cos, rope.sin)  # q and k in one pass
            q = qk[:, :h]
            attention.write_kv(qk[:, h:], heads[:, h + h_kv :], k_cache, v_cache)
        out = attention.attend(q, k_cache, v_cache, self.scale, self.sliding_window)  # [T, H, D]
        flat = out.view(num_tokens, self.q_size)
        projected = self.o_proj(flat)
        if lora is not None and lora.active:
            lora.add(self.layer_index, "o", flat, projected)
        return projected


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.lora: LoraSlots | None = None  # adapters' updates (CausalLM.use_lora_slots)
        self.intermediate_size = config.intermediate_size
        bias = config.has_mlp_bias
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.fused = False  # SiLU-and-multiply as one CPU op (CausalLM.use_fused_cpu_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, E] -> [T, E]
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        lora = self.lora
        adapted = lora is not None and lora.active
        if adapted:
            assert lora is not None
            lora.add(self.layer_index, "gate_up", x, gate_up)
        if self.fused:
            hidden = cpu_ops.silu_and_mul(gate_up.contiguous())
        else:
            gate, up = gate_up[:, : self.intermediate_size], gate_up[:, self.intermediate_size :]
            hidden = F.silu(gate, inplace=True).mul_(up)  # [T, I], a view into gate_up
        out = self.down_proj(hidden)
        if adapted:
            assert lora is not None
            lora.add(self.layer_index, "down", hidden, out)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, layer_index)

    def forward(
        self,
        x: torch.Tensor,  # [T, E] the previous layer's output (the embeddings for the first)
        residual: torch.Tensor | None,  # [T, E] the residual stream before x; None: first layer
        rope: RopeInputs,
        kv_cache: KVCache,
        attention: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # this layer's output and the stream before it
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn(h, rope, kv_cache, attention)
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h), residual


class CausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and lm_head; logits only for sampled rows."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        # nn.Embedding, or a PanelEmbedding over a GGUF file's blocks
        self.embed_tokens: nn.Module = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # nn.Linear, or what the runner puts in its place (packed, or over the decode panels)
        self.lm_head: nn.Module = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.max_positions = max_positions
        self.rotary: RotaryTable | None = None
        self.fused_cpu_ops = False  # see use_fused_cpu_ops

    def build_rotary_table(self) -> None:
        """Precompute cos/sin in the model's dtype and device; call after moving the model."""
        weight = self.norm.weight  # a float parameter of every model (the embedding may be
        # quantized panels)
        self.rotary = RotaryTable(
            self.config.rope,
            self.config.head_dim,
            self.max_positions,
            self.config.max_position_embeddings,
            weight.dtype,
            weight.device,
        )

    def use_fused_cpu_ops(self) -> bool:
        """Run norms, RoPE with the KV write, and SiLU-and-multiply as fused CPU ops where the
        model can (float32 on the CPU, a C++ compiler present); returns whether it does."""
        weight = self.norm.weight
        self.fused_cpu_ops = cpu_ops.supports(self.config, weight.device, weight.dtype)
        for module in self.modules():
            if isinstance(module, RMSNorm | Attention | MLP):
                module.fused = self.fused_cpu_ops
        return self.fused_cpu_ops

    def use_lora_slots(self, slots: LoraSlots | None) -> None:
        """Every adapted product adds the updates of the adapters `slots` binds for a step
        (engine.models.lora); None: the base model only."""
        for module in self.modules():
            if isinstance(module, Attention | MLP):
                module.lora = slots

    def use_fused_cuda_ops(self, enabled: bool = True) -> None:
        """Residual add and RMSNorm as one Triton kernel (engine.models.triton_add_norm);
        the runner turns it on for CUDA, tests on the CPU under the Triton interpreter."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.fused_cuda = enabled

    def forward(
        self, batch: ForwardBatch, kv_caches: list[KVCache], attention: AttentionBackend
    ) -> torch.Tensor:  # float32[S, V], logits of rows batch.logits_indices
        """Run every token of the step; attention.prepare() must have bound the batch."""
        assert self.rotary is not None, "build_rotary_table() first"
        rope = RopeInputs(batch.positions, self.rotary)
        if not self.fused_cpu_ops:
            rope.cos, rope.sin = self.rotary.lookup(batch.positions)  # [T, 1, D] each
        x = self.embed_tokens(batch.input_ids)  # [T, E]
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, rope, kv_cache, attention)
        assert residual is not None, "a model has at least one layer"
        rows = batch.logits_indices
        x, _ = self.norm.add_and_norm(x.index_select(0, rows), residual.index_select(0, rows))
        return self.lm_head(x).float()  # [S, V]
