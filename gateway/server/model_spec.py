"""The models one replica serves: each a `ModelSpec` (what `--model` names, the id clients
send, its own device, dtype, KV budget and context), read from repeated `--model` /
`--served-model-name` flags or from the config file's `models` section.

Each model runs in an engine process of its own, on its own device if it names one. Where no
model on a device sets its KV budget, the N models there share the device's: on a CPU each
takes 1/N of the default share of the RAM available; on CUDA the engines are loaded one after
another and the i-th (from 1) may fill the device up to i/N of the default fraction, since
what the earlier ones hold counts as in use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tenants
from gateway.server.model_source import (
    DEFAULT_MODEL,
    DEFAULT_MODEL_NAME,
    DEMO_MODEL,
    DEMO_MODEL_NAME,
)

# The config file's keys of one model.
_SPEC_KEYS = ("model", "name", "device", "dtype", "kv_cache_bytes", "kv_cache_memory_fraction",
              "max_model_len")
_DTYPES = ("auto", "float32", "bfloat16", "float16")


class ModelSpecError(ValueError):
    """The models asked for are inconsistent; the message names the flag or entry."""


@dataclass(frozen=True)
class ModelSpec:
    """One served model."""

    # A checkpoint directory, a .gguf file, "demo" or "default" (gateway.server.model_source);
    # None: the default model.
    source: str | None = None
    # The id in /v1/models and the `model` field clients send; None: derived from the source.
    name: str | None = None
    # Where and in what its engine runs (None: the replica's --device and --dtype).
    device: str | None = None
    dtype: str | None = None
    # Its own engine's KV budget and context (None: the replica's --kv-cache-bytes,
    # --kv-cache-memory-fraction and --max-model-len).
    kv_cache_bytes: int | None = None
    kv_cache_memory_fraction: float | None = None
    max_model_len: int | None = None
    # Set by placed_specs, not by users: the part of the replica's KV memory fraction this
    # model's engine takes (1: the whole).
    kv_memory_scale: float = 1.0

    @property
    def served_name(self) -> str:
        """The id clients send: name, else what the source is served under by default."""
        return self.name or default_name(self.source)


def default_name(source: str | None) -> str:
    """The id a --model value is served under without --served-model-name (the source is
    not read: a checkpoint's directory name, a GGUF file's stem)."""
    if source is None or source == DEFAULT_MODEL:
        return DEFAULT_MODEL_NAME
    if source == DEMO_MODEL:
        return DEMO_MODEL_NAME
    path = Path(source).expanduser()
    return path.stem if path.suffix == ".gguf" else path.resolve().name


def specs_from_flags(sources: Sequence[str], names: Sequence[str]) -> tuple[ModelSpec, ...]:
    """Repeated --model and --served-model-name, paired in order (one name and no --model:
    the default model under that name)."""
    if not sources:
        if len(names) > 1:
            raise ModelSpecError("several --served-model-name need as many --model")
        return (ModelSpec(name=names[0] if names else None),)
    if names and len(names) != len(sources):
        raise ModelSpecError(
            f"{len(names)} --served-model-name for {len(sources)} --model: give one per model "
            "or none"
        )
    return tuple(ModelSpec(source=source, name=names[i] if names else None)
                 for i, source in enumerate(sources))


def specs_from_config(entries: object) -> tuple[ModelSpec, ...]:
    """The config file's `models`: a list of {model, name, kv_cache_bytes,
    kv_cache_memory_fraction, max_model_len} (`model` absent or null: the default model)."""
    if not isinstance(entries, list) or not entries:
        raise ModelSpecError("models: must be a non-empty list")
    specs = []
    for i, entry in enumerate(entries):
        where = f"models[{i}]"
        if not isinstance(entry, Mapping):
            raise ModelSpecError(f"{where}: must be a mapping")
        unknown = sorted(set(entry) - set(_SPEC_KEYS))
        if unknown:
            raise ModelSpecError(f"{where}: unknown keys {unknown}; expected some of "
                                 f"{list(_SPEC_KEYS)}")
        specs.append(ModelSpec(
            source=_optional(entry, "model", str, where),
            name=_optional(entry, "name", str, where),
            device=_optional(entry, "device", str, where),
            dtype=_optional(entry, "dtype", str, where),
            kv_cache_bytes=_optional(entry, "kv_cache_bytes", int, where),
            kv_cache_memory_fraction=_optional(entry, "kv_cache_memory_fraction", float, where),
            max_model_len=_optional(entry, "max_model_len", int, where),
        ))
    return tuple(specs)


def check_specs(specs: Sequence[ModelSpec]) -> None:
    """Names valid and unique, sizes in range."""
    seen: set[str] = set()
    for spec in specs:
        name = spec.served_name
        try:
            tenants.validate_model_name(name, "name")
        except tenants.TenantsError:
            raise ModelSpecError(
                f"model name {name!r}: 1-128 characters without whitespace or ':' (set it "
                "with --served-model-name or the models entry's name)") from None
        if name in seen:
            raise ModelSpecError(f"two models are served as {name!r}: give each its own name")
        seen.add(name)
        if spec.device is not None and spec.device not in ("cpu", "cuda") and not (
                spec.device.startswith("cuda:") and spec.device[5:].isdigit()):
            raise ModelSpecError(f"{name}: device must be cpu, cuda or cuda:N")
        if spec.dtype is not None and spec.dtype not in _DTYPES:
            raise ModelSpecError(f"{name}: dtype must be one of {', '.join(_DTYPES)}")
        if spec.kv_cache_bytes is not None and spec.kv_cache_bytes < 1:
            raise ModelSpecError(f"{name}: kv_cache_bytes must be >= 1")
        fraction = spec.kv_cache_memory_fraction
        if fraction is not None and not 0 < fraction <= 1:
            raise ModelSpecError(f"{name}: kv_cache_memory_fraction must be in (0, 1]")
        if spec.max_model_len is not None and spec.max_model_len < 1:
            raise ModelSpecError(f"{name}: max_model_len must be >= 1")


def placed_specs(specs: Sequence[ModelSpec], device: str) -> list[ModelSpec]:
    """specs with the part of the KV memory each takes where the models sharing its device
    (device: the replica's, for a spec without one) set no budget of their own (see the
    module docstring); as they are otherwise."""
    def on(spec: ModelSpec) -> str:
        where = spec.device or device
        return "cuda:0" if where == "cuda" else where

    placed = list(specs)
    for shared in dict.fromkeys(on(spec) for spec in specs):
        indexes = [i for i, spec in enumerate(specs) if on(spec) == shared]
        if len(indexes) == 1 or any(specs[i].kv_cache_bytes is not None
                                    or specs[i].kv_cache_memory_fraction is not None
                                    for i in indexes):
            continue
        on_cuda = shared.startswith("cuda")
        for rank, i in enumerate(indexes):
            placed[i] = dataclasses.replace(
                specs[i], kv_memory_scale=(rank + 1 if on_cuda else 1) / len(indexes))
    return placed


def _optional(entry: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    value = entry.get(key)
    if value is None:
        return None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ModelSpecError(f"{where}.{key}: must be a {kind.__name__}")
    return value
