"""The nudge towards closing a JSON reply in the last tokens of its budget."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.sample import closing_nudge
from engine.sample.closing_nudge import (
    CLOSE_BIAS,
    CLOSE_WINDOW,
    close_window,
    nudge_towards_closing,
)
from engine.structured_output.closing_tokens import closing_token_ids


def test_closing_tokens_only_close() -> None:
    texts = ['"', "}", " ]", '"}', "}]", '",', "{", "a", "", " ", '"a', "]}\n", "}}"]
    assert closing_token_ids(texts).tolist() == [0, 1, 2, 3, 4, 12]


def test_the_bias_ramps_up_inside_the_window_and_nowhere_else() -> None:
    logits = torch.zeros(5, 6)
    ids, budget = np.array([1, 4]), 1000
    rows = [(0, CLOSE_WINDOW + 1, budget, ids), (1, CLOSE_WINDOW, budget, ids),
            (2, 1, budget, ids), (3, 1, budget, np.zeros(0, dtype=np.int64)),
            (4, 6, 20, ids)]
    nudged = nudge_towards_closing(logits, rows)
    assert torch.count_nonzero(logits) == 0  # a copy: the input is left as it was
    assert torch.count_nonzero(nudged[0]) == 0  # room to finish: untouched
    assert nudged[1, 1].item() == pytest.approx(CLOSE_BIAS / CLOSE_WINDOW)  # the first
    assert nudged[2].tolist() == [0.0, CLOSE_BIAS, 0.0, 0.0, CLOSE_BIAS, 0.0]  # the last
    assert torch.count_nonzero(nudged[3]) == 0  # no closing tokens: a non-JSON constraint
    assert close_window(20) == 5 and torch.count_nonzero(nudged[4]) == 0  # a quarter of 20
    assert nudge_towards_closing(logits, rows[:1]) is logits  # nothing to do: no copy


def test_a_window_of_zero_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.zeros(1, 3)
    monkeypatch.setattr(closing_nudge, "CLOSE_WINDOW", 0)  # the benchmark's --no-nudge
    assert nudge_towards_closing(logits, [(0, 1, 100, np.array([2]))]) is logits
