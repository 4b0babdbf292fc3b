"""Small host tables on the device without waiting for it.

A plain host-to-device copy from pageable memory waits for the work already queued on the
device: the forward of the step being sampled, and under async scheduling the step before.
Through pinned memory the copy is queued like the rest and the host goes on.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["to_device_async"]


def to_device_async(
    values: Sequence[int] | Sequence[float] | Sequence[tuple[float, ...]] | np.ndarray,
    device: torch.device,
    dtype: torch.dtype = torch.int64,
) -> torch.Tensor:
    """values as a tensor on device; on CUDA through pinned memory, without a wait. An array
    is converted to dtype on the host; on the CPU the tensor may share its memory."""
    pinned = device.type == "cuda"
    if isinstance(values, np.ndarray):
        host = torch.from_numpy(np.ascontiguousarray(values))
        if host.dtype != dtype:
            host = host.to(dtype)
        if pinned:
            host = host.pin_memory()
    else:
        host = torch.tensor(values, dtype=dtype, pin_memory=pinned)
    if device.type == "cpu":
        return host
    return host.to(device, non_blocking=True)
