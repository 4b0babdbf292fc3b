"""The tiny random HF checkpoint of each supported variant, shared by the tests that run it."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import PreTrainedModel

from tests.engine.models.helpers import HF_CONFIGS, make_checkpoint

VARIANTS = sorted(HF_CONFIGS)


@pytest.fixture(scope="module", params=VARIANTS)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
               ) -> tuple[Path, PreTrainedModel]:
    """One variant's checkpoint directory and the HF model it holds (once per test module)."""
    path = tmp_path_factory.mktemp(request.param)
    model = make_checkpoint(path, request.param, seed=VARIANTS.index(request.param))
    return path, model
