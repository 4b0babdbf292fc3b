"""Valid but costly requests, and numbers at the edge of JSON, from one tenant against another
on `tiergate serve` of the default model, measured from outside.

For each attack (`--attacks`, default all) an attacking tenant with no limits sends one kind
of request back to back from `--attackers` processes (connections), while a victim tenant
sends `--victim-requests` short streamed chats one after another (the attacking processes at
`--attacker-nice`, 19 by default, so that they take what the server leaves of a host they
share with it, as clients elsewhere would); the victim's requests are
timed alone first (once for plain chats, once for chats with a JSON schema, which the
`schema-flood` row's victim sends). Printed per row: the victim's TTFT p50 / p99 and their
ratios to its time alone, the slowest `/health/live` answer, and what the attacker got
(status codes, and the error codes of 4xx and of errors inside streams).

The attacks (issue 53's):
- `tool-call-spaces`: tools offered, `guided_regex` "<tool_call>" then 1,800 spaces: the
  reply's tool calls are parsed when it ends;
- `ambiguous-grammar`: the Lark grammar `s: s s | s s s | "a" | "aa"`, min_tokens =
  max_tokens = 600, n = 4: its masks grow slower token by token;
- `stop-ids-body`: n = 8 with 400,000 `stop_token_ids` (a 2.7 MB body);
- `stop-strings-n128` and `stop-strings-n4`: completions with four 1,024-character stop
  strings that the output (`guided_regex` a{600}) keeps nearly matching, n = 128 and n = 4;
- `numbers`: temperature and top_p as 401-digit integers, a schema's minimum and a forced
  tool parameter's maximum of 1e400, in turn;
- `schema-flood`: a new JSON schema in every request (40 properties), against a victim whose
  requests carry one schema of their own.
Then the admin API's ids at the edge (`?tenant_id=²`, 23 digits), each asked once.

The server is `tiergate serve` of the default model (converted once into the model cache)
started in the current directory with 1 GiB of KV cache, SQLite, tiered scheduling with
shedding (serve's defaults), so running this file from another checkout's directory measures
that checkout:

    cd OTHER_CHECKOUT && python /path/to/tiergate/ops/bench/attack_costly.py [--seed 0]
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import random
import string
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import torch

from bench.serve.provision import provision_tenants, served_model_name
from bench.serve.server import VARIANTS, BenchServer, EngineLimits
from bench.stats import Percentiles
from gateway.server.model_source import default_model_file, gguf_model_dir
from gateway.server.settings import GatewaySettings
from policies import TierTable

_AMBIGUOUS = 's: s s | s s s | "a" | "aa"\nstart: s\n'
_TOOL = {"type": "function", "function": {
    "name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}

# Built in the attacking process: (path, body) for its n-th request.
Attack = Callable[[str, int, random.Random], tuple[str, bytes]]


def _chat(model: str, **fields: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "Say something."}],
            **fields}


def _tool_call_spaces(model: str, _: int, __: random.Random) -> tuple[str, bytes]:
    return "/v1/chat/completions", json.dumps(_chat(
        model, max_tokens=1200, tools=[_TOOL], guided_regex="<tool_call>" + " " * 1800,
    )).encode()


def _ambiguous_grammar(model: str, _: int, __: random.Random) -> tuple[str, bytes]:
    return "/v1/chat/completions", json.dumps(_chat(
        model, max_tokens=600, min_tokens=600, n=4, guided_grammar=_AMBIGUOUS,
    )).encode()


def _stop_ids_body(model: str, _: int, rng: random.Random) -> tuple[str, bytes]:
    ids = [rng.randrange(49152) for _ in range(400_000)]
    return "/v1/chat/completions", json.dumps(_chat(
        model, max_tokens=8, n=8, stop_token_ids=ids)).encode()


def _stop_strings(n: int) -> Attack:
    def attack(model: str, _: int, __: random.Random) -> tuple[str, bytes]:
        stops = ["a" * 1023 + end for end in "bcde"]
        return "/v1/completions", json.dumps({
            "model": model, "prompt": "a", "n": n, "max_tokens": 600, "stop": stops,
            "guided_regex": "a{600}",
        }).encode()

    return attack


def _numbers(model: str, index: int, _: random.Random) -> tuple[str, bytes]:
    huge = "1" + "0" * 400
    base = json.dumps(_chat(model, max_tokens=4))[:-1]
    bodies = [
        f'{base}, "temperature": {huge}}}',
        f'{base}, "top_p": {huge}}}',
        f'{base}, "response_format": {{"type": "json_schema", "json_schema": {{"name": "n", '
        f'"schema": {{"type": "number", "minimum": 1e400}}}}}}}}',
        f'{base}, "tool_choice": "required", "tools": [{{"type": "function", "function": '
        f'{{"name": "f", "parameters": {{"type": "object", "properties": {{"x": '
        f'{{"type": "number", "maximum": 1e400}}}}}}}}}}]}}',
    ]
    return "/v1/chat/completions", bodies[index % len(bodies)].encode()


def _random_schema(rng: random.Random) -> dict[str, Any]:
    kinds = [{"type": "string", "maxLength": 20}, {"type": "integer"}, {"type": "boolean"},
             {"type": "number", "minimum": 0}, {"enum": ["x", "y", "z"]}]
    names = ["".join(rng.choices(string.ascii_lowercase, k=8)) for _ in range(40)]
    return {"type": "object", "properties": {n: rng.choice(kinds) for n in names},
            "required": names[:5], "additionalProperties": False}


def _schema_flood(model: str, _: int, rng: random.Random) -> tuple[str, bytes]:
    return "/v1/chat/completions", json.dumps(_chat(
        model, max_tokens=4, response_format={"type": "json_schema", "json_schema": {
            "name": "flood", "schema": _random_schema(rng)}})).encode()


ATTACKS: dict[str, Attack] = {
    "tool-call-spaces": _tool_call_spaces,
    "ambiguous-grammar": _ambiguous_grammar,
    "stop-ids-body": _stop_ids_body,
    "stop-strings-n128": _stop_strings(128),
    "stop-strings-n4": _stop_strings(4),
    "numbers": _numbers,
    "schema-flood": _schema_flood,
}
_VICTIM_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 8}},
                  "required": ["answer"], "additionalProperties": False}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attacks", default=",".join(ATTACKS))
    parser.add_argument("--attackers", type=int, default=2)
    parser.add_argument("--victim-requests", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attacker-nice", type=int, default=19,
                        help="niceness of the attacking processes (19: they take what the "
                             "server leaves of the cores, as clients on other hosts would; 0: "
                             "they compete with it for the two cores)")
    args = parser.parse_args()
    names = [name for name in args.attacks.split(",") if name]
    for name in names:
        if name not in ATTACKS:
            parser.error(f"unknown attack {name!r}: one of {', '.join(ATTACKS)}")
    cache_dir = GatewaySettings().model_cache_dir
    model_dir = gguf_model_dir(default_model_file(cache_dir), cache_dir, torch.float32)
    limits = EngineLimits(model_dir=model_dir, demo_model_dir=GatewaySettings().demo_model_dir,
                          kv_cache_bytes=1 << 30)
    rows: list[tuple[str, ...]] = []
    with tempfile.TemporaryDirectory() as work, BenchServer(
        VARIANTS["tiered"], TierTable(), limits, Path(work), start_timeout_s=600
    ) as server:
        keys = provision_tenants(server.base_url, server.admin_token,
                                 {"attacker": "standard", "victim": "standard"})
        model = served_model_name(server.base_url, keys["victim"])
        alone = {
            kind: _victim_phase(server.base_url, keys["victim"], model, kind, None, args)
            for kind in ("chat", "schema")
        }
        for kind, (ttfts, live_s, _) in alone.items():
            ttft = Percentiles.of(ttfts)
            rows.append((f"victim alone ({kind})", _ms(ttft.p50), _ms(ttft.p99), "", "",
                         _ms(max(live_s)), "-"))
        for name in names:
            kind = "schema" if name == "schema-flood" else "chat"
            ttfts, live_s, answers = _victim_phase(server.base_url, keys["victim"], model,
                                                   kind, (name, keys["attacker"]), args)
            ttft, base = Percentiles.of(ttfts), Percentiles.of(alone[kind][0])
            rows.append((name, _ms(ttft.p50), _ms(ttft.p99), f"{ttft.p50 / base.p50:.2f}",
                         f"{ttft.p99 / base.p99:.2f}", _ms(max(live_s)),
                         ", ".join(f"{n} x {a}" for a, n in sorted(answers.items())) or "-"))
        admin = _admin_edges(server.base_url, server.admin_token)
    print(f"tiergate serve, default model ({model}), 1 GiB KV cache, tiered with shedding; "
          f"{args.attackers} attacking connections from one unlimited tenant (nice "
          f"{args.attacker_nice}); victim: "
          f"{args.victim_requests} streamed chats one after another (max_tokens 8); seed "
          f"{args.seed}; {os.cpu_count()} CPUs")
    header = ("attack", "victim TTFT p50 ms", "p99 ms", "p50 / alone", "p99 / alone",
              "/health/live max ms", "attacker answers")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()
    print("| admin API edge | status (code) |")
    print("|---|---|")
    for path, answer in admin:
        print(f"| `{path}` | {answer} |")


def _victim_phase(
    base_url: str, key: str, model: str, kind: str, attack: tuple[str, str] | None,
    args: argparse.Namespace,
) -> tuple[list[float], list[float], collections.Counter[str]]:
    stop = threading.Event()
    live_s: list[float] = []

    def probe_live() -> None:
        with httpx.Client(base_url=base_url, timeout=300) as client:
            while not stop.is_set():
                start = time.perf_counter()
                client.get("/health/live")
                live_s.append(time.perf_counter() - start)
                time.sleep(0.1)

    context = multiprocessing.get_context("spawn")
    stop_attack = context.Event()
    answers_queue: multiprocessing.Queue[dict[str, int]] = context.Queue()
    sending = context.Semaphore(0)
    attackers = [] if attack is None else [
        context.Process(target=_attack, args=(base_url, attack[1], model, attack[0],
                                              args.seed * 100 + index, args.attacker_nice,
                                              stop_attack, sending, answers_queue))
        for index in range(args.attackers)
    ]
    for attacker in attackers:
        attacker.start()
    for _ in attackers:
        assert sending.acquire(timeout=300), "an attacker did not start"
    prober = threading.Thread(target=probe_live)
    prober.start()
    time.sleep(3.0 if attackers else 0.0)  # the attack under way
    ttfts = [_victim_ttft(base_url, key, model, kind, index)
             for index in range(args.victim_requests)]
    stop.set()
    stop_attack.set()
    answers: collections.Counter[str] = collections.Counter()
    for _ in attackers:
        answers.update(answers_queue.get(timeout=900))
    for attacker in attackers:
        attacker.join()
    prober.join()
    return ttfts, live_s, answers


def _victim_ttft(base_url: str, key: str, model: str, kind: str, index: int) -> float:
    """Seconds from sending one short streamed chat to its first content chunk; a refused
    one (shed) is retried after its delay and timed from the first try."""
    body = _chat(model, max_tokens=8, stream=True)
    body["messages"] = [{"role": "user", "content": f"question {index}: hello"}]
    if kind == "schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "victim", "schema": _VICTIM_SCHEMA}}
    start = time.perf_counter()
    with httpx.Client(base_url=base_url, timeout=300) as client:
        while True:
            with client.stream("POST", "/v1/chat/completions", json=body,
                               headers={"authorization": f"Bearer {key}"}) as response:
                if response.status_code == 429:
                    time.sleep(float(response.headers.get("retry-after-ms", "100")) / 1000)
                    continue
                response.raise_for_status()
                first: float | None = None
                for line in response.iter_lines():  # read to its end
                    if first is None and line.startswith("data: ") and '"content"' in line:
                        first = time.perf_counter() - start
            assert first is not None, "a victim stream without content"
            return first


def _attack(base_url: str, key: str, model: str, name: str, seed: int, nice: int,
            stop: Any, sending: Any, answers_queue: Any) -> None:
    """One attacking connection sending its kind of request back to back until stop."""
    os.nice(nice)
    rng = random.Random(seed)
    build = ATTACKS[name]
    answers: collections.Counter[str] = collections.Counter()
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    with httpx.Client(base_url=base_url, timeout=600) as client:
        sending.release()
        index = 0
        while not stop.is_set():
            path, body = build(model, index, rng)
            index += 1
            try:
                response = client.post(path, content=body, headers=headers)
                answers[_answer(response)] += 1
            except httpx.HTTPError as exc:
                answers[type(exc).__name__] += 1
    answers_queue.put(dict(answers))


def _answer(response: httpx.Response) -> str:
    if response.status_code == 200:
        return "200"
    try:
        code = response.json()["error"].get("code") or response.json()["error"].get("type")
    except (ValueError, KeyError, AttributeError):
        code = None
    return f"{response.status_code} {code}" if code else str(response.status_code)


def _admin_edges(base_url: str, admin_token: str) -> list[tuple[str, str]]:
    answers = []
    with httpx.Client(base_url=base_url, headers={"x-admin-token": admin_token},
                      timeout=30) as client:
        for path in ("/admin/v1/billing/usage?start=2026-11-01&end=2026-11-02&tenant_id=%C2%B2",
                     "/admin/v1/billing/usage?start=2026-11-01&end=2026-11-02"
                     "&tenant_id=12345678901234567890123",
                     "/admin/v1/tenants/12345678901234567890123",
                     "/admin/v1/keys/12345678901234567890123",
                     "/admin/v1/audit?before=%C2%B2"):
            try:
                answers.append((path, _answer(client.get(path))))
            except httpx.HTTPError as exc:
                answers.append((path, type(exc).__name__))
    return answers


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f}"


if __name__ == "__main__":
    main()
