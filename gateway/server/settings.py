"""The gateway's settings: command-line flags over TIERGATE_* environment variables over
defaults, read once at start into one typed object and validated there.

The optional YAML/JSON config file (``--config``) holds what is structured rather than a
single value: the tier table, pricing, admission, alerting and engine sections.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from engine import CPU_DECODE_MAX_ROWS, KV_CACHE_DTYPES
from gateway.admin.auth import ADMIN_TOKEN_ENV
from gateway.server.model_spec import (
    ModelSpec,
    ModelSpecError,
    check_specs,
    specs_from_config,
    specs_from_flags,
)
from tenants import DEFAULT_DATABASE_URL


class SettingsError(ValueError):
    """A setting is malformed; the message names the flag and its variable."""


@dataclass(frozen=True)
class _Option:
    flag: str
    env: str
    help: str


# Field name -> its flag and environment variable; every field of GatewaySettings that is
# settable from the outside appears here once.
_OPTIONS: dict[str, _Option] = {
    "host": _Option("--host", "TIERGATE_HOST", "address to listen on"),
    "port": _Option("--port", "TIERGATE_PORT", "port to listen on"),
    "model": _Option(
        "--model",
        "TIERGATE_MODEL",
        "HF checkpoint directory, .gguf file, 'demo' or 'default' (SmolLM2-135M-Instruct, "
        "served when no model is named); "
        "repeat it to serve several models, each in its own engine process (or list them in "
        "the config file's models section)",
    ),
    "served_model_name": _Option(
        "--served-model-name", "TIERGATE_SERVED_MODEL_NAME",
        "model id clients send (one per --model, in order)",
    ),
    "database_url": _Option("--database-url", "TIERGATE_DATABASE_URL", "SQLAlchemy URL"),
    "redis_url": _Option(
        "--redis-url", "TIERGATE_REDIS_URL", "Redis URL for limits shared across replicas"
    ),
    "device": _Option("--device", "TIERGATE_DEVICE", "cpu or cuda"),
    "dtype": _Option(
        "--dtype",
        "TIERGATE_DTYPE",
        "auto (a GGUF file's quantized matrices as stored on the CPU, else float32), float32, "
        "bfloat16 or float16 (every weight dequantized to it at load)",
    ),
    "config": _Option("--config", "TIERGATE_CONFIG", "YAML/JSON file: tiers, pricing, ..."),
    "run_migrations": _Option(
        "--migrate", "TIERGATE_RUN_MIGRATIONS", "run Alembic upgrade head at start"
    ),
    "kv_cache_bytes": _Option(
        "--kv-cache-bytes", "TIERGATE_KV_CACHE_BYTES",
        "KV cache size in bytes (default: a share of the memory left once the model is loaded)",
    ),
    "kv_cache_memory_fraction": _Option(
        "--kv-cache-memory-fraction", "TIERGATE_KV_CACHE_MEMORY_FRACTION",
        "without --kv-cache-bytes: the KV cache's share of the memory the engine may use "
        "(default 0.9 of a CUDA device's, less what it holds; 0.25 of the RAM available)",
    ),
    "kv_cache_dtype": _Option(
        "--kv-cache-dtype", "TIERGATE_KV_CACHE_DTYPE",
        "auto (the model's dtype) or fp8 (float8 E4M3: twice the tokens per byte; CUDA devices "
        "of compute capability 8.9 or later)",
    ),
    "grammar_max_step_ms": _Option(
        "--grammar-max-step-ms", "TIERGATE_GRAMMAR_MAX_STEP_MS",
        "longest one constrained token's grammar mask and advance may take (default 20)",
    ),
    "grammar_max_ms_per_token": _Option(
        "--grammar-max-ms-per-token", "TIERGATE_GRAMMAR_MAX_MS_PER_TOKEN",
        "most a constrained output's grammar may take per token on average (default 2)",
    ),
    "max_model_len": _Option(
        "--max-model-len", "TIERGATE_MAX_MODEL_LEN", "longest prompt + output in tokens"
    ),
    "max_num_seqs": _Option("--max-num-seqs", "TIERGATE_MAX_NUM_SEQS", "requests per step"),
    "max_num_batched_tokens": _Option(
        "--max-num-batched-tokens", "TIERGATE_MAX_NUM_BATCHED_TOKENS", "tokens per step"
    ),
    "cpu_decode_rows": _Option(
        "--cpu-decode-rows",
        "TIERGATE_CPU_DECODE_ROWS",
        "CPU float32: decode steps of at most this many requests run as one C++ call over a "
        f"second copy of the weights (0: never; default {CPU_DECODE_MAX_ROWS})",
    ),
    "max_loras": _Option(
        "--max-loras", "TIERGATE_MAX_LORAS",
        "LoRA adapters one engine step may mix (the engine's adapter slots; 0: no adapters; "
        "default 4)",
    ),
    "max_cpu_loras": _Option(
        "--max-cpu-loras", "TIERGATE_MAX_CPU_LORAS",
        "LoRA adapters the engine keeps loaded in host memory (LRU; default 16)",
    ),
    "max_lora_rank": _Option(
        "--max-lora-rank", "TIERGATE_MAX_LORA_RANK",
        "largest rank of an adapter's projections (default 64)",
    ),
    "max_adapter_bytes": _Option(
        "--max-adapter-bytes", "TIERGATE_MAX_ADAPTER_BYTES",
        "largest adapter (its files, uncompressed) the admin API registers (default 512 MiB)",
    ),
    "async_scheduling": _Option(
        "--async-scheduling",
        "TIERGATE_ASYNC_SCHEDULING",
        "auto (default: on where the device runs ahead of the host, CUDA), on or off: schedule "
        "the next engine step while the device runs the current one",
    ),
    "scheduling": _Option(
        "--scheduling", "TIERGATE_SCHEDULING", "tiered (default) or fcfs (baseline)"
    ),
    "service_tier_above_plan": _Option(
        "--service-tier-above-plan", "TIERGATE_SERVICE_TIER_ABOVE_PLAN",
        "a request whose service_tier asks for a tier above its tenant's: downgrade (served "
        "in the tenant's tier, the default) or refuse (403)",
    ),
    "max_body_bytes": _Option(
        "--max-body-bytes", "TIERGATE_MAX_BODY_BYTES", "largest request body (413 above)"
    ),
    "max_messages": _Option(
        "--max-messages", "TIERGATE_MAX_MESSAGES", "most messages in one chat request"
    ),
    "max_choices": _Option(
        "--max-choices", "TIERGATE_MAX_CHOICES", "most prompts x n in one request"
    ),
    "file_storage": _Option(
        "--file-storage", "TIERGATE_FILE_STORAGE",
        "where uploaded files (the Files API) are kept: local (the data directory's files/, "
        "the default), a directory, or s3://bucket[/prefix] (an S3-compatible store shared by "
        "replicas; endpoint and credentials from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...)",
    ),
    "max_file_bytes": _Option(
        "--max-file-bytes", "TIERGATE_MAX_FILE_BYTES", "largest file an upload may hold"
    ),
    "batch_max_in_flight": _Option(
        "--batch-max-in-flight", "TIERGATE_BATCH_MAX_IN_FLIGHT",
        "most batch lines (the Batches API) one replica runs at once, in the batch tier",
    ),
    "batch_floor_in_flight": _Option(
        "--batch-floor-in-flight", "TIERGATE_BATCH_FLOOR_IN_FLIGHT",
        "batch lines a replica still runs at once while interactive requests keep its engine "
        "busy (the floor that keeps a batch from starving; 0: none)",
    ),
    "batch_lease_s": _Option(
        "--batch-lease-s", "TIERGATE_BATCH_LEASE_S",
        "seconds a replica's claim on a batch line lasts unless renewed: how soon another "
        "replica takes over the lines of one that died",
    ),
    "response_retention_days": _Option(
        "--response-retention-days", "TIERGATE_RESPONSE_RETENTION_DAYS",
        "how long the Responses API keeps a response sent with store (its default) for "
        "retrieval and previous_response_id; 0 keeps none",
    ),
    "drain_timeout_s": _Option(
        "--drain-timeout", "TIERGATE_DRAIN_TIMEOUT_S", "seconds SIGTERM waits for requests"
    ),
    "stream_write_timeout_s": _Option(
        "--stream-write-timeout",
        "TIERGATE_STREAM_WRITE_TIMEOUT_S",
        "seconds a stream's client may leave a chunk unread before the request is aborted",
    ),
    "demo_model_dir": _Option(
        "--demo-model-dir", "TIERGATE_DEMO_MODEL_DIR", "where the demo model is written"
    ),
    "model_cache_dir": _Option(
        "--model-cache-dir",
        "TIERGATE_MODEL_CACHE_DIR",
        "where converted GGUF models (and the fetched default model) are kept",
    ),
    "data_dir": _Option("--data-dir", "TIERGATE_DATA_DIR", "local state: usage spool"),
    "tool_call_parser": _Option(
        "--tool-call-parser",
        "TIERGATE_TOOL_CALL_PARSER",
        "how the model writes tool calls: auto (from its chat template), hermes, llama3_json "
        "or mistral",
    ),
}

_DTYPES = ("auto", "float32", "bfloat16", "float16")
# Flags that may be repeated, one per served model.
_MODEL_OPTIONS = ("model", "served_model_name")


@dataclass(frozen=True)
class GatewaySettings:
    """Everything `tiergate serve` needs to start; see _OPTIONS for flags and variables."""

    host: str = "127.0.0.1"
    port: int = 8000
    # The models served, each by an engine process of its own (gateway.server.model_spec):
    # --model and --served-model-name, or the config file's models section.
    models: tuple[ModelSpec, ...] = (ModelSpec(),)
    database_url: str = DEFAULT_DATABASE_URL
    # None: rate limits are kept in this process only.
    redis_url: str | None = None
    device: str = "cpu"
    # auto: a GGUF file's matrices as stored where the CPU kernels read them (float32 for the
    # rest and the activations), else float32; a float dtype: every weight dequantized to it.
    dtype: str = "auto"
    config: Path | None = None
    run_migrations: bool = True
    # None: a share of the memory the engine may use (engine.worker.kv_memory).
    kv_cache_bytes: int | None = None
    kv_cache_memory_fraction: float | None = None
    kv_cache_dtype: str = "auto"  # auto | fp8 (engine.worker.kv_memory.KV_CACHE_DTYPES)
    # What a constrained sample's grammar may cost on the host (engine.GrammarBudget).
    grammar_max_step_ms: float = 20.0
    grammar_max_ms_per_token: float = 2.0
    # None: the model's own context length.
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # None: the runner's default (engine.RunnerConfig.cpu_decode_rows).
    cpu_decode_rows: int | None = None
    # LoRA adapters (engine.LoraConfig): slots per step, kept on the host, largest rank; the
    # largest adapter the admin API takes.
    max_loras: int = 4
    max_cpu_loras: int = 16
    max_lora_rank: int = 64
    max_adapter_bytes: int = 512 << 20
    async_scheduling: str = "auto"  # auto | on | off (engine.EngineConfig.async_scheduling)
    scheduling: str = "tiered"
    service_tier_above_plan: str = "downgrade"  # policies.AbovePlan
    max_body_bytes: int = 4 << 20
    max_messages: int = 2048
    max_choices: int = 256
    file_storage: str = "local"
    max_file_bytes: int = 200 << 20
    batch_max_in_flight: int = 8
    batch_floor_in_flight: int = 1
    batch_lease_s: float = 30.0
    response_retention_days: float = 30.0
    drain_timeout_s: float = 30.0
    stream_write_timeout_s: float = 30.0
    demo_model_dir: Path = Path.home() / ".cache" / "tiergate" / "demo-model"
    model_cache_dir: Path = Path.home() / ".cache" / "tiergate" / "models"
    data_dir: Path = Path("./tiergate-data")
    tool_call_parser: str = "auto"
    # Never from a flag (it would show in `ps`): only TIERGATE_ADMIN_TOKEN.
    admin_token: str | None = field(default=None, repr=False)
    # The parsed --config file (empty when none).
    file_config: Mapping[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise SettingsError("--port must be in 0..65535")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise SettingsError("--device must be cpu, cuda or cuda:N")
        if self.dtype not in _DTYPES:
            raise SettingsError(f"--dtype must be one of {', '.join(_DTYPES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise SettingsError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}")
        if self.async_scheduling not in ("auto", "on", "off"):
            raise SettingsError("--async-scheduling must be auto, on or off")
        if self.scheduling not in ("tiered", "fcfs"):
            raise SettingsError("--scheduling must be tiered or fcfs")
        if self.service_tier_above_plan not in ("downgrade", "refuse"):
            raise SettingsError("--service-tier-above-plan must be downgrade or refuse")
        if self.tool_call_parser not in ("auto", "hermes", "llama3_json", "mistral"):
            raise SettingsError("--tool-call-parser must be auto, hermes, llama3_json or mistral")
        for name in (
            "max_num_seqs", "max_num_batched_tokens", "max_body_bytes", "max_messages",
            "max_choices", "max_file_bytes", "batch_max_in_flight",
        ):
            if getattr(self, name) < 1:
                raise SettingsError(f"{_OPTIONS[name].flag} must be >= 1")
        if self.max_loras < 0 or self.max_cpu_loras < self.max_loras:
            raise SettingsError("--max-loras must be >= 0 and --max-cpu-loras at least as many")
        if self.max_lora_rank < 1 or self.max_adapter_bytes < 1:
            raise SettingsError("--max-lora-rank and --max-adapter-bytes must be >= 1")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise SettingsError("--kv-cache-bytes must be >= 1")
        if self.kv_cache_memory_fraction is not None and not (
                0 < self.kv_cache_memory_fraction <= 1):
            raise SettingsError("--kv-cache-memory-fraction must be in (0, 1]")
        if not (self.grammar_max_step_ms > 0 and self.grammar_max_ms_per_token > 0):
            raise SettingsError("--grammar-max-step-ms and --grammar-max-ms-per-token must "
                                "be > 0")
        if self.cpu_decode_rows is not None and not (
            0 <= self.cpu_decode_rows <= CPU_DECODE_MAX_ROWS
        ):
            raise SettingsError(f"--cpu-decode-rows must be in 0..{CPU_DECODE_MAX_ROWS}")
        if self.file_storage.startswith("s3://") and not self.file_storage[5:].strip("/"):
            raise SettingsError("--file-storage s3:// needs a bucket: s3://bucket[/prefix]")
        if self.batch_floor_in_flight < 0:
            raise SettingsError("--batch-floor-in-flight must be >= 0")
        if not self.batch_lease_s >= 1:
            raise SettingsError("--batch-lease-s must be >= 1")
        if self.response_retention_days < 0:
            raise SettingsError("--response-retention-days must be >= 0")
        if self.drain_timeout_s < 0:
            raise SettingsError("--drain-timeout must be >= 0")
        if not self.stream_write_timeout_s > 0:
            raise SettingsError("--stream-write-timeout must be > 0")
        if not self.models:
            raise SettingsError("--model: no model to serve")
        try:
            check_specs(self.models)
        except ModelSpecError as exc:
            raise SettingsError(f"--model: {exc}") from None

    @classmethod
    def from_sources(
        cls, args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None
    ) -> GatewaySettings:
        """Flags (non-None attributes of args) win over the environment, which wins over
        the defaults."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        types = {f.name: f.type for f in fields(cls)}
        for name, option in _OPTIONS.items():
            if name in _MODEL_OPTIONS:
                continue
            raw = getattr(args, name, None) if args is not None else None
            if raw is None and env.get(option.env, "") != "":
                raw = env[option.env]
            if raw is not None:
                values[name] = _convert(raw, str(types[name]), option)
        values["admin_token"] = env.get(ADMIN_TOKEN_ENV) or None
        config_path = values.get("config")
        if config_path is not None:
            values["file_config"] = load_config_file(config_path)
        values["models"] = _models(args, env, values.get("file_config", {}))
        return cls(**values)


