"""The runner's adapters: loaded on the host on first use (LRU, pinned ones kept), placed in
the model's device slots for the steps that use them.

An adapter is read, checked and fused on a loader thread (`prepare`), never on the step's:
reading a rank-16 adapter of the default model (20 MB) takes a large share of a second on a
small CPU, which a step must not wait for. Each request on an adapter holds it on the host
from `prepare` to `release`, so the adapters of waiting and running requests are never
evicted; the others leave least recently used first past `max_cpu_loras`.

Two levels, as S-LoRA and vLLM keep them: `max_cpu_loras` adapters read and fused on the host
(`LoraWeights` in the decoder's layout), and `max_loras` slots on the device that one step's
adapters occupy (`engine.models.lora.LoraSlots`). The scheduler never puts more distinct
adapters in a step than there are slots; a step's adapter without a slot takes the slot the
fewest recent steps used (never one of this step's). On the CPU a slot holds the host copy
itself; on an accelerator it holds a copy on the device.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from engine.checkpoints.lora_adapter import read_lora_adapter
from engine.config import LoraConfig
from engine.models.config import ModelConfig
from engine.models.lora import LoraSlots, LoraWeights, SlotKernels, target_shapes
from engine.types import LoraRequest

__all__ = ["LoraCache"]


def _out_features(config: ModelConfig) -> dict[str, int]:
    return {name: out for name, (_, out) in target_shapes(config).items()}


def _yield_to_steps() -> None:
    """The loader thread runs at the lowest CPU priority (Linux: a thread's nice value is its
    own): on a small CPU its reads take what the steps leave, not a share of their cores."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


@dataclass(frozen=True)
class _Loaded:
    weights: LoraWeights  # on the host, in the decoder's layout
    rank: int  # its largest rank
    flops_per_token: float  # what its update adds to each token


