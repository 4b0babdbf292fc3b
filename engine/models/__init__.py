"""Decoder-only models (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache."""

from engine.models.batch import ForwardBatch
from engine.models.config import ModelConfig, ModelConfigError, RopeConfig
from engine.models.decoder import CausalLM, KVCache
from engine.models.lora import LoraSlots, LoraWeights
from engine.models.registry import ARCHITECTURES, ArchitectureSpec

__all__ = [
    "ARCHITECTURES",
    "ArchitectureSpec",
    "CausalLM",
    "ForwardBatch",
    "KVCache",
    "LoraSlots",
    "LoraWeights",
    "ModelConfig",
    "ModelConfigError",
    "RopeConfig",
]
