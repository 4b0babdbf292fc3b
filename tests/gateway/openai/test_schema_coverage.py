"""JSON schemas as people send them (a subset of the JSON Schema Test Suite, draft 2020-12,
tests/data/json_schema_suite): every one accepted on the gateway's path, the finished-output
check agreeing with the suite on its instances, and through the engine at temperature 1.0
no output returned as valid that python-jsonschema refuses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from engine import EngineConfig, LLMEngine, RunnerConfig, SamplingParams, SchedulerConfig
from engine.models.config import ModelConfig
from engine.output_spec import StructuredOutput
from engine.structured_output.grammar_compiler import GrammarCompiler
from engine.text.tokenizer import Tokenizer
from engine.worker.model_runner import TorchModelRunner
from gateway.http.errors import BadRequestError
from gateway.openai.schema_check import schema_check
from tests.serve_process import shared_demo_model_dir

SUBSET: list[dict[str, Any]] = json.loads(
    (Path(__file__).parents[2] / "data/json_schema_suite/draft2020-12-subset.json").read_text())
IDS = [f"{case['family']}-{i}" for i, case in enumerate(SUBSET)]


@pytest.fixture(scope="module")
def demo() -> tuple[Path, Tokenizer, ModelConfig]:
    path = shared_demo_model_dir()
    return path, Tokenizer.from_dir(path), ModelConfig.from_file(path)


@pytest.fixture(scope="module")
def compiler(demo: tuple[Path, Tokenizer, ModelConfig]) -> GrammarCompiler:
    _, tokenizer, config = demo
    assert tokenizer.eos_token_id is not None
    return GrammarCompiler(tokenizer, config.vocab_size, [tokenizer.eos_token_id])


def _constraint(case: dict[str, Any]) -> StructuredOutput:
    return StructuredOutput.json_schema(case["schema"], "response_format.json_schema.schema",
                                        lenient=True)


def test_the_subset_covers_every_family_the_suite_has() -> None:
    families = {case["family"] for case in SUBSET}
    assert len(SUBSET) >= 75 and len(families) >= 40
    assert {"oneOf", "not", "if-then-else", "unevaluatedProperties", "uniqueItems",
            "format", "ref", "dependentSchemas", "contains"} <= families


@pytest.mark.parametrize("case", SUBSET, ids=IDS)
def test_every_satisfiable_schema_is_accepted_and_checked_as_the_suite_says(
    compiler: GrammarCompiler, case: dict[str, Any]
) -> None:
    """Accepted: the grammar (lenient) with this tokenizer, and the validator. The check
    agrees with the suite on each instance, but for formats, which this server asserts (the
    suite's draft 2020-12 tests take them as annotations)."""
    constraint = _constraint(case)
    compiler.check(constraint)
    check = schema_check(constraint)
    if case["family"] == "format":
        return
    for test in case["tests"]:
        problem = check.problem(json.dumps(test["data"]))
        assert (problem is None) == test["valid"], (test, problem)


def test_a_remote_ref_is_refused_naming_its_path() -> None:
    schema = {"$defs": {"a": {"items": {"$ref": "http://localhost:1234/draft2020-12/x.json"}}},
              "$ref": "#/$defs/a"}
    with pytest.raises(BadRequestError) as refused:
        schema_check(StructuredOutput.json_schema(schema, "schema", lenient=True))
    assert refused.value.param == "schema.$defs.a.items.$ref"
    assert "remote $ref" in refused.value.message
    custom = {"$schema": "http://localhost:1234/draft2020-12/metaschema-no-validation.json",
              "type": "object"}
    with pytest.raises(BadRequestError) as refused:
        schema_check(StructuredOutput.json_schema(custom, "schema", lenient=True))
    assert refused.value.param == "schema.$schema"


def test_replies_returned_as_valid_are_valid(
    demo: tuple[Path, Tokenizer, ModelConfig], compiler: GrammarCompiler
) -> None:
    """Each schema of the subset as a request at temperature 1.0 on the demo model (random
    weights: whatever the grammar lets through): every reply the check passes is valid under
    python-jsonschema too, and the check refuses what the grammar could not enforce."""
    path, tokenizer, _ = demo
    assert tokenizer.eos_token_id is not None
    config = EngineConfig(
        SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16, max_model_len=200),
        eos_token_id=tokenizer.eos_token_id,
        runner=RunnerConfig(num_kv_blocks=512, sampler_seed=0),
    )
    engine = LLMEngine(config, TorchModelRunner.from_model_dir(path, config),
                       tokenizer=tokenizer, grammars=compiler)
    prompt = tokenizer.encode("Write JSON.")
    for index, case in enumerate(SUBSET):
        engine.add_request(str(index), prompt, SamplingParams(
            temperature=1.0, seed=index, max_tokens=160, structured=_constraint(case)))
    texts: dict[str, str] = {}
    outcomes = {"valid": 0, "refused": 0, "length": 0}
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id] = texts.get(out.request_id, "") + out.new_text
            if not out.finished:
                continue
            if out.finish_reason == "length":
                outcomes["length"] += 1
                continue
            assert out.finish_reason == "stop", (out.finish_reason, out.error)
            case = SUBSET[int(out.request_id)]
            text = texts[out.request_id]
            if schema_check(_constraint(case)).problem(text) is not None:
                outcomes["refused"] += 1
                continue
            outcomes["valid"] += 1
            cls = jsonschema.validators.validator_for(case["schema"])
            error = next(iter(cls(case["schema"], format_checker=cls.FORMAT_CHECKER)
                              .iter_errors(json.loads(text))), None)
            assert error is None, (case["family"], text, error)
    assert sum(outcomes.values()) == len(SUBSET)
    assert outcomes["valid"] >= len(SUBSET) // 3, outcomes
