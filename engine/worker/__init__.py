"""Runs a scheduled step of a real model: `TorchModelRunner` on the step every runner shares
(`BatchRunner`), the input batch it keeps, graph inputs and CUDA graphs, the KV cache's
memory, the FLOPs a step costs, the label of the weights' format.

May import sample, models, attention, checkpoints and the neutral modules.
"""

from engine.worker.batch_runner import BatchRunner, given_num_kv_blocks
from engine.worker.flops import FlopsCounter, forward_flops
from engine.worker.input_batch import InputBatch, StepInputs
from engine.worker.kv_memory import KVCacheSize, kv_cache_size
from engine.worker.lora_cache import LoraCache
from engine.worker.model_runner import TorchModelRunner
from engine.worker.queued_step import QueuedStep, StepEvents
from engine.worker.weight_format import MAX_WEIGHT_FORMAT_LABEL_LENGTH, weight_format_label

__all__ = [
    "MAX_WEIGHT_FORMAT_LABEL_LENGTH",
    "BatchRunner",
    "FlopsCounter",
    "InputBatch",
    "KVCacheSize",
    "LoraCache",
    "QueuedStep",
    "StepEvents",
    "StepInputs",
    "TorchModelRunner",
    "forward_flops",
    "given_num_kv_blocks",
    "kv_cache_size",
    "weight_format_label",
]
