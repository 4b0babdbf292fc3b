"""The runner's adapters: loaded on the host on first use (LRU, pinned ones kept), placed in
the model's device slots for the steps that use them.

Two levels, as S-LoRA and vLLM keep them: `max_cpu_loras` adapters read and fused on the host
(`LoraWeights` in the decoder's layout), and `max_loras` slots on the device that one step's
adapters occupy (`engine.models.lora.LoraSlots`). The scheduler never puts more distinct
adapters in a step than there are slots; a step's adapter without a slot takes the slot the
fewest recent steps used (never one of this step's). On the CPU a slot holds the host copy
itself; on an accelerator it holds a copy on the device.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from engine.checkpoints.lora_adapter import AdapterError, read_lora_adapter
from engine.config import LoraConfig
from engine.models.config import ModelConfig
from engine.models.lora import LoraSlots, LoraWeights
from engine.types import LoraRequest

__all__ = ["LoraCache"]


def _out_features(config: ModelConfig) -> dict[str, int]:
    i, e = config.intermediate_size, config.hidden_size
    return {"q_proj": config.q_size, "k_proj": config.kv_size, "v_proj": config.kv_size,
            "o_proj": e, "gate_proj": i, "up_proj": i, "down_proj": e}


class LoraCache:
    """Adapters on the host and in the device slots of one model."""

    def __init__(self, model_config: ModelConfig, config: LoraConfig, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.model_config = model_config
        self.config = config
        self.device, self.dtype = device, dtype
        self.slots = LoraSlots(config.max_loras, device)
        self._host: OrderedDict[str, LoraWeights] = OrderedDict()  # least recent first
        self._ranks: dict[str, int] = {}  # adapter name -> its largest rank
        self._pinned: set[str] = set()
        self._slot_of: dict[str, int] = {}
        self._slot_names: list[str | None] = [None] * config.max_loras
        self._slot_used = [0] * config.max_loras  # the step that last used each slot
        self._num_steps = 0

    def load(self, lora: LoraRequest, pin: bool = False) -> None:
        """Have the adapter on the host (read and checked on a miss); raises AdapterError."""
        if self.config.max_loras == 0:
            raise AdapterError("this engine serves no LoRA adapters (max_loras is 0)")
        if pin:
            self._pinned.add(lora.name)
        if lora.name in self._host:
            self._host.move_to_end(lora.name)
            return
        adapter = read_lora_adapter(lora.path, self.model_config, self.config.max_lora_rank)
        layers = [{name: (t.a, t.b) for name, t in layer.items()} for layer in adapter.layers]
        host_device = torch.device("cpu")
        self._host[lora.name] = LoraWeights.fuse(layers, _out_features(self.model_config),
                                                 self.dtype, host_device)
        self._ranks[lora.name] = adapter.rank
        self._evict_host()

    def rank(self, name: str) -> int:
        """The largest rank of a loaded adapter."""
        return self._ranks[name]

    def unpin(self, name: str) -> None:
        self._pinned.discard(name)
        self._evict_host()

    def _evict_host(self) -> None:
        in_slots = set(self._slot_of)
        for name in list(self._host):
            if len(self._host) <= self.config.max_cpu_loras:
                return
            if name not in self._pinned and name not in in_slots:
                del self._host[name]
                del self._ranks[name]

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
            if old is not None:
                del self._slot_of[old]
            self.load(lora)  # a host miss reads it again (it was evicted meanwhile)
            weights = self._host[lora.name]
            if self.device.type != "cpu":
                weights = LoraWeights([
                    {p: type(m)(m.a_t.to(self.device, non_blocking=True),
                                m.b_t.to(self.device, non_blocking=True))
                     for p, m in layer.items()}
                    for layer in weights.layers
                ])
            self.slots.weights[slot] = weights
            self._slot_names[slot] = lora.name
            self._slot_of[lora.name] = slot
        self._slot_used[slot] = self._num_steps
        return slot
