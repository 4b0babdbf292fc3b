"""The KV cache's default size (a share of the memory left), its source in the start-up log,
and CPU caches committed as they are written."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig, RunnerConfig, SchedulerConfig
from engine.errors import ConfigError
from engine.models.config import ModelConfig
from engine.worker.kv_memory import (
    allocate_kv_tensor,
    available_memory_bytes,
    kv_cache_dtype,
    kv_cache_size,
)
from engine.worker.model_runner import TorchModelRunner, kv_bytes_per_block
from gateway.server.model_spec import ModelSpec
from gateway.server.served_model import build_engine
from gateway.server.settings import GatewaySettings, SettingsError
from policies import TierTable
from tests.serve_process import shared_demo_model_dir

CPU = torch.device("cpu")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def test_bytes_given_win() -> None:
    size = kv_cache_size(CPU, requested_bytes=123 << 20, memory_fraction=0.5,
                         most_useful_bytes=1 << 40, reserve_bytes=0)
    assert (size.num_bytes, size.source) == (123 << 20, "--kv-cache-bytes")


def test_the_default_is_a_share_of_the_ram_available_less_what_the_model_still_takes() -> None:
    available, total = available_memory_bytes(CPU)
    assert 0 < available <= total
    reserve = 512 << 20
    size = kv_cache_size(CPU, requested_bytes=None, memory_fraction=None,
                         most_useful_bytes=1 << 50, reserve_bytes=reserve)
    assert size.num_bytes == pytest.approx(0.25 * (available - reserve), rel=0.05)
    assert "0.25 of" in size.source and "RAM available" in size.source
    half = kv_cache_size(CPU, requested_bytes=None, memory_fraction=0.5,
                         most_useful_bytes=1 << 50, reserve_bytes=reserve)
    assert half.num_bytes == pytest.approx(2 * size.num_bytes, rel=0.05)
    # One of two engines sharing the machine: half the default share.
    shared = kv_cache_size(CPU, requested_bytes=None, memory_fraction=None, memory_scale=0.5,
                           most_useful_bytes=1 << 50, reserve_bytes=reserve)
    assert shared.num_bytes == pytest.approx(size.num_bytes / 2, rel=0.05)
    assert "0.125 of" in shared.source


def test_never_more_than_every_sequence_can_fill() -> None:
    size = kv_cache_size(CPU, requested_bytes=None, memory_fraction=None,
                         most_useful_bytes=8 << 20, reserve_bytes=0)
    assert size.num_bytes == 8 << 20 and "max_num_seqs x max_model_len" in size.source


def test_no_memory_left_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="--kv-cache-bytes"):
        kv_cache_size(CPU, requested_bytes=None, memory_fraction=0.5,
                      most_useful_bytes=1 << 40, reserve_bytes=1 << 60)
    with pytest.raises(ConfigError, match="fraction"):
        kv_cache_size(CPU, requested_bytes=None, memory_fraction=1.5,
                      most_useful_bytes=1 << 40, reserve_bytes=0)


def test_a_cpu_cache_is_zero_and_committed_as_it_is_written() -> None:
    before = _rss_bytes()
    cache = allocate_kv_tensor((4096, 16, 8, 128), torch.float32, CPU)  # 256 MiB
    assert _rss_bytes() - before < 16 << 20  # reserved, not yet resident
    cache[7].fill_(1.5)
    assert cache[7].eq(1.5).all() and cache[6].eq(0).all() and cache[4095].eq(0).all()
    assert _rss_bytes() - before < 32 << 20


def test_the_runner_sizes_its_cache_by_default_and_build_engine_logs_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model_dir: Path = shared_demo_model_dir()
    config = ModelConfig.from_file(model_dir)
    runner = TorchModelRunner.from_model_dir(
        model_dir, EngineConfig(SchedulerConfig(max_num_seqs=4, max_model_len=256),
                                runner=RunnerConfig(cpu_decode_rows=0)))
    assert runner.kv_cache_size is not None
    # The demo model's few layers: 4 sequences of 256 tokens take less than a share of RAM.
    per_block = kv_bytes_per_block(config, 16, torch.float32)
    assert runner.num_kv_blocks == 4 * 256 // 16
    assert runner.kv_cache_size.num_bytes == runner.num_kv_blocks * per_block
    with caplog.at_level(logging.INFO, logger="gateway.server.served_model"):
        build_engine(GatewaySettings(max_num_seqs=4, max_model_len=256), TierTable(),
                     ModelSpec(), model_dir)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache")]
    assert "max_num_seqs x max_model_len tokens, within 0.25 of" in line
    assert "64 blocks of 16 tokens" in line


def test_the_cache_dtype_is_the_models_or_fp8_where_the_device_converts_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert kv_cache_dtype("auto", CPU, torch.bfloat16) is torch.bfloat16
    with pytest.raises(ConfigError, match="one of auto, fp8"):
        kv_cache_dtype("int8", CPU, torch.float32)
    with pytest.raises(ConfigError, match="on CUDA only"):
        kv_cache_dtype("fp8", CPU, torch.float32)
    cuda = torch.device("cuda", 0)  # the capability read is the device's own, patched here
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    with pytest.raises(ConfigError, match=r"8\.9 or later; NVIDIA A100 has 8\.0"):
        kv_cache_dtype("fp8", cuda, torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    assert kv_cache_dtype("fp8", cuda, torch.bfloat16) is torch.float8_e4m3fn
    # Half of bfloat16's bytes a block: the same budget holds twice the tokens.
    config = ModelConfig.from_file(shared_demo_model_dir())
    assert 2 * kv_bytes_per_block(config, 16, torch.float8_e4m3fn) == kv_bytes_per_block(
        config, 16, torch.bfloat16)


def test_a_cpu_runner_and_the_settings_refuse_an_fp8_cache() -> None:
    with pytest.raises(ConfigError, match="on CUDA only"):
        TorchModelRunner.from_model_dir(
            shared_demo_model_dir(), EngineConfig(
                SchedulerConfig(max_num_seqs=4, max_model_len=256),
                runner=RunnerConfig(num_kv_blocks=8, kv_cache_dtype="fp8")))
    with pytest.raises(SettingsError, match="--kv-cache-dtype must be one of auto, fp8"):
        GatewaySettings(kv_cache_dtype="fp16")
