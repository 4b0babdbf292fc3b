"""What a benchmark run sends and when: a workload re-timed to an offered load, turned into
token-id prompts for the served model's vocabulary.

Arrival times come from the workload file scaled to the target rate (its own Poisson
process, stretched or squeezed), or from a fresh seeded Poisson process at that rate over the
file's requests in order; a run that needs more requests than the file has takes the file
again (new request ids, so new prompts). Prompt ids come from `Workload.prompts` (seeded,
shared prefix drawn once per tenant), mapped onto the model's ordinary ids so no special
token is ever sent.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path

from bench.serve.errors import BenchConfigError
from bench.workload import FIRST_ORDINARY_TOKEN_ID, Workload, WorkloadRequest
from engine.models.config import ModelConfig

__all__ = [
    "HEAVY_TENANT",
    "LIGHT_TENANT",
    "ArrivalProcess",
    "PlannedRequest",
    "PromptVocabulary",
    "cycled",
    "plan_requests",
    "retime",
    "two_tenant_workload",
]


# The two tenants of the fairness workload (two_tenant_workload).
LIGHT_TENANT = "light"
HEAVY_TENANT = "heavy"


class ArrivalProcess(StrEnum):
    WORKLOAD = "workload"  # the file's arrival times, scaled to the target rate
    POISSON = "poisson"  # a new seeded Poisson process at the target rate


@dataclass(frozen=True)
class PromptVocabulary:
    """The token ids a prompt may use: every id of the model except its special ones."""

    vocab_size: int  # the model's number of token ids
    special_token_ids: frozenset[int]  # never sent (bos, eos, chat headers, ...)

    @classmethod
    def of_model(cls, model_dir: Path) -> PromptVocabulary:
        """The vocabulary of a checkpoint directory: config.json's size, and the special
        tokens of tokenizer.json (ids 0-2, the workload convention, when it has none)."""
        from tokenizers import Tokenizer

        vocab_size = ModelConfig.from_file(model_dir).vocab_size
        special = set(range(FIRST_ORDINARY_TOKEN_ID))
        tokenizer_path = model_dir / "tokenizer.json"
        if tokenizer_path.is_file():
            added = Tokenizer.from_file(str(tokenizer_path)).get_added_tokens_decoder()
            special = {token_id for token_id, token in added.items() if token.special}
        return cls(vocab_size, frozenset(special))

    @property
    def ordinary_ids(self) -> list[int]:
        return [i for i in range(self.vocab_size) if i not in self.special_token_ids]


@dataclass(frozen=True)
class PlannedRequest:
    """One request of a run, ready to send."""

    request_id: str  # the workload's id
    tenant: str  # workload tenant name (one API key each)
    tier: str  # the tenant's tier
    send_at_s: float  # seconds after the run's start
    prompt_token_ids: tuple[int, ...]
    num_output_tokens: int  # max_tokens; with ignore_eos exactly this many are generated


def retime(
    workload: Workload,
    rate_rps: float,
    *,
    arrivals: ArrivalProcess = ArrivalProcess.WORKLOAD,
    duration_s: float | None = None,
    num_requests: int | None = None,
    seed: int = 0,
) -> Workload:
    """The workload's first requests offered at `rate_rps` requests/s.

    How many: rate x duration_s when a duration is given, else num_requests, else all; a run
    that needs more requests than the file has goes on with the file again (`cycled`). With
    the file's arrivals, times are scaled so the requests taken arrive at exactly that rate on
    average (the last at count / rate): the file's own rate over a short window is not its
    nominal one. Poisson: new seeded arrivals at the rate, those before duration_s.
    """
    if rate_rps <= 0:
        raise BenchConfigError(f"the request rate must be positive, got {rate_rps}")
    if arrivals is ArrivalProcess.POISSON:
        if duration_s is None:
            times = _poisson_times(num_requests or len(workload.requests), rate_rps, seed)
        else:
            times = _poisson_times_until(duration_s, rate_rps, seed)
        count = len(times)
    else:
        count = len(workload.requests) if duration_s is None else round(rate_rps * duration_s)
    if num_requests is not None:
        count = min(count, num_requests)
    if count == 0:
        raise BenchConfigError("no request of the workload is sent at this rate and duration")
    requests = cycled(workload, count)
    if arrivals is ArrivalProcess.WORKLOAD:
        last_s = max(r.arrival_s for r in requests)
        if last_s <= 0:
            raise BenchConfigError("the workload has no arrival times: use --arrivals poisson")
        time_scale = len(requests) / rate_rps / last_s
        times = [r.arrival_s * time_scale for r in requests]
    retimed = [replace(r, arrival_s=t) for r, t in zip(requests, times, strict=False)]
    return replace(workload, rate_rps=rate_rps, requests=retimed)


def cycled(workload: Workload, count: int) -> list[WorkloadRequest]:
    """The first `count` requests of the file repeated as often as needed: pass k > 0 takes
    request i's tenant, tier and lengths as `<id>~k`, arriving k file-periods later (the
    period is the file's span plus one mean gap). Prompts stay distinct: Workload.prompts draws
    each request id's own tokens."""
    source = workload.requests
    if not source:
        raise BenchConfigError("the workload has no requests")
    period_s = max(r.arrival_s for r in source) * (len(source) + 1) / len(source)
    requests = list(source[:count])
    for i in range(len(source), count):
        repeat, index = divmod(i, len(source))
        request = source[index]
        requests.append(replace(
            request,
            request_id=f"{request.request_id}~{repeat}",
            arrival_s=request.arrival_s + repeat * period_s,
        ))
    return requests