class LoraCache:
    """Adapters on the host and in the device slots of one model. `prepare` and `release`
    may be called from any thread; the rest from the step's."""

    def __init__(self, model_config: ModelConfig, config: LoraConfig, device: torch.device,
                 dtype: torch.dtype, kernels: SlotKernels | None = None) -> None:
        """kernels: apply the slots' updates with them (CUDA: the Triton SGMV kernels, which
        keep their own device copy of each slot)."""
        self.model_config = model_config
        self.config = config
        self.device, self.dtype = device, dtype
        self.slots = LoraSlots(config.max_loras, device, kernels)
        # The host's adapters, least recently used first; what the lock guards, with the holds
        # and the loads under way.
        self._host: OrderedDict[str, _Loaded] = OrderedDict()
        self._holds: dict[str, int] = {}  # adapter name -> requests holding it
        self._loading: dict[str, concurrent.futures.Future[float]] = {}
        self._lock = threading.Lock()
        self._loader: concurrent.futures.ThreadPoolExecutor | None = None  # made on first use
        self._pinned: set[str] = set()
        self._slot_of: dict[str, int] = {}
        self._slot_names: list[str | None] = [None] * config.max_loras
        self._slot_used = [0] * config.max_loras  # the step that last used each slot
        self._num_steps = 0

    def prepare(self, lora: LoraRequest) -> concurrent.futures.Future[float]:
        """Have the adapter on the host and hold it there until `release`: a done future
        when it is there already, else one the loader thread completes. Its result is the
        FLOPs the adapter's update adds per token; its exception an AdapterError (the hold
        is taken all the same: release it). lora.pinned: never evict it, until a request
        comes with it unpinned."""
        with self._lock:
            self._holds[lora.name] = self._holds.get(lora.name, 0) + 1
            if lora.pinned:
                self._pinned.add(lora.name)
            else:
                self._pinned.discard(lora.name)  # evicted, if need be, at its release
            loaded = self._host.get(lora.name)
            if loaded is not None:
                self._host.move_to_end(lora.name)
                ready: concurrent.futures.Future[float] = concurrent.futures.Future()
                ready.set_result(loaded.flops_per_token)
                return ready
            loading = self._loading.get(lora.name)
            if loading is None:
                if self._loader is None:
                    self._loader = concurrent.futures.ThreadPoolExecutor(
                        1, thread_name_prefix="tiergate-lora-loader",
                        initializer=_yield_to_steps)
                loading = self._loading[lora.name] = self._loader.submit(self._load, lora)
            return loading

    def release(self, name: str) -> None:
        """A hold `prepare` took ends."""
        with self._lock:
            self._holds[name] -= 1
            if not self._holds[name]:
                del self._holds[name]
                self._evict_host()

    def _load(self, lora: LoraRequest) -> float:
        """Read, check and fuse the adapter (any thread), then put it on the host."""
        try:
            loaded = self._read(lora)
        except BaseException:
            with self._lock:
                del self._loading[lora.name]
            raise
        with self._lock:
            del self._loading[lora.name]
            self._host[lora.name] = loaded
            self._evict_host()
        return loaded.flops_per_token

    def _read(self, lora: LoraRequest) -> _Loaded:
        adapter = read_lora_adapter(lora.path, self.model_config, self.config.max_lora_rank)
        layers = [{name: (t.a, t.b) for name, t in layer.items()} for layer in adapter.layers]
        weights = LoraWeights.fuse(layers, _out_features(self.model_config), self.dtype,
                                   torch.device("cpu"))
        # Shrink and expand: 2 FLOPs per multiply-add, r * (in + out) of them per target.
        flops = float(sum(2 * t.a.shape[0] * (t.a.shape[1] + t.b.shape[0])
                          for layer in adapter.layers for t in layer.values()))
        return _Loaded(weights, adapter.rank, flops)

    def _evict_host(self) -> None:
        """Drop the least recently used adapters past max_cpu_loras, never one that is held,
        pinned or in a slot (the lock held)."""
        keep = self._pinned | self._holds.keys() | self._slot_of.keys()
        for name in list(self._host):
            if len(self._host) <= self.config.max_cpu_loras:
                return
            if name not in keep:
                del self._host[name]

    def bind_step(self, chunk_loras: Sequence[LoraRequest | None],
                  chunk_lengths: np.ndarray) -> None:
        """Bind the slots to a step: chunk i's tokens (chunk_lengths[i] of them) run on
        chunk_loras[i]'s adapter, or on the base model where it is None."""
        self._num_steps += 1
        slots_of_chunk = np.full(len(chunk_loras), -1, dtype=np.int64)
        for index, lora in enumerate(chunk_loras):
            if lora is not None:
                slots_of_chunk[index] = self._slot(lora, chunk_loras)
        if bool((slots_of_chunk < 0).all()):
            self.slots.bind(None)
            return
        self.slots.bind(np.repeat(slots_of_chunk, chunk_lengths))

    def _slot(self, lora: LoraRequest, step_loras: Sequence[LoraRequest | None]) -> int:
        slot = self._slot_of.get(lora.name)
        if slot is None:
            in_step = {other.name for other in step_loras if other is not None}
            free = [s for s, name in enumerate(self._slot_names) if name not in in_step]
            assert free, "a step with more distinct adapters than slots"
            slot = min(free, key=self._slot_used.__getitem__)
            old = self._slot_names[slot]
            with self._lock:
                loaded = self._host.get(lora.name)
                if loaded is not None:
                    self._host.move_to_end(lora.name)
            if loaded is None:  # only a caller that never prepared it: read here
                loaded = self._read(lora)
                with self._lock:
                    self._host[lora.name] = loaded
                    self._evict_host()
            weights = loaded.weights
            if self.device.type != "cpu" and self.slots.kernels is None:
                weights = LoraWeights([
                    {p: replace(m, a_t=m.a_t.to(self.device, non_blocking=True),
                                b_t=m.b_t.to(self.device, non_blocking=True))
                     for p, m in layer.items()}
                    for layer in weights.layers
                ])
            self.slots.set_slot(slot, weights)
            self._slot_names[slot] = lora.name
            with self._lock:  # the loader's eviction reads which adapters are in slots
                if old is not None:
                    del self._slot_of[old]
                self._slot_of[lora.name] = slot
        self._slot_used[slot] = self._num_steps
        return slot
