"""Tiny random HF checkpoints, HF greedy references, and a minimal paged driver for the runner.

The driver stands in for the scheduler: it hands TorchModelRunner SchedulerOutputs built by
hand (decodes first, then prefill chunks under a token budget) over blocks from a shuffled
free list, so block tables are never contiguous.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

from engine.config import CacheConfig, EngineConfig, RunnerConfig, SchedulerConfig
from engine.core.llm_engine import LLMEngine
from engine.sample.sampler import SampledTokens, Sampler
from engine.sample.sampling_table import SamplingColumns
from engine.sampling_params import SamplingParams
from engine.scheduler_output import NewRequestData, ScheduledChunk, SchedulerOutput
from engine.structured_output.grammar_compiler import GrammarCompiler
from engine.text.tokenizer import Tokenizer
from engine.types import LoraRequest, RunnerStep
from engine.worker.input_batch import RequestState
from engine.worker.model_runner import TorchModelRunner

VOCAB = 256
BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0.0)

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "bos_token_id": None,
    "eos_token_id": None,  # HF generate must never stop early
    "pad_token_id": None,
}

# One small config per supported variant.
HF_CONFIGS: dict[str, Any] = {
    "llama": lambda: LlamaConfig(**_COMMON),
    "llama3": lambda: LlamaConfig(
        **_COMMON,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "llama_bias": lambda: LlamaConfig(**_COMMON, attention_bias=True, mlp_bias=True),
    "qwen2": lambda: Qwen2Config(**_COMMON, use_sliding_window=True, sliding_window=12,
                                 max_window_layers=1),
    "qwen3": lambda: Qwen3Config(**_COMMON, head_dim=32, tie_word_embeddings=True),
    "mistral": lambda: MistralConfig(**_COMMON, sliding_window=20),
}


def make_checkpoint(
    path: Path, variant: str, seed: int = 0, max_shard_size: str | None = None
) -> PreTrainedModel:
    """Save a random tiny model (float32) to path; biases and norm weights are randomised too
    so that every parameter matters. Returns the HF model."""
    torch.manual_seed(seed)
    config = HF_CONFIGS[variant]()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
    model.eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return model


@torch.no_grad()
def hf_greedy(model: PreTrainedModel, prompt: list[int], num_tokens: int) -> list[int]:
    """HF transformers greedy continuation of one prompt (no padding), on the model's device."""
    ids = torch.tensor([prompt], device=model.device)
    # Any: mypy reads PreTrainedModel.generate as a Tensor attribute in some import orders.
    generate: Any = model.generate
    out = generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=num_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return list(out[0, len(prompt) :].tolist())


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


class RecordingSampler:
    """The real sampler, keeping every logits row it saw per request (for closeness checks)."""

    def __init__(self, vocab_size: int) -> None:
        self.sampler = Sampler(vocab_size)
        self.logits: dict[str, list[torch.Tensor]] = {}

    def sample(self, logits: torch.Tensor, states: list[RequestState],
               columns: SamplingColumns | None = None) -> SampledTokens:
        for row, state in zip(logits, states, strict=True):
            self.logits.setdefault(state.request_id, []).append(row.clone())
        return self.sampler.sample(logits, states, columns)


def make_runner(
    model_dir: Path,
    num_kv_blocks: int = 128,
    sampler: RecordingSampler | None = None,
    fuse_cpu_ops: bool = True,
    cpu_decode_rows: int | None = None,
) -> TorchModelRunner:
    """cpu_decode_rows: None for the default (0 when the fused ops are off: the torch path)."""
    if cpu_decode_rows is None:
        cpu_decode_rows = RunnerConfig.cpu_decode_rows if fuse_cpu_ops else 0
    config = EngineConfig(
        SchedulerConfig(max_model_len=512),
        CacheConfig(block_size=BLOCK_SIZE),
        runner=RunnerConfig(num_kv_blocks=num_kv_blocks, fuse_cpu_ops=fuse_cpu_ops,
                            cpu_decode_rows=cpu_decode_rows),
    )
    return TorchModelRunner.from_model_dir(model_dir, config, sampler=sampler)


def model_engine(
    model_dir: Path,
    *,
    num_kv_blocks: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    async_scheduling: bool,
    device: str = "cpu",
    tokenizer: Tokenizer | None = None,
    grammars: GrammarCompiler | None = None,
) -> LLMEngine:
    """An LLMEngine over a checkpoint's TorchModelRunner on device: at most 8 sequences a
    step, the sampler's generator seeded, the tokenizer's EOS (if any) ending requests."""
    config = EngineConfig(
        SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=8,
                        max_model_len=max_model_len),
        eos_token_id=tokenizer.eos_token_id if tokenizer is not None else None,
        async_scheduling=async_scheduling,
        runner=RunnerConfig(num_kv_blocks=num_kv_blocks, sampler_seed=0),
    )
    runner = TorchModelRunner.from_model_dir(model_dir, config, device=device)
    return LLMEngine(config, runner, tokenizer=tokenizer, grammars=grammars)


@dataclass
class Sequence:
    """A request as the driver tracks it."""

    request_id: str
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    block_table: list[int] = field(default_factory=list)
    num_pending: int = 0  # sampled by queued steps, ids not back yet
    lora: LoraRequest | None = None  # the adapter it runs with

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        """Its tokens, the pending ones included."""
        return len(self.prompt) + len(self.output) + self.num_pending

    @property
    def is_done(self) -> bool:
        return len(self.output) >= self.max_new_tokens

    @property
    def is_ordered(self) -> bool:
        """Every token it needs is back or on its way."""
        return len(self.output) + self.num_pending >= self.max_new_tokens


