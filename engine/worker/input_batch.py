"""InputBatch: what the runner keeps of the requests it runs, and the step inputs built from it.

Each request the scheduler sends (`NewRequestData`) takes a row of fixed-width arrays: its
tokens (prompt, outputs, then the tokens the runner samples for it) and its block table. A
step then names only the rows' chunks and the changed table entries, and the inputs of the
forward (token ids, positions, KV slots, block tables, query starts, context lengths, rows to
sample) are gathered from the rows with vectorized numpy, never a Python loop over tokens.
They reach the device in one host-to-device copy (`StepInputs.to_device`).

A token the runner sampled is on the device before it is on the host. Under async scheduling
the next step is built before the ids come back (`mark_sampled` notes them, `append_sampled`
brings them): a chunk may compute a row's newest token while it is still pending, and its
input id is then taken from the previous step's sampled tensor, on the device.

Rows are reused as requests leave; the arrays grow when more requests or longer ones come
than the capacity given (a runner that knows its limits sizes them once).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from engine.models.batch import ForwardBatch
from engine.sample.penalties import PenaltyCounts
from engine.sample.sampling_table import SamplingColumns, SamplingTable
from engine.sampling_params import SamplingParams
from engine.scheduler_output import NewRequestData, ScheduledChunk, SchedulerOutput
from engine.types import LoraRequest

__all__ = ["InputBatch", "PendingTokens", "RequestState", "StepInputs"]


class RequestState:
    """One request as the runner keeps it; the sampler reads its parameters and tokens. Its
    tokens are its row of the batch (read on demand, never kept twice)."""

    __slots__ = (
        "_batch",
        "eos_token_id",
        "json_closers",
        "lora",
        "matcher",
        "penalty_counts",
        "request_id",
        "row",
        "sample_index",
        "sampling_params",
    )

    def __init__(self, batch: InputBatch, data: NewRequestData, row: int) -> None:
        self._batch = batch
        self.request_id = data.request_id
        self.row = row
        self.sampling_params: SamplingParams = data.sampling_params
        self.eos_token_id = data.eos_token_id
        self.sample_index = data.sample_index
        self.lora = data.lora  # the adapter it runs with; None: the base model
        self.penalty_counts: PenaltyCounts | None = None  # the sampler's (engine.penalties)
        # Structured output: the grammar's state after the request's outputs so far (a
        # resumed request's are fed again; the sampler advances it with each new token).
        self.matcher: llguidance.LLMatcher | None = None
        # A JSON constraint's closing tokens (engine.sample.closing_nudge), else None.
        self.json_closers: np.ndarray | None = None
        if data.grammar is not None:
            self.json_closers = data.grammar.closing_ids
            self.matcher = data.grammar.matcher()
            outputs = data.token_ids[data.num_prompt_tokens:]
            if outputs:
                self.matcher.consume_tokens(outputs)

    @property
    def num_prompt_tokens(self) -> int:
        return int(self._batch._num_prompt[self.row])

    @property
    def num_output_tokens(self) -> int:
        """Its outputs, the ones still on the device included."""
        return int(self._batch._num_outputs(self.row))

    @property
    def prompt_token_ids(self) -> list[int]:
        tokens: list[int] = self._batch._token_ids[self.row, : self.num_prompt_tokens].tolist()
        return tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.output_tokens_since(0)

    def output_tokens_since(self, start: int) -> list[int]:
        """Output tokens start.. on the host (0: the first output)."""
        first = self.num_prompt_tokens + start
        end = int(self._batch._num_tokens[self.row])
        tokens: list[int] = self._batch._token_ids[self.row, first:end].tolist()
        return tokens


@dataclass
class StepInputs:
    """The flat inputs of one step as host arrays (ForwardBatch's fields, same meaning)."""

    input_ids: np.ndarray  # int64[T]
    positions: np.ndarray  # int64[T]
    slot_mapping: np.ndarray  # int64[T]
    block_tables: np.ndarray  # int32[B, W]; zero past each sequence's blocks
    query_start_loc: np.ndarray  # int32[B + 1]
    context_lens: np.ndarray  # int32[B]
    logits_indices: np.ndarray  # int64[S]
    # Tokens whose ids are still on the device: their indices in input_ids, and where each is
    # in the previous step's sampled tensor (InputBatch.sampled_on_device).
    pending_tokens: np.ndarray  # int64[P]
    pending_sources: np.ndarray  # int64[P]
    sample_rows: np.ndarray  # int64[S]: the batch rows of the chunks that sample (host only)

    def to_device(
        self,
        device: torch.device,
        sampled_on_device: torch.Tensor | None = None,
        packed: bool | None = None,
    ) -> ForwardBatch:
        """The ForwardBatch on device, the pending input ids filled from sampled_on_device
        (there already). On the CPU the tensors share the arrays' memory; on an accelerator
        (or packed=True) every array goes in one buffer and one copy, and the fields are views
        of it."""
        if packed is None:
            packed = device.type != "cpu"
        parts = [self.input_ids, self.positions, self.slot_mapping, self.logits_indices,
                 self.block_tables.reshape(-1), self.query_start_loc, self.context_lens,
                 self.pending_tokens, self.pending_sources]
        if packed:
            host = torch.from_numpy(np.concatenate(parts, dtype=np.int64))
            if device.type == "cuda":
                host = host.pin_memory()
            flat = host.to(device, non_blocking=True)
            views = list(torch.split(flat, [p.size for p in parts]))
            views[4] = views[4].view(self.block_tables.shape)
            views[5:7] = [v.to(torch.int32) for v in views[5:7]]
        else:
            views = [torch.from_numpy(p) for p in parts]
            views[4] = torch.from_numpy(self.block_tables)
        batch = ForwardBatch(
            input_ids=views[0],
            positions=views[1],
            slot_mapping=views[2],
            logits_indices=views[3],
            block_tables=views[4].to(torch.int32),
            query_start_loc=views[5],
            context_lens=views[6],
        )
        if self.pending_tokens.size:
            assert sampled_on_device is not None, "pending tokens need the sampled tensor"
            batch.input_ids[views[7]] = sampled_on_device[views[8]]
        return batch


@dataclass(frozen=True)
class PendingTokens:
    """Tokens one step sampled, noted by `InputBatch.mark_sampled` until their ids come."""

    states: list[RequestState]
    rows: np.ndarray  # int64[len(states)]: their rows when the step sampled
    num_removals: int  # the batch's count of freed rows then


class InputBatch:
    """Rows of the requests a runner holds, kept in step with the scheduler's outputs."""

    def __init__(self, block_size: int, num_rows: int = 8, max_tokens: int = 256) -> None:
        self.block_size = block_size
        num_rows = max(num_rows, 1)
        self._token_ids = np.zeros((num_rows, max(max_tokens, 1)), dtype=np.int64)
        self._num_tokens = np.zeros(num_rows, dtype=np.int64)  # on the host
        self._num_prompt = np.zeros(num_rows, dtype=np.int64)
        # Sampled for the row, ids not on the host yet; the newest one's index in
        # sampled_on_device.
        self._num_pending = np.zeros(num_rows, dtype=np.int64)
        self._pending_source = np.zeros(num_rows, dtype=np.int64)
        self._pending_mark = np.zeros(num_rows, dtype=np.int64)  # the mark that set the source
        self._num_marks = 0  # calls of mark_sampled that noted tokens
        self._num_removals = 0  # rows freed so far
        self._tables = np.zeros((num_rows, -(-max(max_tokens, 1) // block_size)), dtype=np.int32)
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self.sampling = SamplingTable(num_rows)  # each row's sampling parameters
        self.requests: dict[str, RequestState] = {}
        self.num_lora_requests = 0  # held requests that run with an adapter
        # The latest step's sampled ids (int64[S]) where they were sampled (`mark_sampled`).
        self.sampled_on_device: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.requests)

    # -- keeping in step -------------------------------------------------------------------

    def update(self, scheduler_output: SchedulerOutput) -> None:
        """Drop the removed requests, take the new ones, apply the changed table entries."""
        for request_id in scheduler_output.removed_request_ids:
            state = self.requests.pop(request_id, None)
            if state is not None:
                self._free_rows.append(state.row)
                self._num_removals += 1
                self.num_lora_requests -= state.lora is not None
        for data in scheduler_output.new_requests:
            self._add(data)
        tables = self._tables
        for request_id, (first, block_ids) in scheduler_output.block_updates.items():
            row = self.requests[request_id].row
            end = first + len(block_ids)
            if end > tables.shape[1]:
                tables = self._grow_tables(end)
            tables[row, first:end] = block_ids
            tables[row, end:] = 0

    def _add(self, data: NewRequestData) -> None:
        assert data.request_id not in self.requests, f"{data.request_id} is held already"
        if not self._free_rows:
            self._grow_rows()
        row = self._free_rows.pop()
        self.requests[data.request_id] = RequestState(self, data, row)
        self.num_lora_requests += data.lora is not None
        num_tokens = len(data.token_ids)
        if num_tokens > self._token_ids.shape[1]:
            self._grow_tokens(num_tokens)
        self._token_ids[row, :num_tokens] = data.token_ids
        self._num_tokens[row] = num_tokens
        self._num_prompt[row] = data.num_prompt_tokens
        self._num_pending[row] = 0
        self.sampling.set(row, data.sampling_params, data.sample_index, data.grammar is not None)
        if len(data.block_ids) > self._tables.shape[1]:
            self._grow_tables(len(data.block_ids))
        self._tables[row] = 0
        self._tables[row, : len(data.block_ids)] = data.block_ids

    def mark_sampled(self, states: list[RequestState], sampled: torch.Tensor,
                     rows: np.ndarray) -> PendingTokens:
        """This step sampled the states' next tokens (sampled: int64[len(states)], where it
        was sampled; rows: theirs, StepInputs.sample_rows); their ids come with
        `append_sampled`, and a step built before then takes them from the tensor."""
        pending = PendingTokens(states, rows, self._num_removals)
        if not states:
            return pending
        self._num_marks += 1
        self._num_pending[rows] += 1
        self._pending_source[rows] = np.arange(len(states))
        self._pending_mark[rows] = self._num_marks
        self.sampled_on_device = sampled
        return pending

    def append_sampled(self, pending: PendingTokens, token_ids: Sequence[int]) -> None:
        """The ids of the tokens `mark_sampled` noted (one per state, in order), on the host
        at last. A state dropped since (its request ended or was preempted) is skipped: its
        row may hold another request now."""
        states, rows = pending.states, pending.rows
        if not states:
            return
        if pending.num_removals != self._num_removals:  # some rows may have changed hands
            requests = self.requests
            held = [i for i, s in enumerate(states) if requests.get(s.request_id) is s]
            rows = rows[held]
            token_ids = [token_ids[i] for i in held]
            if not held:
                return
        positions = self._num_tokens[rows]
        if int(positions.max()) >= self._token_ids.shape[1]:
            self._grow_tokens(int(positions.max()) + 1)
        self._token_ids[rows, positions] = token_ids
        self._num_tokens[rows] = positions + 1
        self._num_pending[rows] -= 1

    # -- reading -----------------------------------------------------------------------------

    def token_ids(self, request_id: str) -> np.ndarray:
        """The tokens the runner holds of a request (a view)."""
        row = self.requests[request_id].row
        return self._token_ids[row, : self._num_tokens[row]]

    def block_table(self, request_id: str) -> np.ndarray:
        """A request's block table row (a view; zero past its blocks)."""
        return self._tables[self.requests[request_id].row]

    def sample_states(self, chunks: list[ScheduledChunk]) -> list[RequestState]:
        """The states of the chunks that sample, in chunk order."""
        requests = self.requests
        return [requests[c.request_id] for c in chunks if c.needs_sample]

    def chunk_loras(self, chunks: list[ScheduledChunk]) -> list[LoraRequest | None]:
        """The adapter of each chunk's request (None: the base model), chunk order."""
        requests = self.requests
        return [requests[c.request_id].lora for c in chunks]

    def sampling_columns(self, rows: np.ndarray) -> SamplingColumns:
        """The sampling parameters of rows (int64[S], StepInputs.sample_rows), with their
        outputs so far, those still on the device included."""
        return self.sampling.gather(rows, self._num_outputs)

    def _num_outputs(self, rows: np.ndarray | int) -> np.ndarray:
        """Outputs of rows so far, those still on the device included."""
        return self._num_tokens[rows] + self._num_pending[rows] - self._num_prompt[rows]

    def prepare(self, chunks: list[ScheduledChunk]) -> StepInputs:
        """The step's inputs: every chunk's tokens in one flat batch, chunk order."""
        requests = self.requests
        count = len(chunks)
        rows = np.fromiter((requests[c.request_id].row for c in chunks), np.int64, count)
        starts = np.fromiter((c.start_pos for c in chunks), np.int64, count)
        lengths = np.fromiter((c.num_tokens for c in chunks), np.int64, count)
        ends = starts + lengths
        query_start_loc = np.zeros(count + 1, dtype=np.int32)
        np.cumsum(lengths, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        if num_tokens == count:  # decode-only: one token per sequence
            token_rows, positions = rows, starts
        else:
            seq_of_token = np.repeat(np.arange(count), lengths)
            offsets = np.arange(num_tokens) - query_start_loc[:-1].astype(np.int64)[seq_of_token]
            token_rows = rows[seq_of_token]
            positions = starts[seq_of_token] + offsets
        on_host = self._num_tokens[rows]
        # A chunk may end with the row's pending token, never past it.
        assert bool((ends <= on_host + np.minimum(self._num_pending[rows], 1)).all()), (
            "a chunk reaches past its tokens"
        )
        bs = self.block_size
        num_blocks = -(-ends // bs)
        width = int(num_blocks.max())
        tables = self._tables[rows, :width]
        tables = np.where(np.arange(width)[None, :] < num_blocks[:, None], tables, 0)
        block_of_token = self._tables[token_rows, positions // bs].astype(np.int64)
        sampled = np.fromiter((c.needs_sample for c in chunks), np.bool_, count)
        if bool((ends > on_host).any()):
            if int(ends.max()) > self._token_ids.shape[1]:
                self._grow_tokens(int(ends.max()))
            pending_tokens = np.flatnonzero(positions >= self._num_tokens[token_rows])
            pending_rows = token_rows[pending_tokens]
            # Only the latest step's tokens can still be pending when the next is built.
            assert bool((self._pending_mark[pending_rows] == self._num_marks).all()), (
                "a pending token of an earlier step"
            )
            pending_sources = self._pending_source[pending_rows]
        else:
            pending_tokens = pending_sources = np.zeros(0, dtype=np.int64)
        return StepInputs(
            input_ids=self._token_ids[token_rows, positions],
            positions=positions,
            slot_mapping=block_of_token * bs + positions % bs,
            block_tables=tables.astype(np.int32, copy=False),
            query_start_loc=query_start_loc,
            context_lens=ends.astype(np.int32),
            logits_indices=query_start_loc[1:][sampled].astype(np.int64) - 1,
            pending_tokens=pending_tokens,
            pending_sources=pending_sources,
            sample_rows=rows[sampled],
        )

    # -- capacity ------------------------------------------------------------------------------

    def _grow_rows(self) -> None:
        old = self._token_ids.shape[0]
        self._token_ids = _grown(self._token_ids, 2 * old, self._token_ids.shape[1])
        self._tables = _grown(self._tables, 2 * old, self._tables.shape[1])
        zeros = np.zeros(old, dtype=np.int64)
        self._num_tokens = np.concatenate([self._num_tokens, zeros])
        self._num_prompt = np.concatenate([self._num_prompt, zeros])
        self._num_pending = np.concatenate([self._num_pending, zeros])
        self._pending_source = np.concatenate([self._pending_source, zeros])
        self._pending_mark = np.concatenate([self._pending_mark, zeros])
        self._free_rows = list(range(2 * old - 1, old - 1, -1))

    def _grow_tokens(self, num_tokens: int) -> None:
        width = max(num_tokens, 2 * self._token_ids.shape[1])
        self._token_ids = _grown(self._token_ids, self._token_ids.shape[0], width)

    def _grow_tables(self, num_blocks: int) -> np.ndarray:
        width = max(num_blocks, 2 * self._tables.shape[1])
        self._tables = _grown(self._tables, self._tables.shape[0], width)
        return self._tables


def _grown(array: np.ndarray, num_rows: int, num_cols: int) -> np.ndarray:
    out = np.zeros((num_rows, num_cols), dtype=array.dtype)
    out[: array.shape[0], : array.shape[1]] = array
    return out
