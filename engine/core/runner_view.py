"""What the runner holds, from the scheduler's side: each request's data goes to it once.

A request joining the batch brings its prompt, sampling parameters and block table; later
steps carry only the block-table entries changed since, and the ids of requests the runner
should drop (ended or preempted). The step's output is assembled here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from engine.core.kv_cache.kv_manager import KVCacheManager
from engine.core.request import Request
from engine.scheduler_output import NewRequestData, ScheduledChunk, SchedulerOutput


class RunnerView:
    def __init__(self, kv: KVCacheManager) -> None:
        self._kv = kv
        self._held: set[str] = set()  # requests the runner holds (it was sent their data)
        self._removed: set[str] = set()  # held requests ended or preempted since the last step

    def leave(self, request_id: str) -> None:
        """The runner drops what it keeps of the request before the next step."""
        if request_id in self._held:
            self._held.remove(request_id)
            self._removed.add(request_id)

    def step_failed(self, output: SchedulerOutput) -> None:
        """A step that raised may not have reached the runner: what it should have dropped
        goes again with the next step (dropping is idempotent)."""
        self._removed |= output.removed_request_ids

    def output(
        self, step_id: int, running: Sequence[Request], num_new_tokens: Mapping[str, int]
    ) -> SchedulerOutput:
        """The step's chunks (num_new_tokens: by request id), decodes first, with what the
        runner does not hold yet."""
        decodes: list[ScheduledChunk] = []
        prefills: list[ScheduledChunk] = []
        new_requests: list[NewRequestData] = []
        held = self._held
        num_batched = 0
        for request in running:
            request_id = request.request_id
            num_new = num_new_tokens.get(request_id)
            if num_new is None:
                continue
            if request_id not in held:
                held.add(request_id)
                new_requests.append(self._new_request_data(request))
            end = request.num_computed_tokens
            needs_sample = request.num_uncomputed_tokens == 0
            if num_new == 1 and request.is_prefill_done:
                decodes.append(ScheduledChunk(request_id, end - 1, 1, needs_sample, False))
            else:
                prefills.append(ScheduledChunk(request_id, end - num_new, num_new, needs_sample,
                                               True))
            if needs_sample:  # its next token is on order until the step's output is back
                request.num_pending_tokens += 1
            num_batched += num_new
        # a joining request's whole table goes with its data
        joined = {r.request_id for r in new_requests}
        block_updates = {
            request_id: (first, self._kv.block_ids(request_id, first))
            for request_id, first in self._kv.take_changed_tables().items()
            if request_id in held and request_id not in joined
        }
        output = SchedulerOutput(
            step_id=step_id,
            chunks=decodes + prefills,
            num_batched_tokens=num_batched,
            new_requests=new_requests,
            block_updates=block_updates,
            blocks_to_copy=self._kv.take_pending_copies(),
        )
        if not output.is_empty:  # an empty step does not reach the runner: they wait for one
            output.removed_request_ids, self._removed = self._removed, set()
        return output

    def _new_request_data(self, request: Request) -> NewRequestData:
        return NewRequestData(
            request_id=request.request_id,
            token_ids=request.all_token_ids,
            num_prompt_tokens=request.num_prompt_tokens,
            block_ids=self._kv.block_ids(request.request_id),
            sampling_params=request.sampling_params,
            eos_token_id=request.eos_token_id,
            sample_index=request.sample_index,
            grammar=request.grammar,
            lora=request.lora,
        )