def _models(args: argparse.Namespace | None, env: Mapping[str, str],
            file_config: Mapping[str, Any]) -> tuple[ModelSpec, ...]:
    """The models: --model/--served-model-name (repeated; else their variables, one model),
    or the config file's models section, not both."""
    def given(name: str) -> list[str]:
        flags = getattr(args, name, None) if args is not None else None
        if flags:
            return list(flags)
        raw = env.get(_OPTIONS[name].env, "")
        return [raw] if raw else []

    sources, names = given("model"), given("served_model_name")
    try:
        if "models" in file_config:
            if sources or names:
                raise ModelSpecError("name the models either with --model (and "
                                     "--served-model-name) or in the config file's models "
                                     "section, not both")
            return specs_from_config(file_config["models"])
        return specs_from_flags(sources, names)
    except ModelSpecError as exc:
        raise SettingsError(f"--model: {exc}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The serve flags; each defaults to None so from_sources can tell it was not given."""
    for name, option in _OPTIONS.items():
        if name in _MODEL_OPTIONS:
            parser.add_argument(option.flag, dest=name, action="append", default=None,
                                help=f"{option.help} (env {option.env})")
            continue
        if name == "run_migrations":
            parser.add_argument(
                "--migrate",
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=f"{option.help} (default: yes; env {option.env}=0 turns it off)",
            )
            continue
        parser.add_argument(option.flag, dest=name, default=None, help=f"{option.help} "
                            f"(env {option.env})")


def load_config_file(path: Path) -> dict[str, Any]:
    """The config file as a mapping; JSON by suffix, YAML otherwise."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise SettingsError(f"--config: cannot read {path}: {exc}") from None
    try:
        data = json.loads(text) if Path(path).suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise SettingsError(f"--config: {path} is not valid: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(f"--config: {path} must hold a mapping at the top level")
    return data


def _convert(raw: object, type_name: str, option: _Option) -> Any:
    if not isinstance(raw, str):
        return raw
    try:
        if "bool" in type_name:
            lowered = raw.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if "Path" in type_name:
            return Path(raw).expanduser()
        if type_name.startswith("int"):
            return int(raw)
        if type_name.startswith("float"):
            return float(raw)
    except ValueError:
        raise SettingsError(f"{option.flag} ({option.env}): cannot read {raw!r}") from None
    return raw