class PagedDriver:
    """Schedules sequences onto a runner: decodes first, then prefill chunks under a budget."""

    def __init__(self, runner: TorchModelRunner, seed: int = 0, ahead: bool = False) -> None:
        """ahead: queue each step before taking the previous one's tokens (async scheduling:
        decodes compute tokens whose ids are still with the runner)."""
        self.runner = runner
        self.ahead = ahead
        self.free_blocks = list(range(runner.num_kv_blocks))
        random.Random(seed).shuffle(self.free_blocks)  # block tables are never contiguous
        self.step_id = 0
        # What the runner was sent of each sequence: its block table's length.
        self.sent: dict[str, int] = {}
        self.new_requests: list[NewRequestData] = []
        self.block_updates: dict[str, tuple[int, list[int]]] = {}
        self.removed: set[str] = set()

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow seq's block table to cover num_tokens tokens."""
        bs = self.runner.block_size
        while len(seq.block_table) * bs < num_tokens:
            seq.block_table.append(self.free_blocks.pop())

    def free(self, seq: Sequence) -> None:
        self.free_blocks += seq.block_table
        seq.block_table = []
        if self.sent.pop(seq.request_id, None) is not None:
            self.removed.add(seq.request_id)

    def chunk(self, seq: Sequence, num_tokens: int) -> ScheduledChunk:
        """seq's next num_tokens tokens; what the runner lacks of seq goes with the next step."""
        start = seq.num_computed
        end = start + num_tokens
        self.allocate(seq, end)
        num_sent = self.sent.get(seq.request_id)
        if num_sent is None:
            self.new_requests.append(NewRequestData(
                request_id=seq.request_id,
                token_ids=seq.tokens,
                num_prompt_tokens=len(seq.prompt),
                block_ids=list(seq.block_table),
                sampling_params=GREEDY,
                eos_token_id=None,
                lora=seq.lora,
            ))
        elif num_sent < len(seq.block_table):
            self.block_updates[seq.request_id] = (num_sent, seq.block_table[num_sent:])
        self.sent[seq.request_id] = len(seq.block_table)
        return ScheduledChunk(
            request_id=seq.request_id,
            start_pos=start,
            num_tokens=num_tokens,
            needs_sample=end == seq.num_tokens,
            is_prefill=num_tokens > 1 or not (seq.output or seq.num_pending),
        )

    def step(self, chunks: list[ScheduledChunk], seqs: dict[str, Sequence],
             blocks_to_copy: list[tuple[int, int]] | None = None) -> None:
        """Run one step and take its tokens."""
        self._finish(self._queue(chunks, seqs, blocks_to_copy), chunks, seqs)

    def _queue(self, chunks: list[ScheduledChunk], seqs: dict[str, Sequence],
               blocks_to_copy: list[tuple[int, int]] | None = None) -> RunnerStep:
        step = self.runner.execute(
            SchedulerOutput(
                step_id=self.step_id,
                chunks=chunks,
                num_batched_tokens=sum(c.num_tokens for c in chunks),
                new_requests=self.new_requests,
                block_updates=self.block_updates,
                blocks_to_copy=blocks_to_copy or [],
                removed_request_ids=self.removed,
            )
        )
        self.new_requests, self.block_updates, self.removed = [], {}, set()
        self.step_id += 1
        for c in chunks:
            seqs[c.request_id].num_computed += c.num_tokens
            seqs[c.request_id].num_pending += int(c.needs_sample)
        return step

    def _finish(self, step: RunnerStep, chunks: list[ScheduledChunk],
                seqs: dict[str, Sequence]) -> None:
        output = step.result()
        for request_id, token in output.sampled_token_ids.items():
            seqs[request_id].output.append(token)
            seqs[request_id].num_pending -= 1
        assert set(output.sampled_token_ids) == {c.request_id for c in chunks if c.needs_sample}

    def run(self, seqs: list[Sequence], token_budget: int = 1 << 30, keep_blocks: bool = False,
            ) -> None:
        """Run until every sequence has its tokens; a prefill gets what is left of the budget."""
        by_id = {s.request_id: s for s in seqs}
        in_flight: tuple[RunnerStep, list[ScheduledChunk]] | None = None
        while not all(s.is_done for s in seqs):
            active = [s for s in seqs if not s.is_ordered]
            decodes = [s for s in active
                       if (s.output or s.num_pending) and s.num_computed == s.num_tokens - 1]
            chunks = [self.chunk(s, 1) for s in decodes]
            budget = token_budget - len(chunks)
            for s in active:
                if s in decodes or budget <= 0 or s.num_pending:
                    continue
                num = min(s.num_tokens - s.num_computed, budget)
                chunks.append(self.chunk(s, num))
                budget -= num
            queued = (self._queue(chunks, by_id), chunks) if chunks else None
            if not self.ahead and queued is not None:
                self._finish(*queued, by_id)
                queued = None
            if in_flight is not None:
                self._finish(*in_flight, by_id)
            in_flight = queued
            if not keep_blocks:
                for s in seqs:
                    if s.is_done and s.block_table:
                        self.free(s)
