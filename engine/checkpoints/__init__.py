"""Checkpoints in other shapes than the engine's: GGUF files (tensors, rope factors, tokenizer)
read into HF-shaped ones, and the random-weight demo model written as one.

May import models, text and the neutral modules.
"""

from engine.checkpoints.demo_model import write_demo_model
from engine.checkpoints.gguf_checkpoint import GGUFCheckpoint
from engine.checkpoints.lora_adapter import AdapterError, LoraAdapter, read_lora_adapter

__all__ = [
    "AdapterError",
    "GGUFCheckpoint",
    "LoraAdapter",
    "read_lora_adapter",
    "write_demo_model",
]
