"""How large the KV cache is, where that figure came from, and the memory it lives in.

By default the cache takes a share of the memory the engine may use once its model is
loaded (vLLM's `gpu_memory_utilization`): on CUDA, a fraction of the device's memory less
what is already in use and a reserve for one step's activations; on a CPU, a fraction of
the RAM the system reports available. It never takes more than `max_num_seqs` sequences of
`max_model_len` tokens can fill (more would never be used). A byte count given by the
operator wins over all of it. A fixed default (256 MiB whatever the machine) left 32
requests of the offline workload on the default model waiting 6.3 s for blocks (time to
first token, p50) on a 24 GiB host where 1.5 GiB gave 0.4 s.

On a CPU the cache is an anonymous mapping: its pages read as zeros and are committed as
blocks are first written, so a large cache costs the memory its requests use, not its size,
until they fill it.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

import torch

from engine.config import KV_CACHE_DTYPES
from engine.errors import ConfigError

__all__ = [
    "DEFAULT_CPU_MEMORY_FRACTION",
    "DEFAULT_CUDA_MEMORY_FRACTION",
    "KVCacheSize",
    "allocate_kv_tensor",
    "available_memory_bytes",
    "kv_cache_dtype",
    "kv_cache_size",
]

DEFAULT_CUDA_MEMORY_FRACTION = 0.9  # of the device's memory, what is in use counted
DEFAULT_CPU_MEMORY_FRACTION = 0.25  # of the RAM available once the model is loaded
# fp8 caches: on CUDA devices that convert float8 E4M3 (compute capability 8.9: Ada, Hopper
# and later), through the Triton attention kernels.
_FP8_CAPABILITY = (8, 9)


@dataclass(frozen=True)
class KVCacheSize:
    """The KV cache's budget in bytes, and how it was chosen (for the start-up log)."""

    num_bytes: int
    source: str


def available_memory_bytes(device: torch.device) -> tuple[int, int]:
    """(bytes the engine may still take, bytes of the whole memory) on device: a CUDA
    device's free and total memory; on a CPU, MemAvailable and MemTotal (the kernel's
    estimate of what can be allocated without swapping)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)
    fields: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                name, _, value = line.partition(":")
                fields[name] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if "MemAvailable" in fields and "MemTotal" in fields:
        return fields["MemAvailable"], fields["MemTotal"]
    pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return pages, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_cache_size(
    device: torch.device,
    *,
    requested_bytes: int | None,
    memory_fraction: float | None,
    most_useful_bytes: int,
    memory_scale: float = 1.0,
    reserve_bytes: int,
) -> KVCacheSize:
    """The cache's budget: requested_bytes when given, else memory_fraction (the device's
    default when None) times memory_scale (this engine's part where several share the device)
    of the memory the engine may use, less reserve_bytes (what the model
    will still allocate: activations, a second copy of its weights), at most
    most_useful_bytes (max_num_seqs x max_model_len tokens)."""
    if requested_bytes is not None:
        return KVCacheSize(requested_bytes, "--kv-cache-bytes")
    on_cuda = device.type == "cuda"
    fraction = memory_scale * (memory_fraction if memory_fraction is not None else (
        DEFAULT_CUDA_MEMORY_FRACTION if on_cuda else DEFAULT_CPU_MEMORY_FRACTION))
    if not 0 < fraction <= 1:
        raise ConfigError(f"the KV cache's memory fraction must be in (0, 1], got {fraction}")
    available, total = available_memory_bytes(device)
    if on_cuda:
        # The device's fraction, less what it holds already (weights, buffers) and a step's
        # activations: what vLLM's gpu_memory_utilization means.
        budget = int(fraction * total) - (total - available) - reserve_bytes
        where = (f"{fraction:g} of the device's {_gib(total)} less {_gib(total - available)} "
                 f"in use and {_gib(reserve_bytes)} for activations")
    else:
        budget = int(fraction * max(0, available - reserve_bytes))
        where = f"{fraction:g} of {_gib(available - reserve_bytes)} of RAM available"
        if reserve_bytes:
            where += f" once the model has taken {_gib(reserve_bytes)} more"
    if budget >= most_useful_bytes:
        return KVCacheSize(most_useful_bytes,
                           f"max_num_seqs x max_model_len tokens, within {where}")
    if budget <= 0:
        raise ConfigError(
            f"no memory left for the KV cache ({where}): set --kv-cache-bytes or free memory")
    return KVCacheSize(budget, where)


def kv_cache_dtype(option: str, device: torch.device, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype for --kv-cache-dtype `option` on `device`; ConfigError where that
    device cannot hold it."""
    if option == "auto":
        return model_dtype
    if option != "fp8":
        raise ConfigError(f"kv_cache_dtype {option!r}: one of {', '.join(KV_CACHE_DTYPES)}")
    if device.type != "cuda":
        raise ConfigError("an fp8 KV cache is served on CUDA only (the CPU kernels read the "
                          "model's dtype): use --kv-cache-dtype auto")
    capability = torch.cuda.get_device_capability(device)
    if capability < _FP8_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ConfigError(f"an fp8 KV cache needs compute capability 8.9 or later; {name} has "
                          f"{capability[0]}.{capability[1]}")
    return torch.float8_e4m3fn


def allocate_kv_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A zeroed tensor for K or V. On a CPU, over an anonymous mapping whose pages are
    committed when first written (zero until then, as the kernel guarantees): a cache
    sized for the worst case holds only what its blocks have been used for."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_elements = 1
    for size in shape:
        num_elements *= size
    num_bytes = num_elements * torch.empty(0, dtype=dtype).element_size()
    if num_bytes == 0:
        return torch.zeros(shape, dtype=dtype)
    mapping = mmap.mmap(-1, num_bytes)  # the tensor keeps it alive
    return torch.frombuffer(mapping, dtype=dtype).view(shape)


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 30):.2f} GiB"
