"""SamplingTable: each row's parameters as the sampler reads them, and its feature flags."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.sample.sampling_table import Feature, SamplingTable
from engine.sample.seeded_noise import request_key
from engine.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("params", "is_constrained", "expected"),
    [
        (SamplingParams(temperature=0.0), False, 0),
        (SamplingParams(), False, Feature.RANDOM),
        (SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.2), False,
         Feature.TOP_K | Feature.TOP_P | Feature.MIN_P),
        (SamplingParams(repetition_penalty=1.1), False, Feature.RANDOM | Feature.PENALISED),
        (SamplingParams(temperature=0.0, frequency_penalty=-1.0), False, Feature.PENALISED),
        (SamplingParams(temperature=0.0, presence_penalty=0.5), False, Feature.PENALISED),
        (SamplingParams(temperature=0.0, seed=0), False, Feature.SEEDED),
        (SamplingParams(temperature=0.0, logprobs=0), False, Feature.LOGPROBS),
        (SamplingParams(temperature=0.0, min_tokens=1), False, Feature.MIN_TOKENS),
        (SamplingParams(temperature=0.0), True, Feature.CONSTRAINED),
    ],
)
def test_flags_name_each_feature_a_row_uses(
    params: SamplingParams, is_constrained: bool, expected: int
) -> None:
    table = SamplingTable(1)
    table.set(0, params, 0, is_constrained)
    columns = table.gather(np.array([0]), np.array([0]).__getitem__)
    assert int(columns.flags[0]) == expected == columns.features


def test_columns_hold_the_parameters_in_the_sampler_s_form() -> None:
    table = SamplingTable(1)  # grows to take row 3
    table.set(0, SamplingParams(temperature=0.5, top_k=7, top_p=0.8, min_p=0.05,
                                repetition_penalty=1.2, frequency_penalty=0.3,
                                presence_penalty=-0.4, logprobs=5, min_tokens=2, seed=-1), 1,
              False)
    table.set(3, SamplingParams(seed=2**64 + 9), 2, False)
    num_outputs = np.array([6, 0, 0, 4])  # by table row
    columns = table.gather(np.array([3, 0]), num_outputs.__getitem__)
    assert columns.filters.dtype == np.float32 and columns.penalties.dtype == np.float32
    assert columns.filters[1].tolist() == pytest.approx([0.5, 7, 0.8, 0.05])
    assert math.isinf(columns.top_k[0])  # top_k 0: off
    assert columns.penalties[1].tolist() == pytest.approx([1.2, 0.3, -0.4])
    assert columns.num_logprobs.tolist() == [-1, 5]
    assert columns.min_tokens.tolist() == [0, 2]
    # the requests' keys, made when they joined: the seed modulo 2**64, and sample_index
    assert columns.seed_key.tolist() == [request_key(9, 2), request_key(2**64 - 1, 1)]
    assert columns.num_output_tokens.tolist() == [4, 6]
    assert columns.rows_with(Feature.PENALISED).tolist() == [1]
    assert columns.rows_with(Feature.SEEDED).tolist() == [0, 1]
