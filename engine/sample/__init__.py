"""Picks the next token of every sampled row: the sampler, its per-row parameter tables,
penalties, seeded noise, and the grammar masks applied to the logits.

Imports only the neutral modules.
"""

from engine.sample.penalties import PenaltyCounts
from engine.sample.sampler import SampledTokens, Sampler
from engine.sample.sampling_table import SamplingColumns, SamplingTable

__all__ = [
    "PenaltyCounts",
    "SampledTokens",
    "Sampler",
    "SamplingColumns",
    "SamplingTable",
]
