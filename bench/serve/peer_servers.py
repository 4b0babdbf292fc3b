"""The two servers of the peer benchmark, started here one at a time on a free loopback port:
`tiergate serve` (the default model, SmolLM2-135M-Instruct, in a dtype) and llama.cpp's
`llama-server` (the same model as a GGUF of a type).

Both get the same environment for their threads: OMP_NUM_THREADS=<threads>, and how OpenMP
workers wait as the caller's environment says (OMP_WAIT_POLICY, GOMP_SPINCOUNT) or else each
server's own default: tiergate's engine process spins a bounded while
(`engine.process.openmp_wait`), llama-server keeps libgomp's default. llama-server also
gets `-t <threads>` (its own thread count; -tb follows -t).
"""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from bench.serve.server_process import ServerProcess
from engine.process.openmp_wait import WAIT_VARIABLES

__all__ = [
    "PEER_TENANT_TIER",
    "LlamaServer",
    "PeerServer",
    "TiergateServer",
    "openmp_wait_label",
    "thread_env",
]

# The tier of the benchmark's tenant on tiergate: one with no latency objectives, so SLO
# shedding (on by default) never refuses a request of a closed loop; its quota is unlimited.
PEER_TENANT_TIER = "batch"


def thread_env(threads: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment both servers get (TIERGATE_* variables dropped: flags say it all)."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if not k.startswith("TIERGATE_")}
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def openmp_wait_label(env: Mapping[str, str]) -> str:
    """How the servers' OpenMP workers wait, for the table's header."""
    given = [f"{name}={env[name]}" for name in WAIT_VARIABLES if name in env]
    return " ".join(given) + " for both" if given else "each server's default"


class PeerServer(ServerProcess):
    """A server of the peer benchmark: the thread environment both get (thread_env)."""

    def __init__(self, work_dir: Path, threads: int, *, start_timeout_s: float) -> None:
        super().__init__(work_dir, start_timeout_s=start_timeout_s)
        self.threads = threads

    def env(self) -> dict[str, str]:
        return thread_env(self.threads)


class TiergateServer(PeerServer):
    """`tiergate serve` with no --model (SmolLM2-135M-Instruct converted to dtype), a fresh
    SQLite database, and a tenant of PEER_TENANT_TIER with an unlimited quota."""

    name = "tiergate"
    ready_path = "/health/ready"

    def __init__(self, work_dir: Path, threads: int, *, dtype: str, max_num_seqs: int,
                 kv_cache_bytes: int | None, model_cache_dir: Path | None = None,
                 start_timeout_s: float = 900.0) -> None:
        super().__init__(work_dir, threads, start_timeout_s=start_timeout_s)
        self.dtype = dtype
        self.max_num_seqs = max_num_seqs
        self.kv_cache_bytes = kv_cache_bytes
        self.model_cache_dir = model_cache_dir
        self.admin_token = "peer-" + secrets.token_urlsafe(24)
        self.api_key: str | None = None
        self.model: str | None = None

    def command(self) -> list[str]:
        command = [
            sys.executable, "-m", "gateway.cli", "serve",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", self.dtype,
            "--database-url", f"sqlite:///{self.work_dir / 'tiergate.db'}",
            "--data-dir", str(self.work_dir / "data"),
            "--max-num-seqs", str(self.max_num_seqs),
            "--log-level", "warning",
        ]  # fmt: skip
        if self.kv_cache_bytes is not None:
            command += ["--kv-cache-bytes", str(self.kv_cache_bytes)]
        if self.model_cache_dir is not None:
            command += ["--model-cache-dir", str(self.model_cache_dir)]
        return command

    def env(self) -> dict[str, str]:
        # The admin token only through the environment (argv shows in `ps`).
        return {**super().env(), "TIERGATE_ADMIN_TOKEN": self.admin_token}

    def after_ready(self) -> None:
        from bench.serve.provision import provision_tenants, served_model_name

        keys = provision_tenants(self.base_url, self.admin_token, {"peer": PEER_TENANT_TIER})
        self.api_key = keys["peer"]
        self.model = served_model_name(self.base_url, self.api_key)


class LlamaServer(PeerServer):
    """llama.cpp's llama-server: `--parallel` slots of ctx_size / parallel tokens each,
    continuous batching (its default), no web UI."""

    name = "llama-server"
    ready_path = "/health"  # 503 while the model loads

    def __init__(self, work_dir: Path, threads: int, *, binary: Path, model_file: Path,
                 parallel: int, ctx_size: int, alias: str,
                 extra_args: Sequence[str] = (), start_timeout_s: float = 300.0) -> None:
        super().__init__(work_dir, threads, start_timeout_s=start_timeout_s)
        self.binary = binary
        self.model_file = model_file
        self.parallel = parallel
        self.ctx_size = ctx_size
        self.alias = alias
        self.extra_args = list(extra_args)
        self.model: str | None = alias
        self.api_key: str | None = None

    def flags(self) -> list[str]:
        """The flags besides -m, --host and --port (as the report shows them)."""
        return [
            "-t", str(self.threads), "--parallel", str(self.parallel), "-c", str(self.ctx_size),
            "--no-webui", "--alias", self.alias, *self.extra_args,
        ]

    def command(self) -> list[str]:
        return [str(self.binary), "-m", str(self.model_file), "--host", "127.0.0.1",
                "--port", str(self.port), *self.flags()]
