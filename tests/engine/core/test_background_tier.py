"""Background work (the batch tier, `TieredPolicyConfig.background_priority`): while a more
important tier has requests, a background prompt never shares a step with a more important
prompt, takes at most background_prefill_tokens a step, and still gets that share at least
once in background_prefill_every_steps steps; alone, it takes the whole budget. Its tokens
are the ones it would have produced alone."""

from __future__ import annotations

import itertools

import pytest

from engine import LLMEngine, SamplingParams, TenantContext
from policies import TieredFairQueue, TieredPolicyConfig, TierTable
from policies.tiers import DEFAULT_TIERS
from tests.engine.helpers import check_invariants, make_engine, reference_output, run_to_completion

PREMIUM = TenantContext(tenant_id="p", tier="premium", priority=0, cache_salt="p")
BATCH = TenantContext(tenant_id="b", tier="batch", priority=2, cache_salt="b")
BACKGROUND_TOKENS = TieredPolicyConfig().background_prefill_tokens
EVERY_STEPS = TieredPolicyConfig().background_prefill_every_steps

pytestmark = pytest.mark.usefixtures("scheduling_mode")


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def _engine() -> LLMEngine:
    return make_engine(num_blocks=512, block_size=4, max_num_batched_tokens=256, max_num_seqs=16,
                       queue=TieredFairQueue(), background_priority=2)


def _computed(engine: LLMEngine, request_id: str) -> int:
    request = engine.scheduler.requests.get(request_id)
    return 0 if request is None else request.num_computed_tokens


def _step(engine: LLMEngine, outputs: dict[tuple[str, int], list[int]]) -> None:
    for out in engine.step():
        outputs.setdefault((out.request_id, out.sample_index), []).extend(out.new_token_ids)


def _finish(engine: LLMEngine, outputs: dict[tuple[str, int], list[int]]) -> None:
    for key, tokens in run_to_completion(engine).items():
        outputs.setdefault(key, []).extend(tokens)
    check_invariants(engine)


def test_a_batch_prompt_waits_out_premium_prompts_then_takes_a_capped_share() -> None:
    engine = _engine()
    batch_prompt = list(range(1000, 1200))
    engine.add_request("b", batch_prompt, _params(4), BATCH)
    engine.add_request("p", list(range(100, 164)), _params(24), PREMIUM)
    outputs: dict[tuple[str, int], list[int]] = {}
    _step(engine, outputs)
    assert _computed(engine, "p") == 64  # the premium prompt, whole
    assert _computed(engine, "b") == 0  # not beside it
    chunks = []
    while engine.scheduler.requests["p"].is_prefill_done and "p" in engine.scheduler.requests:
        before = _computed(engine, "b")
        _step(engine, outputs)
        chunks.append(_computed(engine, "b") - before)
        if engine.scheduler.requests.get("p") is None or _computed(engine, "b") >= 200:
            break
    # Beside premium's decodes: a capped share every step.
    assert chunks and all(0 < c <= BACKGROUND_TOKENS for c in chunks), chunks
    _finish(engine, outputs)
    assert outputs[("b", 0)][-4:] == reference_output(batch_prompt, 4)


def test_alone_a_batch_prompt_takes_the_whole_budget() -> None:
    engine = _engine()
    engine.add_request("b", list(range(1000, 1200)), _params(4), BATCH)
    engine.step()
    assert _computed(engine, "b") == 200


def test_premium_prompts_in_every_step_leave_the_batch_its_share_once_in_n_steps() -> None:
    engine = _engine()
    engine.add_request("b", list(range(1000, 1400)), _params(4), BATCH)
    num_steps = 4 * EVERY_STEPS
    progress = []
    outputs: dict[tuple[str, int], list[int]] = {}
    for i in range(num_steps):
        engine.add_request(f"p{i}", list(range(2000 + 16 * i, 2016 + 16 * i)), _params(1),
                           PREMIUM)
        before = _computed(engine, "b")
        _step(engine, outputs)
        progress.append(_computed(engine, "b") - before)
    served = [i for i, c in enumerate(progress) if c]
    assert all(c <= BACKGROUND_TOKENS for c in progress), progress
    assert len(served) >= num_steps // EVERY_STEPS - 1, progress
    assert all(b - a <= EVERY_STEPS for a, b in itertools.pairwise(served)), (
        str(progress))
    _finish(engine, outputs)
    assert outputs[("b", 0)][-4:] == reference_output(list(range(1000, 1400)), 4)


def test_the_background_tiers_are_the_least_important_without_an_objective() -> None:
    premium, standard, batch = DEFAULT_TIERS
    assert TierTable().background_priority() == batch.priority
    assert TierTable([premium, standard]).background_priority() is None
    assert TierTable([batch]).background_priority() is None  # nothing more important
    no_objective = standard.__class__(**{**standard.__dict__, "ttft_slo_s": None})
    assert TierTable([premium, no_objective, batch]).background_priority() == 1
    assert TierTable([no_objective, premium.__class__(**{**premium.__dict__, "priority": 3})]
                     ).background_priority() is None
