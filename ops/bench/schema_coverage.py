"""Structured outputs for the schemas people send: the JSON Schema Test Suite's draft 2020-12
schemas, accepted and answered by the default model.

    python -m ops.bench.schema_coverage --suite PATH/tests/draft2020-12 [--seed 0]
        [--max-tokens 160] [--limit N]

PATH is a checkout of json-schema-org/JSON-Schema-Test-Suite (not part of this repository;
tests/data/json_schema_suite holds a subset for the CI test). Every schema group of the
suite's files (optional/ left out) with at least one valid test instance is satisfiable by
that proof and counts. For each, in one process on the CPU:

- accepted: what the gateway does with a `response_format` schema: StructuredOutput
  (lenient), GrammarCompiler.check with the default model's tokenizer, and the finished
  output's check (gateway.openai.schema_check) built; a schema that needs a remote `$ref` is
  counted apart (refused by design, with a 400 naming it);
- answered: every accepted schema as one request at temperature 1.0 (seeded), the schema in
  the prompt, at most --max-tokens tokens, 32 at a time in one LLMEngine (SmolLM2-135M-Instruct,
  float32), and its outcome: `valid` (stopped, and the check passes: what the client gets),
  `refused` (stopped, and the check fails: structured_output_invalid), `length` (cut by
  max_tokens); every `valid` reply is checked again with python-jsonschema (format checker on),
  and any it refuses (or cannot check) is printed.

Printed: a table per file (keyword family): satisfiable, remote, accepted, valid, refused,
length, the compile time p50 / p99 (the engine's, charged to the request), and the check's
cost per reply (median / max); then the totals.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import torch

from engine import EngineConfig, LLMEngine, RunnerConfig, SamplingParams, SchedulerConfig
from engine.errors import InvalidRequestError
from engine.models.config import ModelConfig
from engine.output_spec import StructuredOutput
from engine.sample import closing_nudge
from engine.structured_output.grammar_compiler import GrammarCompiler
from engine.worker.model_runner import TorchModelRunner
from gateway.http.errors import BadRequestError
from gateway.openai.chat_template import ChatTokenizer
from gateway.openai.schema_check import SchemaCheck, schema_check
from gateway.server.model_source import default_model_file, gguf_model_dir
from gateway.server.settings import GatewaySettings

BATCH = 32
PROMPT_SCHEMA_CHARS = 1500  # of a schema quoted in the prompt


@dataclass
class Family:
    """One file's schemas and what became of them."""

    satisfiable: int = 0
    remote: int = 0
    accepted: int = 0
    valid: int = 0
    refused: int = 0
    length: int = 0
    errors: int = 0  # ended by the engine (a grammar past its time budget, say)
    compile_ms: list[float] = field(default_factory=list)
    check_us: list[float] = field(default_factory=list)


@dataclass
class Case:
    family: str
    schema: object
    constraint: StructuredOutput
    check: SchemaCheck


def load_cases(suite: Path, limit: int | None) -> tuple[dict[str, Family], list[Case]]:
    """Every satisfiable schema of the suite's files, and those the gateway accepts."""
    families: dict[str, Family] = {}
    cases: list[Case] = []
    for path in sorted(suite.glob("*.json")):
        family = families.setdefault(path.stem, Family())
        for group in json.loads(path.read_text()):
            if not any(test["valid"] for test in group["tests"]):
                continue
            family.satisfiable += 1
            schema = group["schema"]
            try:
                constraint = StructuredOutput.json_schema(schema, "schema", lenient=True)
                check = schema_check(constraint)
            except BadRequestError as exc:
                if "remote $ref" in exc.message:
                    family.remote += 1
                continue
            except InvalidRequestError:
                continue
            cases.append(Case(path.stem, schema, constraint, check))
    return families, cases[:limit] if limit else cases


