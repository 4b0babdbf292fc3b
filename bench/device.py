"""The device half of `tiergate bench engine --device DEV`: a real model's steps on DEV.

For a model config (random weights, the given dtype) and each batch of running decodes:
- the whole engine step (scheduling, inputs, forward, sampling, outputs) with async
  scheduling (the next step queued while the device runs the current one: a step's time is
  the pipeline's period) and synchronous (the device synchronised at each step's end),
  against the forward alone on the same inputs (the captured CUDA graph where the runner has
  one), median milliseconds of a third of --steps steps each;
- the bytes a decode step must read (every weight once, plus the KV of every context) against
  the device's measured copy rate: the fraction of that rate the step and the forward reach.
The offline comparison with HF transformers `generate` is `bench.offline` on the same
device (`--compare-hf`). Built for CUDA; runs anywhere (CPU for a quick check on tiny sizes).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from bench.engine import step_until_decoding
from engine.config import CacheConfig, EngineConfig, RunnerConfig, SchedulerConfig
from engine.core.llm_engine import LLMEngine
from engine.models.config import ModelConfig
from engine.models.decoder import CausalLM
from engine.models.loader import random_model
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledChunk
from engine.worker.flops import linear_params_per_token
from engine.worker.model_runner import TorchModelRunner, kv_bytes_per_block

__all__ = [
    "DeviceRow",
    "copy_rate",
    "format_device_table",
    "max_model_len",
    "measure_device",
    "weight_bytes_per_step",
]

_BLOCK_SIZE = 16


@dataclass
class DeviceRow:
    num_running: int
    step_ms: float  # median engine step, async scheduling
    step_sync_ms: float  # median engine step, synchronous
    forward_ms: float  # median forward alone, same inputs
    bytes_read: int  # weights + the KV the step attends to
    step_fraction_of_copy_rate: float  # bytes_read / step time, over the copy rate
    forward_fraction_of_copy_rate: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_rate(device: torch.device, num_bytes: int, repeats: int = 10) -> float:
    """Bytes per second a device-to-device copy moves (read plus write), best of repeats."""
    source = torch.empty(num_bytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    target = torch.empty_like(source)
    target.copy_(source)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        target.copy_(source)
        _sync(device)
        best = min(best, time.perf_counter() - started)
    return 2 * source.numel() * 4 / best


def weight_bytes_per_step(config: ModelConfig, dtype: torch.dtype) -> int:
    """Weight bytes a decode step must read: every linear layer's and the lm_head's weights
    once (the embedding table only at the batch's rows, left out, as are the norms)."""
    element_size = torch.empty(0, dtype=dtype).element_size()
    num_params = linear_params_per_token(config) + config.vocab_size * config.hidden_size
    return num_params * element_size


def max_model_len(context: int, num_steps: int) -> int:
    """The longest sequence a row of measure_device holds."""
    return context + num_steps + 32


def measure_device(
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    num_running: int,
    context: int,
    num_steps: int,
    rate: float,
    seed: int = 0,
    model: CausalLM | None = None,
) -> DeviceRow:
    """One row: num_running decodes at about `context` tokens of context on the device.
    model: the config's random model (random_model(config, seed, dtype, device,
    max_model_len(context, num_steps))) built once for every row; None builds one."""
    max_len = max_model_len(context, num_steps)
    blocks = num_running * -(-max_len // _BLOCK_SIZE) + 16
    if model is None:
        model = random_model(config, seed, dtype, device, max_len)
    engine_config = EngineConfig(
        SchedulerConfig(max_num_batched_tokens=max(2048, num_running),
                        max_num_seqs=num_running, max_model_len=max_len),
        CacheConfig(block_size=_BLOCK_SIZE),
        runner=RunnerConfig(num_kv_blocks=blocks),
    )
    engine_config.validate()  # before the runner captures CUDA graphs for max_num_seqs
    runner = TorchModelRunner(model, engine_config)
    engine = LLMEngine(engine_config, runner)
    generator = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=num_steps + 16)
    for index in range(num_running):
        prompt = torch.randint(3, config.vocab_size, (context - 1,), generator=generator)
        engine.add_request(f"d{index}", prompt.tolist(), params)
    running = step_until_decoding(engine, num_running)
    step_times = _step_times(engine, num_steps // 3, async_scheduling=True)
    sync_times = _step_times(engine, num_steps // 3, async_scheduling=False)
    # The forward alone on the inputs of the next decode step (its KV writes may land in a
    # block the scheduler has not handed out yet: the engine is not stepped again after).
    chunks = [ScheduledChunk(r.request_id, r.num_tokens - 1, 1, True, False) for r in running]
    inputs = runner.input_batch.prepare(chunks)  # every token on the host: none pending
    batch = inputs.to_device(runner.device)
    forward_times = []
    with torch.inference_mode():
        for _ in range(num_steps // 3 + 2):
            _sync(device)
            started = time.perf_counter()
            if runner.graphs is not None and runner.graphs.can_run(inputs):
                runner.graphs.run(inputs, None)  # the step's one input copy, then the replay
            else:
                runner.attention.prepare(batch.attention_metadata())
                runner.model(batch, runner.kv_caches, runner.attention)
            _sync(device)
            forward_times.append(time.perf_counter() - started)
    forward_times = forward_times[2:]
    kv_per_token = kv_bytes_per_block(config, _BLOCK_SIZE, dtype) // _BLOCK_SIZE
    bytes_read = weight_bytes_per_step(config, dtype) + kv_per_token * sum(
        r.num_tokens for r in running
    )
    step_s, forward_s = statistics.median(step_times), statistics.median(forward_times)
    return DeviceRow(
        num_running, step_s * 1e3, statistics.median(sync_times) * 1e3, forward_s * 1e3,
        bytes_read, bytes_read / step_s / rate, bytes_read / forward_s / rate,
    )


def _step_times(engine: LLMEngine, num_steps: int, async_scheduling: bool) -> list[float]:
    """Seconds of each of num_steps engine steps in the given mode, after three untimed ones
    (CUDA graph capture, the allocator, the pipeline filling)."""
    engine.finish_in_flight()
    engine.async_scheduling = async_scheduling
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(num_steps):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    engine.finish_in_flight()
    return times


def format_device_table(rows: list[DeviceRow], device: str, dtype: str, context: int,
                        rate: float) -> str:
    lines = [
        f"Engine step against the forward alone on {device} ({dtype}), contexts of about "
        f"{context} tokens; copy rate {rate / 1e9:.1f} GB/s (read + write)",
        "",
        "| running decodes | step ms | step ms, synchronous | forward ms | step / forward |"
        " MB read per step | step: % of copy rate | forward: % of copy rate |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.num_running} | {row.step_ms:.3f} | {row.step_sync_ms:.3f} | "
            f"{row.forward_ms:.3f} | "
            f"{row.step_ms / row.forward_ms:.2f} | {row.bytes_read / 1e6:.1f} | "
            f"{100 * row.step_fraction_of_copy_rate:.1f} | "
            f"{100 * row.forward_fraction_of_copy_rate:.1f} |"
        )
    return "\n".join(lines)
