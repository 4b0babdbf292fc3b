"""Stop strings as an attack (issue 36's stop-string row): does a tenant that sends the longest
stop strings the server accepts slow another tenant's decoding more than the same load
without them?

Three phases against one `tiergate serve --model demo` (the benchmark's BenchServer, started
in the current directory, tiered without shedding): the victim alone; attackers sending
`--attackers` streams of completions with n = `--n` and `--max-tokens` tokens each, no stop
strings; the same with four stop strings of MAX_STOP_STRING_CHARS / 4 characters each (the
total the server accepts; random text, so they never match and every one is checked at every
step of every sample); the two loaded phases alternate, `--rounds` times each. The victim
sends streamed chats one after another. Printed: the victim's TPOT p50/p99 per kind of phase,
and the with-stops / without-stops ratios (the issue asks 1.2x at most).

    python ops/bench/stop_strings.py [--seed 0]
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import string
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.serve.provision import provision_tenants
from bench.serve.server import VARIANTS, BenchServer, EngineLimits
from bench.stats import Percentiles
from engine import MAX_STOP_STRING_CHARS
from gateway.server.settings import GatewaySettings
from policies import TierTable

_MODEL = "tiergate-demo"
_NUM_STOPS = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--victim-requests", type=int, default=20)
    parser.add_argument("--victim-tokens", type=int, default=32)
    parser.add_argument("--attackers", type=int, default=2)
    parser.add_argument("--n", type=int, default=16, help="samples per attacking request")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2, help="loaded phases of each kind")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    alphabet = string.ascii_letters + string.digits + " "
    stops = [
        "".join(rng.choice(alphabet) for _ in range(MAX_STOP_STRING_CHARS // _NUM_STOPS))
        for _ in range(_NUM_STOPS)
    ]
    limits = EngineLimits(model_dir=None, demo_model_dir=GatewaySettings().demo_model_dir)
    with tempfile.TemporaryDirectory() as work, BenchServer(
        VARIANTS["tiered-noshed"], TierTable(), limits, Path(work)
    ) as server:
        keys = provision_tenants(server.base_url, server.admin_token,
                                 {"attacker": "standard", "victim": "standard"})
        # The loaded phases alternate, --rounds times each, so that neither always runs
        # on a server that has run longer.
        phases: list[tuple[str, int, list[str] | None]] = [("alone", 0, None)]
        for _ in range(args.rounds):
            phases += [("load, no stop strings", args.attackers, None),
                       ("load, longest stop strings", args.attackers, stops)]
        tpots: dict[str, list[float]] = {}
        done: dict[str, int] = {}
        for name, num_attackers, stop in phases:
            phase_tpots, num_done = _phase(server.base_url, keys, num_attackers, stop, args)
            tpots.setdefault(name, []).extend(phase_tpots)
            done[name] = done.get(name, 0) + num_done
    print(f"attack: {args.attackers} streams of completions, n={args.n}, max_tokens "
          f"{args.max_tokens}, ignore_eos; stops: none or {_NUM_STOPS} x "
          f"{MAX_STOP_STRING_CHARS // _NUM_STOPS} characters; victim: {args.victim_requests} "
          f"streamed chats, {args.victim_tokens} tokens each (demo model, seed {args.seed})")
    print("| phase | victim TPOT p50 ms | p99 ms | attacker requests done |")
    print("|---|---|---|---|")
    summary = {name: Percentiles.of(values) for name, values in tpots.items()}
    for name, tpot in summary.items():
        print(f"| {name} | {tpot.p50 * 1000:.1f} | {tpot.p99 * 1000:.1f} | {done[name]} |")
    base, attacked = summary[phases[1][0]], summary[phases[2][0]]
    print(f"with / without stop strings: p50 {attacked.p50 / base.p50:.2f}x, "
          f"p99 {attacked.p99 / base.p99:.2f}x")


def _phase(
    base_url: str, keys: dict[str, str], num_attackers: int, stops: list[str] | None,
    args: argparse.Namespace,
) -> tuple[list[float], int]:
    # Attackers in processes of their own, so they do not take the GIL from the victim.
    context = multiprocessing.get_context("spawn")
    stop_attack = context.Event()
    sending = context.Semaphore(0)
    done: multiprocessing.Queue[int] = context.Queue()
    body = {"model": _MODEL, "prompt": "tell me a long story", "n": args.n,
            "max_tokens": args.max_tokens, "ignore_eos": True, "stream": True,
            **({"stop": stops} if stops else {})}
    attackers = [
        context.Process(target=_attack, args=(base_url, keys["attacker"], body, stop_attack,
                                              sending, done))
        for _ in range(num_attackers)
    ]
    for attacker in attackers:
        attacker.start()
    for _ in attackers:
        assert sending.acquire(timeout=120), "an attacker did not start"
    time.sleep(3.0 if num_attackers else 0.0)  # the attack's streams running
    tpots = [_victim_tpot(base_url, keys["victim"], index, args.victim_tokens)
             for index in range(args.victim_requests)]
    stop_attack.set()
    num_done = sum(done.get(timeout=600) for _ in attackers)
    for attacker in attackers:
        attacker.join()
    return tpots, num_done


def _victim_tpot(base_url: str, key: str, index: int, num_tokens: int) -> float:
    """Seconds per output token after the first, of one streamed chat."""
    body = {"model": _MODEL, "max_tokens": num_tokens, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"question {index}: hello"}]}
    times: list[float] = []
    with httpx.Client(base_url=base_url, timeout=300) as client, client.stream(
        "POST", "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
    ) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                times.append(time.perf_counter())
    assert len(times) >= 2, "fewer than two content chunks"
    return (times[-1] - times[0]) / (len(times) - 1)


def _attack(
    base_url: str, key: str, body: dict[str, Any], stop: Any, sending: Any, done: Any
) -> None:
    """One attacking stream after another until stop is set; reports how many finished."""
    num_done = 0
    with httpx.Client(base_url=base_url, timeout=600) as client:
        sending.release()
        while not stop.is_set():
            with client.stream("POST", "/v1/completions", json=body,
                               headers={"authorization": f"Bearer {key}"}) as response:
                response.raise_for_status()
                for _ in response.iter_lines():
                    if stop.is_set():
                        break
            num_done += 1
    done.put(num_done)


if __name__ == "__main__":
    main()