def second_opinion(schema: object, instance: object) -> str | None:
    """python-jsonschema's view of an instance the check passed: None when it agrees, else
    why not (it refuses it, or cannot check it: a pattern Python's `re` cannot compile, such
    as ECMA-262's \\p{Letter})."""
    cls = jsonschema.validators.validator_for(schema)
    validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
    try:
        error = next(iter(validator.iter_errors(instance)), None)
    except Exception as exc:  # its regular expressions, formats, references
        return f"cannot check: {type(exc).__name__}: {exc}"
    return None if error is None else f"refuses: {error.message}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", type=Path, required=True,
                        help="the suite's tests/draft2020-12 directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--limit", type=int, default=None, help="the first N schemas only")
    parser.add_argument("--show-cut", action="store_true",
                        help="print the end of each reply cut by max_tokens")
    parser.add_argument("--no-nudge", action="store_true",
                        help="without the closing nudge near max_tokens (engine.sample."
                             "closing_nudge), for a before/after")
    args = parser.parse_args()
    if args.no_nudge:
        closing_nudge.CLOSE_WINDOW = 0
    torch.manual_seed(args.seed)
    cache_dir = Path(GatewaySettings().model_cache_dir)
    model_dir = gguf_model_dir(default_model_file(cache_dir), cache_dir, torch.float32)
    tokenizer = ChatTokenizer.from_dir(model_dir)
    config = ModelConfig.from_file(model_dir)
    assert tokenizer.eos_token_id is not None
    grammars = GrammarCompiler(tokenizer, config.vocab_size, [tokenizer.eos_token_id])
    families, cases = load_cases(args.suite, args.limit)
    accepted: list[Case] = []
    for case in cases:
        try:
            grammars.check(case.constraint)
        except InvalidRequestError as exc:
            print(f"refused: {case.family}: {exc}")
            continue
        families[case.family].accepted += 1
        accepted.append(case)
    engine_config = EngineConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=BATCH,
                                  max_model_len=2048),
        eos_token_id=tokenizer.eos_token_id,
        runner=RunnerConfig(kv_cache_bytes=512 << 20, sampler_seed=args.seed),
    )
    engine = LLMEngine(engine_config, TorchModelRunner.from_model_dir(model_dir, engine_config),
                       tokenizer=tokenizer, grammars=grammars)
    texts: dict[str, str] = defaultdict(str)
    disagreements: list[str] = []
    started = time.perf_counter()
    for first in range(0, len(accepted), BATCH):
        for index in range(first, min(first + BATCH, len(accepted))):
            case = accepted[index]
            quoted = json.dumps(case.schema)[:PROMPT_SCHEMA_CHARS]
            text = tokenizer.apply_chat_template([
                {"role": "system", "content": "You answer with JSON only."},
                {"role": "user", "content": f"Write a JSON value valid under this JSON "
                                            f"schema: {quoted}"},
            ])
            engine.add_request(str(index), tokenizer.encode(text, add_special_tokens=False),
                               SamplingParams(temperature=1.0, seed=args.seed + index,
                                              max_tokens=args.max_tokens,
                                              structured=case.constraint))
        while engine.has_unfinished_requests():
            for out in engine.step():
                texts[out.request_id] += out.new_text
                if not out.finished:
                    continue
                case = accepted[int(out.request_id)]
                family = families[case.family]
                if out.metrics is not None and out.metrics.grammar_compile_s > 0:
                    family.compile_ms.append(out.metrics.grammar_compile_s * 1e3)
                if out.finish_reason == "length":
                    family.length += 1
                    if args.show_cut:
                        print(f"cut: {case.family}: ...{texts[out.request_id][-70:]!r}")
                    continue
                if out.finish_reason != "stop":
                    family.errors += 1
                    print(f"error: {case.family}: {out.error_code}: {out.error}")
                    continue
                output = texts[out.request_id]
                began = time.perf_counter()
                problem = case.check.problem(output)
                family.check_us.append((time.perf_counter() - began) * 1e6)
                if problem is not None:
                    family.refused += 1
                    continue
                family.valid += 1
                opinion = second_opinion(case.schema, json.loads(output))
                if opinion is not None:
                    disagreements.append(f"{case.family}: {output!r}: {opinion}")
    elapsed = time.perf_counter() - started
    print(f"JSON Schema Test Suite draft 2020-12 ({args.suite}), SmolLM2-135M-Instruct "
          f"float32 on the CPU ({torch.get_num_threads()} threads), temperature 1.0, seed "
          f"{args.seed}, max_tokens {args.max_tokens}; {len(accepted)} requests in "
          f"{elapsed:.0f} s")
    print("| family | satisfiable | remote $ref | accepted | valid | refused | length "
          "| compile ms p50 / p99 | check us median / max |")
    print("|---|---|---|---|---|---|---|---|---|")
    total = Family()
    for name, family in families.items():
        if not family.satisfiable:
            continue
        print(f"| {name} | {family.satisfiable} | {family.remote} | {family.accepted} | "
              f"{family.valid} | {family.refused} | {family.length} | "
              f"{_pair(family.compile_ms)} | {_pair(family.check_us, median=True)} |")
        for attr in ("satisfiable", "remote", "accepted", "valid", "refused", "length",
                     "errors"):
            setattr(total, attr, getattr(total, attr) + getattr(family, attr))
        total.compile_ms += family.compile_ms
        total.check_us += family.check_us
    print(f"| all | {total.satisfiable} | {total.remote} | {total.accepted} | {total.valid} | "
          f"{total.refused} | {total.length} | {_pair(total.compile_ms)} | "
          f"{_pair(total.check_us, median=True)} |")
    local = total.satisfiable - total.remote
    print(f"accepted: {total.accepted} of {total.satisfiable} satisfiable "
          f"({100 * total.accepted / total.satisfiable:.1f} %), {total.accepted} of {local} "
          f"without a remote $ref ({100 * total.accepted / local:.1f} %)")
    finished = total.valid + total.refused
    refusals = [line for line in disagreements if ": refuses: " in line]
    print(f"finished: {finished}; returned as valid {total.valid}, of which python-jsonschema "
          f"refuses {len(refusals)} and cannot check {len(disagreements) - len(refusals)}; "
          f"refused by the check (400 structured_output_invalid) {total.refused}; cut by "
          f"max_tokens {total.length}; ended by the engine {total.errors}; closing nudge "
          f"{'off' if args.no_nudge else 'on'}")
    for line in disagreements:
        print(f"python-jsonschema: {line}")


def _pair(values: list[float], median: bool = False) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    middle = statistics.median(ordered)
    top = ordered[-1] if median else ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return f"{middle:.1f} / {top:.1f}"


if __name__ == "__main__":
    main()
