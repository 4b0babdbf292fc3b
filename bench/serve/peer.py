"""`tiergate bench peer`: tiergate against a peer server on the same machine, model, prompts
and client; with --compare-llamacpp, llama.cpp's llama-server (built here from source, once).

For each system and dtype (tiergate: --tiergate-dtypes; llama.cpp: --llamacpp-types, GGUF
files written by llama-quantize from the default model's GGUF) a server is started alone,
warmed up with one short request, then driven at each --concurrency level in turn by the
closed-loop client (peer_client): the first --requests-per-level requests of the offline
workload (cycled), each a real text prompt of exactly its prompt_len tokens (peer_prompts),
streamed, ignore_eos, max_tokens = output_len, temperature 0. Servers run one at a time,
each with --threads threads.

The table: one row per system, dtype and level (output tokens/s, TTFT and TPOT p50/p99),
then tiergate/llama.cpp ratios at the same precision, headed by the machine, the llama.cpp
version, tiergate's commit, the seed and the command line. --json prints the JSON document
instead; --output FILE writes the JSON document as well. A benchmark, never a CI gate.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from bench.serve.errors import BenchConfigError, BenchServeError
from bench.workload import BENCH_INPUTS

# Heavy modules (torch, aiohttp, the tokenizer) are imported when the command runs.

__all__ = [
    "DEFAULT_WORKLOAD",
    "LevelRow",
    "PeerConfig",
    "PeerReport",
    "RatioRow",
    "add_arguments",
    "config_from_args",
    "format_table",
    "ratio_rows",
    "report_json",
    "run_command",
]

DEFAULT_WORKLOAD = BENCH_INPUTS / "workload-offline-200.json"
TIERGATE = "tiergate"
LLAMACPP = "llama.cpp"
TIERGATE_DTYPES = ("auto", "float32", "bfloat16", "float16")
# The llama.cpp "type" that serves the default model's file as shipped (no llama-quantize).
AS_SHIPPED = "FILE"
# llama.cpp types of the same precision as a tiergate dtype, best match first (auto: the
# file's quantized blocks as stored, as llama.cpp serves the file itself).
SAME_PRECISION: dict[str, tuple[str, ...]] = {
    "auto": (AS_SHIPPED,),
    "float32": ("F32",),
    "bfloat16": ("BF16", "F16"),
    "float16": ("F16",),
}
_WARMUP_PROMPT_TOKENS = 16
_WARMUP_OUTPUT_TOKENS = 8


@dataclass(frozen=True)
class PeerConfig:
    concurrency: tuple[int, ...]
    requests_per_level: tuple[int, ...]  # one per concurrency level
    tiergate_dtypes: tuple[str, ...]
    llamacpp_types: tuple[str, ...]  # empty: no llama.cpp
    threads: int
    seed: int
    workload: Path
    max_num_seqs: int  # tiergate's --max-num-seqs and llama-server's --parallel
    llamacpp_cache_dir: Path | None
    model_cache_dir: Path | None
    # tiergate's --kv-cache-bytes; None: its default sizing (a share of the memory left)
    tiergate_kv_cache_bytes: int | None = None
    llamacpp_extra_args: tuple[str, ...] = ()
    build_jobs: int = 2


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated integers") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: one or more integers >= 1")
    return values


def _name_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compare-llamacpp", action="store_true",
                        help="also run llama.cpp's llama-server (built from source on first use, "
                        "cached; minutes)")
    parser.add_argument("--concurrency", type=_int_list, default=(1, 8, 32),
                        help="concurrent requests per level, comma-separated (default: 1,8,32)")
    parser.add_argument("--requests-per-level", type=_int_list, default=None,
                        help="requests per level, comma-separated, one per --concurrency level "
                        "or one for all (default: 8,16,64 for 1,8,32; else 2x concurrency, "
                        "at least 8)")
    parser.add_argument("--tiergate-dtypes", type=_name_list, default=("float32",),
                        help="tiergate --dtype values, comma-separated: auto (the file's "
                        "blocks as stored), float32, bfloat16, float16 (default: float32)")
    parser.add_argument("--llamacpp-types", type=_name_list, default=("F32",),
                        help="llama.cpp GGUF types from llama-quantize, comma-separated: F32, F16, "
                        "BF16, Q8_0, Q4_K, or FILE: the default model's file as shipped (Q4_1; "
                        "compared with tiergate's auto) (default: F32)")
    parser.add_argument("--threads", type=int, default=2,
                        help="threads of each server (llama-server -t; OMP_NUM_THREADS of both)")
    parser.add_argument("--seed", type=int, default=0, help="prompt start words")
    parser.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD,
                        help="workload file (prompt_len, output_len of its first requests)")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="tiergate --max-num-seqs and llama-server --parallel (default: the "
                        "largest level, at least 32)")
    parser.add_argument("--llamacpp-cache-dir", type=Path, default=None,
                        help="where llama.cpp is built and its GGUF files written (default: "
                        "~/.cache/tiergate/llama.cpp)")
    parser.add_argument("--llamacpp-extra-args", default="",
                        help="more llama-server flags, as one shell-quoted string; give it "
                        "with '=' when it starts with a dash (--llamacpp-extra-args=--kv-unified)")
    parser.add_argument("--build-jobs", type=int, default=2, help="parallel compile jobs")
    parser.add_argument("--tiergate-kv-cache-bytes", type=int, default=None,
                        help="tiergate's KV cache (default: its own default sizing, as a "
                             "user gets it)")
    parser.add_argument("--model-cache-dir", type=Path, default=None,
                        help="tiergate's model cache (its --model-cache-dir)")
    parser.add_argument("--json", action="store_true", help="print the JSON document")
    parser.add_argument("--output", type=Path, default=None,
                        help="also write the JSON document to this file")


def config_from_args(args: argparse.Namespace) -> PeerConfig:
    from bench.serve.llamacpp_build import MODEL_TYPES

    concurrency = tuple(args.concurrency)
    if args.requests_per_level is None:
        defaults = {1: 8, 8: 16, 32: 64}
        per_level = tuple(defaults.get(c, max(8, 2 * c)) for c in concurrency)
    elif len(args.requests_per_level) == 1:
        per_level = args.requests_per_level * len(concurrency)
    elif len(args.requests_per_level) == len(concurrency):
        per_level = tuple(args.requests_per_level)
    else:
        raise BenchConfigError(
            f"--requests-per-level has {len(args.requests_per_level)} values for "
            f"{len(concurrency)} --concurrency levels"
        )
    for dtype in args.tiergate_dtypes:
        if dtype not in TIERGATE_DTYPES:
            raise BenchConfigError(
                f"--tiergate-dtypes {dtype}: one of {', '.join(TIERGATE_DTYPES)}"
            )
    types = tuple(t.upper() for t in args.llamacpp_types)
    for model_type in types:
        if model_type not in (*MODEL_TYPES, AS_SHIPPED):
            raise BenchConfigError(
                f"--llamacpp-types {model_type}: one of {', '.join((*MODEL_TYPES, AS_SHIPPED))}"
            )
    if args.threads < 1:
        raise BenchConfigError("--threads must be >= 1")
    if not args.tiergate_dtypes and not args.compare_llamacpp:
        raise BenchConfigError("nothing to run: no --tiergate-dtypes and no --compare-llamacpp")
    return PeerConfig(
        concurrency=concurrency,
        requests_per_level=per_level,
        tiergate_dtypes=tuple(args.tiergate_dtypes),
        llamacpp_types=types if args.compare_llamacpp else (),
        threads=args.threads,
        seed=args.seed,
        workload=args.workload,
        max_num_seqs=args.max_num_seqs or max(32, *concurrency),
        llamacpp_cache_dir=args.llamacpp_cache_dir,
        model_cache_dir=args.model_cache_dir,
        tiergate_kv_cache_bytes=args.tiergate_kv_cache_bytes,
        llamacpp_extra_args=tuple(shlex.split(args.llamacpp_extra_args)),
        build_jobs=args.build_jobs,
    )


# -- results -----------------------------------------------------------------------------------


@dataclass
class LevelRow:
    """One system and dtype at one concurrency level."""

    system: str  # TIERGATE or LLAMACPP
    dtype: str  # tiergate's dtype or the GGUF type
    stats: Any  # peer_client.LevelStats (Any: this module imports it lazily)
    server_cpu_s: float | None = None  # the server's CPU seconds over the level
    results: list[Any] = field(default_factory=list)  # peer_client.PeerResult


@dataclass(frozen=True)
class RatioRow:
    tiergate_dtype: str
    llamacpp_type: str
    concurrency: int
    tokens_per_s_ratio: float  # tiergate / llama.cpp: above 1, tiergate is faster
    tpot_p50_ratio: float  # tiergate / llama.cpp: below 1, tiergate is faster


@dataclass
class PeerReport:
    config: PeerConfig
    command: str
    machine: Any  # machine.MachineInfo
    tiergate_commit: str
    model_file: str
    llamacpp_version: Any = None  # llamacpp_build.LlamaCppVersion
    tiergate_flags: dict[str, str] = field(default_factory=dict)  # per dtype
    llamacpp_flags: str = ""
    openmp_wait: str = "each server's default"  # peer_servers.openmp_wait_label
    rows: list[LevelRow] = field(default_factory=list)
    # "<system> <dtype>: why" for each server that could not be measured (the run goes on)
    failures: list[str] = field(default_factory=list)
    wall_s: float = 0.0


def ratio_rows(rows: Sequence[LevelRow]) -> list[RatioRow]:
    """tiergate / llama.cpp at each level, for each tiergate dtype with a llama.cpp type of
    the same precision in the run."""
    by_key = {(r.system, r.dtype, r.stats.concurrency): r for r in rows}
    llama_types = {r.dtype for r in rows if r.system == LLAMACPP}
    ratios: list[RatioRow] = []
    for row in rows:
        if row.system != TIERGATE:
            continue
        partner = next((t for t in SAME_PRECISION.get(row.dtype, ()) if t in llama_types), None)
        if partner is None:
            continue
        other = by_key.get((LLAMACPP, partner, row.stats.concurrency))
        if other is None:
            continue
        ratios.append(RatioRow(
            row.dtype, partner, row.stats.concurrency,
            _divide(row.stats.output_tokens_per_s, other.stats.output_tokens_per_s),
            _divide(row.stats.tpot_p50_s, other.stats.tpot_p50_s),
        ))
    return ratios


def _divide(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.1f}"


def format_table(report: PeerReport) -> str:
    config, machine = report.config, report.machine
    lines = [
        f"tiergate bench peer: closed-loop streamed /v1/completions, text prompts, ignore_eos "
        f"(seed {config.seed})",
        f"machine: {machine.cpu_model}, {machine.num_cpus} CPUs, {machine.memory_gib:.1f} GiB, "
        f"{machine.system}; load average {machine.load_average_1m:.2f} at {machine.started_at}",
        f"tiergate: commit {report.tiergate_commit}; python {machine.python}, torch "
        f"{machine.torch}",
    ]
    if report.llamacpp_version is not None:
        version = report.llamacpp_version
        lines.append(f"llama.cpp: {version.label}"
                     + (f"; {version.server_version}" if version.server_version else ""))
    lines += [
        f"model: SmolLM2-135M-Instruct from {report.model_file}; {config.threads} threads per "
        f"server, one server at a time; OpenMP wait: {report.openmp_wait}",
    ]
    for dtype, flags in report.tiergate_flags.items():
        lines.append(f"tiergate serve --dtype {dtype} {flags}")
    if report.llamacpp_flags:
        lines.append(f"llama-server {report.llamacpp_flags} (KV cache at its default type "
                     f"unless set there)")
    levels = ", ".join(f"{c} x {n}" for c, n in zip(config.concurrency,
                                                      config.requests_per_level, strict=True))
    lines += [
        f"workload: {config.workload.name}, first requests cycled; concurrency x requests: "
        f"{levels}",
        f"command: {report.command}",
        "",
    ]
    header = (f"{'system':<10} {'dtype':<9} {'concurrent':>10} {'requests':>8} "
              f"{'output tok/s':>12} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
              f"{'TPOT p99':>9}")
    lines += [header + "   (times in ms)", "-" * len(header)]
    for row in report.rows:
        s = row.stats
        failed = f"  ({s.num_failed} failed)" if s.num_failed else ""
        lines.append(
            f"{row.system:<10} {row.dtype:<9} {s.concurrency:>10} {s.num_requests:>8} "
            f"{s.output_tokens_per_s:>12.1f} {_ms(s.ttft_p50_s):>9} {_ms(s.ttft_p99_s):>9} "
            f"{_ms(s.tpot_p50_s):>9} {_ms(s.tpot_p99_s):>9}{failed}"
        )
    ratios = ratio_rows(report.rows)
    if ratios:
        lines += ["", "tiergate / llama.cpp at the same precision (tok/s: above 1 is tiergate "
                  "faster; TPOT p50: below 1 is tiergate faster)"]
        ratio_header = f"{'tiergate':<9} {'llama.cpp':<9} {'concurrent':>10} {'tok/s':>7} " \
                       f"{'TPOT p50':>9}"
        lines += [ratio_header, "-" * len(ratio_header)]
        for ratio in ratios:
            lines.append(
                f"{ratio.tiergate_dtype:<9} {ratio.llamacpp_type:<9} {ratio.concurrency:>10} "
                f"{ratio.tokens_per_s_ratio:>6.2f}x {ratio.tpot_p50_ratio:>8.2f}x"
            )
    notes = _notes(report)
    if notes:
        lines += ["", *notes]
    lines.append(f"\nwall time {report.wall_s:.0f} s")
    return "\n".join(lines)


def _notes(report: PeerReport) -> list[str]:
    notes = [f"not measured: {failure}" for failure in report.failures]
    for row in report.rows:
        s = row.stats
        label = f"{row.system} {row.dtype} at {s.concurrency}"
        if s.num_prompt_mismatch:
            examples = [
                f"{r.request_id}: sent {r.num_prompt_tokens}, reported {r.prompt_tokens_reported}"
                for r in row.results
                if r.prompt_tokens_reported is not None
                and r.prompt_tokens_reported != r.num_prompt_tokens
            ][:3]
            notes.append(f"note: {label}: {s.num_prompt_mismatch} prompts counted differently "
                         f"by the server ({'; '.join(examples)})")
        if s.num_short:
            notes.append(f"note: {label}: {s.num_short} requests got fewer tokens than asked")
        if s.num_failed:
            errors = sorted({r.error or f"HTTP {r.status_code}" for r in row.results if not r.ok})
            notes.append(f"note: {label}: {s.num_failed} failed: {'; '.join(errors[:3])}")
        if s.cached_prompt_tokens:
            notes.append(f"note: {label}: {s.cached_prompt_tokens} prompt tokens served from "
                         f"the server's prefix cache")
    return notes


def _finite(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def report_json(report: PeerReport) -> dict[str, Any]:
    config = dataclasses.asdict(report.config)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in config.items()}
    return _finite({
        "benchmark": "tiergate bench peer",
        "command": report.command,
        "config": config,
        "machine": dataclasses.asdict(report.machine),
        "tiergate_commit": report.tiergate_commit,
        "model_file": report.model_file,
        "llamacpp": (dataclasses.asdict(report.llamacpp_version) | {
            "label": report.llamacpp_version.label}
            if report.llamacpp_version is not None else None),
        "tiergate_flags": report.tiergate_flags,
        "openmp_wait": report.openmp_wait,
        "llamacpp_flags": report.llamacpp_flags,
        "rows": [
            {
                "system": row.system,
                "dtype": row.dtype,
                **dataclasses.asdict(row.stats),
                "server_cpu_s": row.server_cpu_s,
                "requests": [dataclasses.asdict(r) for r in row.results],
            }
            for row in report.rows
        ],
        "ratios": [dataclasses.asdict(r) for r in ratio_rows(report.rows)],
        "failures": report.failures,
        "wall_s": report.wall_s,
    })


# -- the run -----------------------------------------------------------------------------------


def run_command(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    report = run_peer(config, command="tiergate " + shlex.join(sys.argv[1:]))
    document = report_json(report)
    if args.output is not None:
        args.output.write_text(json.dumps(document, indent=2) + "\n")
    if args.json:
        print(json.dumps(document, indent=2))
    else:
        print(format_table(report))
    return 1 if report.failures else 0


def _git_commit() -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
                                capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + (" (with uncommitted changes)" if dirty else "")


def _say(message: str, stream: TextIO = sys.stderr) -> None:
    print(f"[peer] {message}", file=stream, flush=True)


def run_peer(config: PeerConfig, command: str) -> PeerReport:
    from bench.serve.machine import MachineInfo
    from bench.serve.peer_client import PeerRequest
    from bench.serve.peer_prompts import PromptBuilder
    from bench.serve.peer_servers import openmp_wait_label
    from bench.workload import Workload
    from engine.checkpoints.gguf_checkpoint import GGUFCheckpoint
    from gateway.server.model_source import default_model_file
    from gateway.server.settings import GatewaySettings

    started = time.monotonic()
    try:
        workload = Workload.load(config.workload)
    except (OSError, ValueError, KeyError) as exc:
        raise BenchConfigError(f"--workload {config.workload}: {exc}") from None
    if not workload.requests:
        raise BenchConfigError(f"--workload {config.workload} has no requests")
    model_cache_dir = config.model_cache_dir or GatewaySettings().model_cache_dir
    model_file = default_model_file(model_cache_dir)
    checkpoint = GGUFCheckpoint.open(model_file)
    tokenizer = checkpoint.tokenizer()
    builder = PromptBuilder(lambda text: len(tokenizer.encode(text, add_special_tokens=False)))
    # Every level gets prompts of its own (the first requests' lengths, new text), so no
    # level finds the previous one's prompts in a server's prefix cache.
    shapes = [[workload.requests[i % len(workload.requests)] for i in range(count)]
              for count in config.requests_per_level]
    prompts = iter(builder.build_all(
        [shape.prompt_len for level in shapes for shape in level], config.seed
    ))
    level_requests: list[list[PeerRequest]] = []
    for concurrency, level in zip(config.concurrency, shapes, strict=True):
        level_requests.append([])
        for i, shape in enumerate(level):
            prompt = next(prompts)
            level_requests[-1].append(PeerRequest(
                f"c{concurrency}-r{i}", prompt.text, prompt.num_tokens, shape.output_len
            ))
    warmup = PeerRequest("warmup", builder.build(_WARMUP_PROMPT_TOKENS, 0).text,
                         _WARMUP_PROMPT_TOKENS, _WARMUP_OUTPUT_TOKENS)
    max_seq_len = max(r.num_prompt_tokens + r.max_tokens for rs in level_requests for r in rs)

    report = PeerReport(config=config, command=command, machine=MachineInfo.current(),
                        tiergate_commit=_git_commit(), model_file=model_file.name,
                        openmp_wait=openmp_wait_label(os.environ))
    work_root = Path(tempfile.mkdtemp(prefix="tiergate-peer-"))
    _say(f"{sum(map(len, level_requests))} prompts built; longest sequence {max_seq_len} "
         f"tokens; servers' files in {work_root}")

    from bench.serve.peer_servers import PEER_TENANT_TIER

    build = None
    if config.llamacpp_types:  # built first: a failed build costs no tiergate run
        from bench.serve.llamacpp_build import ensure_built

        build = ensure_built(config.llamacpp_cache_dir, jobs=config.build_jobs)
        report.llamacpp_version = build.version

    for dtype in config.tiergate_dtypes:
        server = _tiergate_server(config, dtype, work_root, model_cache_dir)
        kv_flag = ("" if server.kv_cache_bytes is None
                   else f" --kv-cache-bytes {server.kv_cache_bytes}")
        report.tiergate_flags[dtype] = (
            f"--max-num-seqs {server.max_num_seqs}{kv_flag} (other flags at their defaults; "
            f"tenant of tier {PEER_TENANT_TIER}, no quota)"
        )
        _measure_into(report, server, TIERGATE, dtype, level_requests, warmup)

    if build is not None:
        from bench.serve.llamacpp_build import quantized_model
        from bench.serve.peer_servers import LlamaServer

        per_slot = math.ceil((max_seq_len + 16) / 256) * 256
        for model_type in config.llamacpp_types:
            gguf = (model_file if model_type == AS_SHIPPED
                    else quantized_model(build, model_file, model_type))
            llama = LlamaServer(
                work_root / f"llama-{model_type}", config.threads, binary=build.server,
                model_file=gguf, parallel=config.max_num_seqs,
                ctx_size=per_slot * config.max_num_seqs, alias="SmolLM2-135M-Instruct",
                extra_args=config.llamacpp_extra_args,
            )
            report.llamacpp_flags = " ".join(llama.flags())
            _measure_into(report, llama, LLAMACPP, model_type, level_requests, warmup)
    report.wall_s = time.monotonic() - started
    return report


def _tiergate_server(config: PeerConfig, dtype: str, work_root: Path,
                     model_cache_dir: Path) -> Any:
    from bench.serve.peer_servers import TiergateServer

    return TiergateServer(
        work_root / f"tiergate-{dtype}", config.threads, dtype=dtype,
        max_num_seqs=config.max_num_seqs, kv_cache_bytes=config.tiergate_kv_cache_bytes,
        model_cache_dir=model_cache_dir,
    )


def _measure_into(report: PeerReport, server: Any, system: str, dtype: str,
                  level_requests: Sequence[Sequence[Any]], warmup: Any) -> None:
    """The server's rows into the report; a server that fails to start or to answer the
    warm-up goes into report.failures instead, and the run goes on with the next one."""
    try:
        report.rows += _measure(server, system, dtype, report.config, level_requests, warmup)
    except BenchServeError as exc:
        _say(f"{system} {dtype} not measured: {exc}")
        report.failures.append(f"{system} {dtype}: {str(exc).splitlines()[0]}")


def _measure(server: Any, system: str, dtype: str, config: PeerConfig,
             level_requests: Sequence[Sequence[Any]], warmup: Any) -> list[LevelRow]:
    from bench.serve.loadgen import collector_paused
    from bench.serve.peer_client import LevelStats, run_level

    rows: list[LevelRow] = []
    _say(f"starting {system} {dtype}")
    with server:
        model = server.model
        warm = asyncio.run(run_level(server.base_url, model, [warmup], 1,
                                     api_key=server.api_key))
        if not warm.results or not warm.results[0].ok:
            error = warm.results[0].error if warm.results else "no result"
            raise BenchServeError(f"{system} {dtype}: the warm-up request failed: {error}; "
                                  f"end of {server.log_path}:\n{server.log_tail()}")
        for concurrency, requests in zip(config.concurrency, level_requests, strict=True):
            cpu_before = server.cpu_time_s()
            with collector_paused():
                run = asyncio.run(run_level(server.base_url, model, list(requests),
                                            concurrency, api_key=server.api_key))
            cpu_after = server.cpu_time_s()
            stats = LevelStats.of(run)
            _say(f"{system} {dtype} at {concurrency}: {stats.output_tokens_per_s:.1f} tok/s, "
                 f"TPOT p50 {_ms(stats.tpot_p50_s)} ms, {stats.num_failed} failed")
            cpu_s = (cpu_after - cpu_before
                     if cpu_before is not None and cpu_after is not None else None)
            rows.append(LevelRow(system, dtype, stats, cpu_s, run.results))
    return rows
