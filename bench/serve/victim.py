"""A victim tenant's streamed chat, timed from its client: what an attack on `tiergate serve`
does to another tenant shows as this chat's time to its first token and its largest gap
between two tokens (ops/bench's hostile-tenant scripts)."""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from typing import Any

import httpx

__all__ = ["VictimChat", "victim_chat"]


@dataclass(frozen=True)
class VictimChat:
    """One victim chat as its client saw it."""

    ttft_s: float  # from sending it to its first content chunk
    max_gap_s: float  # the largest gap between two content chunks; NaN: fewer than two


def victim_chat(
    base_url: str, key: str, index: int, *, model: str, max_tokens: int = 8,
    ignore_eos: bool = False, timeout_s: float = 300.0,
) -> VictimChat:
    """One streamed chat "question {index}: hello" of max_tokens, read to its end."""
    body: dict[str, Any] = {
        "model": model, "max_tokens": max_tokens, "stream": True,
        "messages": [{"role": "user", "content": f"question {index}: hello"}],
    }
    if ignore_eos:  # only when asked: otherwise the plain OpenAI chat the scripts sent
        body["ignore_eos"] = True
    times: list[float] = []
    with httpx.Client(base_url=base_url, timeout=timeout_s) as client:
        start = time.perf_counter()
        with client.stream("POST", "/v1/chat/completions", json=body,
                           headers={"authorization": f"Bearer {key}"}) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    times.append(time.perf_counter())
    assert times, "no content chunk"
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    return VictimChat(times[0] - start, max(gaps) if gaps else math.nan)
