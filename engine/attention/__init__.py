"""Paged attention behind one backend type (`AttentionBackend`): a model binds each step's
`AttentionMetadata` once, then every layer writes its K/V and attends through the backend.

Files: backend.py (the protocol, and the choice by device), metadata.py (the step's layout),
torch_paged.py (plain PyTorch), cpu_backend.py with cpu_kernel.py and
cpu_paged_attention.cpp (the C++ decode kernel; cpp_build.py compiles it at first use),
triton_backend.py with triton_decode.py, triton_prefill.py, triton_kv_write.py and the
helpers they share (triton_paged_tile.py). Triton is imported only on CUDA.
"""

from engine.attention.backend import AttentionBackend, attention_backend
from engine.attention.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "attention_backend"]