def two_tenant_workload(
    workload: Workload,
    light_rate_rps: float,
    heavy_ratio: float,
    duration_s: float,
    *,
    tier: str = "standard",
    seed: int = 0,
) -> Workload:
    """Tenants LIGHT_TENANT and HEAVY_TENANT of one tier, Poisson arrivals at light_rate_rps
    and heavy_ratio times that, over duration_s; lengths are the workload's requests in
    order."""
    rng = random.Random(seed)
    arrivals: list[tuple[float, str]] = []
    rates = ((LIGHT_TENANT, light_rate_rps), (HEAVY_TENANT, heavy_ratio * light_rate_rps))
    for tenant, rate in rates:
        now = rng.expovariate(rate)
        while now < duration_s:
            arrivals.append((now, tenant))
            now += rng.expovariate(rate)
    arrivals.sort()
    if all(tenant != LIGHT_TENANT for _, tenant in arrivals):
        raise BenchConfigError("the light tenant sends nothing: lengthen the duration")
    requests = [
        replace(source, request_id=f"{tenant}-{index}", arrival_s=arrival_s, tenant=tenant,
                tier=tier)
        for index, (source, (arrival_s, tenant)) in enumerate(
            zip(cycled(workload, len(arrivals)), arrivals, strict=True)
        )
    ]
    return Workload(seed=workload.seed, rate_rps=len(requests) / duration_s, requests=requests)


def plan_requests(workload: Workload, vocabulary: PromptVocabulary) -> list[PlannedRequest]:
    """The workload's requests in arrival order with their prompts."""
    ordinary = vocabulary.ordinary_ids
    # Workload.prompts draws from [FIRST_ORDINARY_TOKEN_ID, n + FIRST_ORDINARY_TOKEN_ID);
    # shifting by that offset indexes the model's ordinary ids one to one, uniformly.
    drawn = workload.prompts(len(ordinary) + FIRST_ORDINARY_TOKEN_ID)
    return [
        PlannedRequest(
            request_id=r.request_id,
            tenant=r.tenant,
            tier=r.tier,
            send_at_s=r.arrival_s,
            prompt_token_ids=tuple(
                ordinary[i - FIRST_ORDINARY_TOKEN_ID] for i in drawn[r.request_id]
            ),
            num_output_tokens=r.output_len,
        )
        for r in sorted(workload.requests, key=_arrival)
    ]


def _arrival(request: WorkloadRequest) -> float:
    return request.arrival_s


def _poisson_times(num_requests: int, rate_rps: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(num_requests):
        now += rng.expovariate(rate_rps)
        times.append(now)
    return times


def _poisson_times_until(duration_s: float, rate_rps: float, seed: int) -> list[float]:
    """The same seeded process as _poisson_times, cut at duration_s."""
    rng = random.Random(seed)
    times, now = [], rng.expovariate(rate_rps)
    while now < duration_s:
        times.append(now)
        now += rng.expovariate(rate_rps)
    return times
