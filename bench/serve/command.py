"""`tiergate bench serve`: the serving benchmark's options and its two modes.

One run (default): the workload at --request-rate against --url (tenants created through the
admin API with TIERGATE_ADMIN_TOKEN) or against a server started here (--variant).
--sweep: calibrate, then every configuration at every load factor, servers started here.
Tables go to stdout, progress to stderr; --json prints the JSON document instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from bench.serve.errors import BenchConfigError
from bench.serve.plan import ArrivalProcess, PromptVocabulary, retime
from bench.serve.server import VARIANTS, BenchServer, EngineLimits
from bench.serve.sweep_config import MIN_RUN_DURATION_S, OBJECTIVES_PER_RUN, SweepConfig
from bench.workload import BENCH_INPUTS, Workload

if TYPE_CHECKING:
    from policies import TierTable

# The load generator, statistics and reports are imported where a run needs them: this
# module is imported for the options alone too (`tiergate bench serve --help`).

__all__ = ["add_arguments", "run_command"]

DEFAULT_WORKLOAD = BENCH_INPUTS / "workload-serve-600.json"
_ADMIN_TOKEN_ENV = "TIERGATE_ADMIN_TOKEN"
_ONE_RUN_DURATION_S = 60.0
# --quick: a smoke run of every step in a few minutes (SweepConfig fields; flags still win).
_QUICK_SWEEP: dict[str, Any] = {
    "load_factors": (0.5, 2.0),
    "duration_s": 6.0,
    "capacity_concurrency": 4,
    "num_capacity_completions": 6,
    "num_prefill_probes": 2,
    "num_calibrations": 1,
    "fairness_variants": (),
    "fairness_duration_s": 6.0,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from gateway.server.settings import GatewaySettings

    defaults = GatewaySettings()
    sweep = _sweep_defaults()
    mode = parser.add_argument_group("mode")
    mode.add_argument("--sweep", action="store_true",
                      help="calibrate, then every --variants at every --loads (servers started "
                      "here)")
    mode.add_argument("--url", help="benchmark this running server (one run; tenants created "
                      f"with {_ADMIN_TOKEN_ENV}); default: start one (--variant)")
    mode.add_argument("--quick", action="store_true",
                      help="smoke run: loads 0.5,2, 6 s each, small calibration, no fairness")
    work = parser.add_argument_group("workload")
    work.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    work.add_argument("--arrivals", choices=[a.value for a in ArrivalProcess],
                      default=ArrivalProcess.WORKLOAD.value,
                      help="the file's arrival times scaled to the rate, or new Poisson ones")
    work.add_argument("--request-rate", type=float, default=None,
                      help="one run: offered requests/s (default: the workload's own rate)")
    work.add_argument("--duration", type=float, default=None,
                      help=f"seconds of arrivals per run (sweep: {OBJECTIVES_PER_RUN:g} x the "
                      f"slowest scaled TTFT objective, at least {MIN_RUN_DURATION_S:g}; one "
                      f"run: {_ONE_RUN_DURATION_S:g}; --quick: {_QUICK_SWEEP['duration_s']:g})")
    work.add_argument("--num-requests", type=int, default=None, help="one run: at most N")
    work.add_argument("--seed", type=int, default=0)
    work.add_argument("--slo-scale", type=float, default=None,
                      help="multiply the default tier objectives by this (sweep: instead of "
                      "measuring it; one run: default 1)")
    sweep_group = parser.add_argument_group("sweep")
    sweep_group.add_argument("--capacity", type=float, default=None, metavar="RPS",
                             help="requests/s the loads are multiples of, instead of measuring "
                             "it (with --slo-scale: repeat an earlier sweep exactly)")
    sweep_group.add_argument("--capacity-each-turn", action="store_true",
                             help="measure the capacity again (one closed-loop attempt on a "
                             "fresh FCFS server) before every load repetition, and offer its "
                             "loads as multiples of that: loads that follow a host whose "
                             "speed drifts")
    sweep_group.add_argument("--loads", default=None, help="offered loads, x measured "
                             f"capacity (default {_joined(sweep['load_factors'])})")
    sweep_group.add_argument("--variants", default=None, help="server configurations, of "
                             f"{', '.join(VARIANTS)} (default {_joined(sweep['variants'])})")
    sweep_group.add_argument("--fairness-variants", default=None,
                             help="configurations that also run the two-tenant fairness test, "
                             f"'' for none (default {_joined(sweep['fairness_variants'])})")
    sweep_group.add_argument("--fairness-load", type=float, default=None,
                             help="light + heavy tenants' offered load, x capacity (default "
                             f"{sweep['fairness_load_factor']:g})")
    sweep_group.add_argument("--fairness-duration", type=float, default=None,
                             help="seconds of arrivals per fairness run "
                             f"({sweep['fairness_duration_s']:g})")
    sweep_group.add_argument("--heavy-ratio", type=float, default=None,
                             help=f"heavy tenant's rate / light's ({sweep['heavy_ratio']:g})")
    sweep_group.add_argument("--capacity-concurrency", type=int, default=None,
                             help="requests the closed-loop capacity run keeps in flight "
                             "(default: --max-num-seqs)")
    sweep_group.add_argument("--capacity-completions", type=int, default=None,
                             help="completions it counts before stopping "
                             f"({sweep['num_capacity_completions']})")
    sweep_group.add_argument("--prefill-probes", type=int, default=None,
                             help=f"lone 1024-token requests ({sweep['num_prefill_probes']})")
    sweep_group.add_argument("--calibrations", type=int, default=None,
                             help="calibration attempts, the middle prefill and capacity kept "
                             f"({sweep['num_calibrations']})")
    sweep_group.add_argument("--repeats", type=int, default=None,
                             help="run every load, and the fairness test, this many times, "
                             "interleaved; the headline is over all of them together, then "
                             f"each ({sweep['repeats']})")
    server = parser.add_argument_group("servers started here")
    server.add_argument("--variant", choices=list(VARIANTS), default="tiered",
                        help="one run without --url: the configuration to start")
    server.add_argument("--model", type=Path, default=None,
                        help="checkpoint directory (default: the demo model)")
    server.add_argument("--demo-model-dir", type=Path, default=defaults.demo_model_dir)
    server.add_argument("--kv-cache-bytes", type=int, default=defaults.kv_cache_bytes)
    server.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    server.add_argument("--max-num-batched-tokens", type=int,
                        default=defaults.max_num_batched_tokens)
    server.add_argument("--work-dir", type=Path, default=None,
                        help="server configs, databases and logs (default: a temp dir)")
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print JSON instead of tables")
    out.add_argument("--output", type=Path, default=None, help="also write the JSON here")
    out.add_argument("--plot", type=Path, default=None, metavar="DIR",
                     help="write PNG figures into DIR (matplotlib)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_command(args: argparse.Namespace) -> int:
    """Run from parsed arguments; the exit code."""
    # SIGTERM unwinds like Ctrl-C, so the servers started here are stopped on the way out.
    previous = signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        document, text = _run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if args.output is not None:  # compact: a sweep holds every request
        args.output.write_text(json.dumps(document, separators=(",", ":")) + "\n")
    print(json.dumps(document, indent=2) if args.json else text)
    return 0


def _run(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    model_dir = _model_dir(args)
    vocabulary = PromptVocabulary.of_model(model_dir)
    try:
        workload = Workload.load(args.workload)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BenchConfigError(f"--workload {args.workload}: {exc}") from None
    limits = EngineLimits(args.model, args.demo_model_dir, args.kv_cache_bytes,
                          args.max_num_seqs, args.max_num_batched_tokens)
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="tiergate-bench-"))
    if args.sweep:
        return _sweep(args, workload, vocabulary, limits, work_dir)
    return _one_run(args, workload, vocabulary, limits, work_dir)


def _sweep(
    args: argparse.Namespace,
    workload: Workload,
    vocabulary: PromptVocabulary,
    limits: EngineLimits,
    work_dir: Path,
) -> tuple[dict[str, Any], str]:
    from bench.serve.report import format_sweep, sweep_json
    from bench.serve.sweep import run_sweep

    flags = {
        "variants": None if args.variants is None else _names(args.variants),
        "load_factors": None if args.loads is None else _floats(args.loads),
        "duration_s": args.duration,
        "capacity_concurrency": args.capacity_concurrency,
        "num_capacity_completions": args.capacity_completions,
        "num_prefill_probes": args.prefill_probes,
        "num_calibrations": args.calibrations,
        "repeats": args.repeats,
        "fairness_variants": (
            None if args.fairness_variants is None else _names(args.fairness_variants)
        ),
        "fairness_load_factor": args.fairness_load,
        "fairness_duration_s": args.fairness_duration,
        "heavy_ratio": args.heavy_ratio,
    }
    given = {name: value for name, value in flags.items() if value is not None}
    config = SweepConfig(
        workload=workload,
        vocabulary=vocabulary,
        limits=limits,
        work_dir=work_dir,
        arrivals=ArrivalProcess(args.arrivals),
        slo_scale=args.slo_scale,
        capacity_rps=args.capacity,
        capacity_each_turn=args.capacity_each_turn,
        seed=args.seed,
        progress=not args.no_progress,
        **{**(_QUICK_SWEEP if args.quick else {}), **given},
    )
    result = run_sweep(config, log=_log)
    if args.plot is not None:
        from bench.serve.plots import plot_sweep

        for path in plot_sweep(result, args.plot):
            _log(f"wrote {path}")
    return sweep_json(result), format_sweep(result)


def _one_run(
    args: argparse.Namespace,
    workload: Workload,
    vocabulary: PromptVocabulary,
    limits: EngineLimits,
    work_dir: Path,
) -> tuple[dict[str, Any], str]:
    from bench.serve.report import format_run, run_json
    from bench.serve.session import BenchTarget
    from policies import TierTable

    tiers = TierTable().scaled(args.slo_scale or 1.0)
    rate = args.request_rate or workload.rate_rps
    timed = retime(workload, rate, arrivals=ArrivalProcess(args.arrivals),
                   duration_s=_one_run_duration_s(args),
                   num_requests=args.num_requests, seed=args.seed)
    tenants = sorted({(r.tenant, r.tier) for r in timed.requests})
    progress = not args.no_progress
    label = f"{args.variant if args.url is None else 'server'} @ {rate:g} req/s"
    if args.url is not None:
        token = os.environ.get(_ADMIN_TOKEN_ENV)
        if not token:
            raise BenchConfigError(f"--url needs {_ADMIN_TOKEN_ENV} to create the tenants")
        target = BenchTarget.provision(args.url, token, tenants, vocabulary, progress=progress)
        record = target.run(timed, label, tiers, rate)
    else:
        with BenchServer(VARIANTS[args.variant], tiers, limits, work_dir) as server:
            target = BenchTarget.provision(server.base_url, server.admin_token, tenants,
                                           vocabulary, progress=progress)
            record = target.run(timed, label, tiers, rate)
    if args.plot is not None:
        from bench.serve.plots import plot_run

        for path in plot_run(record.results, tiers, args.plot):
            _log(f"wrote {path}")
    return _with_tiers(run_json(record), tiers), format_run(record)


def _with_tiers(document: dict[str, Any], tiers: TierTable) -> dict[str, Any]:
    return {"tiers": [dataclasses.asdict(t) for t in tiers], **document}


def _model_dir(args: argparse.Namespace) -> Path:
    if args.model is not None:
        return Path(args.model)
    from gateway.server.model_source import demo_model_dir

    return demo_model_dir(args.demo_model_dir)


def _one_run_duration_s(args: argparse.Namespace) -> float:
    if args.duration is not None:
        return float(args.duration)
    return float(_QUICK_SWEEP["duration_s"]) if args.quick else _ONE_RUN_DURATION_S


def _sweep_defaults() -> dict[str, Any]:
    return {
        f.name: f.default
        for f in dataclasses.fields(SweepConfig)
        if f.default is not dataclasses.MISSING
    }


def _joined(values: tuple[Any, ...]) -> str:
    return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(value) for value in _names(text))
    except ValueError:
        raise BenchConfigError(f"--loads must be numbers separated by commas: {text!r}") from None


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
