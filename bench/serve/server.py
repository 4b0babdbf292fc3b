"""Servers the benchmark starts itself: one `tiergate serve` process per configuration, each
on a fresh SQLite database, a free loopback port and its own admin token, with the tier
table and admission section written to a `--config` YAML file.

The configurations compared (same model, same engine limits, same machine):
- `tiered`: tiergate's default, tier priorities, premium's KV reservation, SLO shedding;
- `fcfs`: one FCFS queue, no tiers, no reservation, no shedding (a vLLM-style engine);
- `tiered-noshed`: the tiered engine without SLO shedding.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Self

import yaml

from bench.serve.server_process import ServerProcess

if TYPE_CHECKING:
    from policies import Tier, TierTable

__all__ = ["VARIANTS", "BenchServer", "EngineLimits", "ServerVariant"]

@dataclass(frozen=True)
class ServerVariant:
    """One server configuration under comparison."""

    name: str  # the label in tables and JSON
    scheduling: str  # `--scheduling`: tiered or fcfs
    enable_shedding: bool  # `admission.enable_shedding` of the config file


VARIANTS: dict[str, ServerVariant] = {
    v.name: v
    for v in (
        ServerVariant("tiered", "tiered", enable_shedding=True),
        ServerVariant("fcfs", "fcfs", enable_shedding=False),
        ServerVariant("tiered-noshed", "tiered", enable_shedding=False),
    )
}


@dataclass(frozen=True)
class EngineLimits:
    """Model and engine flags every server of a comparison gets alike."""

    model_dir: Path | None  # `--model`; None: the demo model in demo_model_dir
    demo_model_dir: Path  # `--demo-model-dir` (written on first use)
    kv_cache_bytes: int = 256 << 20
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048


class BenchServer(ServerProcess):
    """A `tiergate serve` subprocess; use as a context manager or call start()/stop()."""

    ready_path = "/health/ready"  # 200 once the model is loaded

    def __init__(
        self,
        variant: ServerVariant,
        tiers: TierTable,
        limits: EngineLimits,
        work_dir: Path,  # config, database, spool and log of this server
        *,
        start_timeout_s: float = 300.0,
    ) -> None:
        super().__init__(work_dir, start_timeout_s=start_timeout_s)
        self.variant = variant
        self.tiers = tiers
        self.limits = limits
        self.admin_token = "bench-" + secrets.token_urlsafe(24)
        self.name = f"{variant.name} server"

    @property
    def log_path(self) -> Path:
        return self.work_dir / "serve.log"

    @property
    def config_path(self) -> Path:
        return self.work_dir / "config.yaml"

    def start(self) -> Self:
        """Write the config file, start, and return once /health/ready answers 200."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(self.config_file(), sort_keys=False))
        super().start()
        return self

    def command(self) -> list[str]:
        limits = self.limits
        model = str(limits.model_dir) if limits.model_dir is not None else "demo"
        return [
            sys.executable, "-m", "gateway.cli", "serve",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--config", str(self.config_path),
            "--scheduling", self.variant.scheduling,
            "--database-url", f"sqlite:///{self.work_dir / 'tiergate.db'}",
            "--data-dir", str(self.work_dir / "data"),
            "--demo-model-dir", str(limits.demo_model_dir),
            "--kv-cache-bytes", str(limits.kv_cache_bytes),
            "--max-num-seqs", str(limits.max_num_seqs),
            "--max-num-batched-tokens", str(limits.max_num_batched_tokens),
            "--log-level", "warning",
            "--model", model,
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        # The admin token only through the environment (argv shows in `ps`); no Redis: the
        # rate limiter stays in the process, as quotas are unlimited anyway.
        env = {
            # OpenMP threads that spin between parallel regions (the default) take the cores
            # from the engine: on a machine with few cores a server that had served one heavy
            # load then ran several times slower, for good. Passive waiting, unless the caller
            # chose.
            "OMP_WAIT_POLICY": "PASSIVE",
            **os.environ,
            "TIERGATE_ADMIN_TOKEN": self.admin_token,
            "PYTHONUNBUFFERED": "1",
        }
        env.pop("TIERGATE_REDIS_URL", None)
        return env

    def config_file(self) -> dict[str, object]:
        """The `--config` contents: the tier table and the admission section."""
        return {
            "tiers": [_tier_entry(tier) for tier in self.tiers],
            "admission": {"enable_shedding": self.variant.enable_shedding},
        }


def _tier_entry(tier: Tier) -> dict[str, object]:
    """A tier as the config file writes it: the fields with a default only where they
    differ from it, so that a checkout older than such a field reads the file too."""
    from policies import Tier

    defaults = {f.name: f.default for f in dataclasses.fields(Tier)
                if f.default is not dataclasses.MISSING}
    return {name: value for name, value in dataclasses.asdict(tier).items()
            if name not in defaults or value != defaults[name]}
