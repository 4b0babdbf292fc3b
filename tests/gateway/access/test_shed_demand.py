"""A request shed for overload still counts as its tenant's demand in the engine
(`policies.tenant_demand`): the tiered policy's light-sender rule must see a heavy tenant as
heavy however much of it the gateway sheds.

The replica runs in this process (tests/gateway/app_harness.py) with its engine slowed to
0.2 s a step and every objective scaled to a twentieth, so a burst of long prompts overloads
it: the first is admitted (nothing ahead of it), those arriving within its first step see it
ahead and are shed. Clients use the openai SDK.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from engine.process.async_engine import AsyncLLMEngine
from engine.types import TenantContext
from gateway.server.model_source import DEMO_MODEL_NAME
from policies import TieredPolicy, TierTable
from tests.gateway.app_harness import start_gateway

NUM_BURST = 6
BURST_PROMPT = list(range(100, 200))  # 100 token ids
WARM_UP_PROMPT = [5, 6, 7, 8]


def test_shed_requests_count_as_their_tenants_demand(tmp_path: Path) -> None:
    tiers = TierTable().scaled(0.05)
    gateway = start_gateway(tmp_path, tiers=tiers)
    try:
        tenant_id, key = gateway.create_tenant("bursty", "standard")
        client = gateway.openai_client(key)
        gateway.runner.extra_delay_s = 0.2
        # One request first, so the engine has measured how fast it drains prompts.
        client.completions.create(model=DEMO_MODEL_NAME, prompt=WARM_UP_PROMPT, max_tokens=2)

        engine = gateway.runtime.host().engine
        assert isinstance(engine, AsyncLLMEngine)
        # The refusals the engine's thread has applied (each is submitted before its 429 is
        # sent, and applied between steps).
        applied: list[int] = []
        record_refused = engine.engine.record_refused

        def noted(num_prompt_tokens: int, tenant: TenantContext) -> None:
            record_refused(num_prompt_tokens, tenant)
            applied.append(num_prompt_tokens)

        engine.engine.record_refused = noted  # type: ignore[method-assign]

        def send(_: int) -> bool:
            """True: admitted; False: shed."""
            try:
                client.completions.create(model=DEMO_MODEL_NAME, prompt=BURST_PROMPT, max_tokens=2)
                return True
            except openai.RateLimitError as exc:
                assert "overloaded" in str(exc)
                return False

        with ThreadPoolExecutor(NUM_BURST) as pool:
            admitted = list(pool.map(send, range(NUM_BURST)))
        assert True in admitted and False in admitted, admitted
        deadline_s = time.monotonic() + 10
        while len(applied) < admitted.count(False) and time.monotonic() < deadline_s:
            time.sleep(0.01)
        assert len(applied) == admitted.count(False), (applied, admitted)
        # The admitted requests have finished and the refusals are applied: the engine's
        # thread takes no step and applies no command now, so its demand can be read here.
        policy = engine.engine.scheduler.policy
        assert isinstance(policy, TieredPolicy)
        sent = policy.demand.sent(engine.engine.clock())
        # Every burst request is in the tenant's demand, shed or not (the warm-up too, unless
        # this host took over 5 s since it).
        burst = NUM_BURST * len(BURST_PROMPT)
        tokens = sent[tiers["standard"].priority][str(tenant_id)]
        assert tokens in (burst, burst + len(WARM_UP_PROMPT)), (sent, admitted)
    finally:
        gateway.stop()
