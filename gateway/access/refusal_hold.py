"""Refusals held before they are answered: a large body refused before it is read (its
tenant's rate limits spent) waits out its retry delay, up to SCREEN_HOLD_MAX_S, so a client
sending such bodies back to back costs the server a refusal a second per connection instead
of hundreds, at no CPU while it waits."""

from __future__ import annotations

import asyncio

from gateway.access.admission import AdmissionRefusal

__all__ = ["MAX_HELD_REFUSALS", "SCREEN_HOLD_MAX_S", "RefusalHold"]

# Longest a refusal is held.
SCREEN_HOLD_MAX_S = 1.0
# Refusals held at once, at most (past it they are answered at once): a client opening
# connection after connection holds a bounded number of them.
MAX_HELD_REFUSALS = 256


class RefusalHold:
    """Holds refusals, MAX_HELD_REFUSALS at most at once (one per replica's routes)."""

    def __init__(self) -> None:
        self._num_held = 0

    async def wait(self, refusal: AdmissionRefusal) -> None:
        """Wait out the refusal's retry delay (SCREEN_HOLD_MAX_S at most) before it is
        answered, unless MAX_HELD_REFUSALS are waiting already."""
        delay_s = min(refusal.retry_after_s or 0.0, SCREEN_HOLD_MAX_S)
        if delay_s <= 0 or self._num_held >= MAX_HELD_REFUSALS:
            return
        self._num_held += 1
        try:
            await asyncio.sleep(delay_s)
        finally:
            self._num_held -= 1
