"""Supported architectures: one shared decoder, switched by a few flags per architecture."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchitectureSpec:
    """How one HF architecture differs from plain Llama."""

    architecture: str  # HF class name in config.json "architectures"
    model_type: str  # HF model_type
    always_qkv_bias: bool = False  # q/k/v biases regardless of attention_bias (Qwen2)
    has_qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    # Config key that must be true for sliding_window to apply (Qwen2/3 "use_sliding_window");
    # None: sliding_window applies whenever it is set (Mistral).
    window_switch: str | None = None


_SPECS = (
    ArchitectureSpec("LlamaForCausalLM", "llama"),
    ArchitectureSpec("MistralForCausalLM", "mistral"),
    ArchitectureSpec(
        "Qwen2ForCausalLM", "qwen2", always_qkv_bias=True, window_switch="use_sliding_window"
    ),
    ArchitectureSpec(
        "Qwen3ForCausalLM", "qwen3", has_qk_norm=True, window_switch="use_sliding_window"
    ),
)

ARCHITECTURES: dict[str, ArchitectureSpec] = {s.architecture: s for s in _SPECS}
_BY_MODEL_TYPE: dict[str, ArchitectureSpec] = {s.model_type: s for s in _SPECS}


def lookup_architecture(
    architectures: list[str], model_type: str | None
) -> ArchitectureSpec | None:
    """The spec for the first known name in `architectures`, else for `model_type`."""
    for name in architectures:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    return _BY_MODEL_TYPE.get(model_type or "")
