"""RequestLimits: what a request must fit to ever run, read from the engine's configuration.

A value, so a caller in another thread or process checks requests without the engine: the
gateway validates on its event loop, before submitting, whether the engine runs in a thread
beside it or in a process of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.errors import ContextLengthExceededError, InvalidRequestError
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.types import TenantContext


@dataclass(frozen=True)
class RequestLimits:
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    reserved_blocks: dict[int, int] = field(default_factory=dict)  # by priority

    def validate(
        self, prompt_token_ids: list[int], params: SamplingParams, tenant: TenantContext
    ) -> int:
        """Check the request can ever run; returns the resolved max_tokens."""
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if num_prompt >= self.max_model_len:
            raise ContextLengthExceededError(
                f"the prompt has {num_prompt} tokens; this model's context is "
                f"{self.max_model_len}",
                param="messages",
            )
        bs = self.block_size
        num_reachable = self.num_kv_blocks - sum(
            n for p, n in self.reserved_blocks.items() if p < tenant.priority
        )
        if tenant.kv_cap_blocks is not None:
            num_reachable = min(num_reachable, tenant.kv_cap_blocks)
        # No max_tokens: as many as the context and the KV blocks this tenant can reach allow.
        max_tokens = params.max_tokens or max(
            1, min(self.max_model_len, num_reachable * bs) - num_prompt
        )
        if num_prompt + max_tokens > self.max_model_len:
            raise ContextLengthExceededError(
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) exceeds this "
                f"model's context of {self.max_model_len} tokens",
                param="max_tokens",
            )
        num_blocks_needed = -(-(num_prompt + max_tokens) // bs)
        if num_blocks_needed > num_reachable:
            raise ContextLengthExceededError(
                f"prompt + max_tokens needs {num_blocks_needed * bs} tokens of KV cache; "
                f"this tenant can hold at most {num_reachable * bs}",
                param="max_tokens",
            )
        return max_tokens
