"""GenerationJob: the text it makes from tokens (the engine made none: no stop strings) is
the text the engine's step makes for the same request, choice by choice; and stop strings
still need the engine's text."""

from __future__ import annotations

import asyncio

import pytest

from engine import InvalidRequestError, SamplingParams, TenantContext, Tokenizer
from engine.process.async_engine import AsyncLLMEngine
from gateway.openai.generation import GenerationJob, PreparedPrompt
from tests.engine.helpers import make_engine
from tests.serve_process import shared_demo_model_dir


def _texts(detokenize: bool, tokenizer: Tokenizer, prompts: list[list[int]]) -> list[str]:
    engine = make_engine(num_blocks=256, block_size=4, max_num_seqs=8)
    engine.tokenizer = tokenizer
    client = AsyncLLMEngine(engine)
    params = SamplingParams(n=2, max_tokens=24, ignore_eos=True, detokenize=detokenize,
                            skip_special_tokens=False)
    job = GenerationJob(client, "job", [PreparedPrompt(p, None) for p in prompts], params,
                        TenantContext(), tokenizer)

    async def run() -> list[str]:
        texts = [""] * job.num_choices
        async for choice, output in job.outputs():
            texts[choice] += output.new_text
        return texts

    try:
        return asyncio.run(run())
    finally:
        client.shutdown()


def test_the_job_makes_the_text_the_engine_would() -> None:
    tokenizer = Tokenizer.from_dir(shared_demo_model_dir())
    prompts = [tokenizer.encode("Hello there, how"), tokenizer.encode("naïve café ☃")]
    by_engine = _texts(True, tokenizer, prompts)
    by_job = _texts(False, tokenizer, prompts)
    assert len(by_job) == 4 and all(by_job)
    assert by_job == by_engine


def test_stop_strings_need_the_engines_text() -> None:
    with pytest.raises(InvalidRequestError, match="stop strings need detokenize"):
        SamplingParams(stop=["x"], detokenize=False).validate()
