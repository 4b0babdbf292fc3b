"""The weight format of a served model as one short label: what a usage record and a metric
name it by (`float32`, `bfloat16`, `gguf-q4_1`, `gguf-q4_k+q8_0`, `awq-int4`, `gptq-int4`,
`fp8`).

The label is read off the runner's description of its weights
(`TorchModelRunner.weight_format`: `float32`, or `float32; stored: Q4_1 x120, Q8_0 x1`), so
the two never disagree. Matrices kept as stored name the format, the most common type first
(counted per matrix; a matrix stacked from two types counts for each), the dtype the rest
runs in does not; with none stored, the dtype is the label. Same description, same label.
"""

from __future__ import annotations

import re
from collections import Counter

__all__ = ["MAX_WEIGHT_FORMAT_LABEL_LENGTH", "NO_WEIGHTS_LABEL", "weight_format_label"]

# The longest label: the width of usage_records.weight_format (billing.records).
MAX_WEIGHT_FORMAT_LABEL_LENGTH = 32
# The label of a runner without weights (the test and benchmark runners).
NO_WEIGHTS_LABEL = "none"

_STORED = "; stored: "
_TRUNCATED = "+more"  # ends a label that lost its least common types to the length limit
# Integer families a stored kind names by its prefix (CUDA checkpoints: "awq-int4-g128"),
# and their width when the kind does not say; the label keeps the width, not the group
# size. Any other stored kind (Q4_1, Q8_0, Q4_K) is a GGUF tensor type.
_FAMILY_DEFAULTS = {"awq": "int4", "gptq": "int4"}
_WIDTH = re.compile(r"int\d+")
_FLOAT8 = re.compile(r"^(fp8|float8)")  # "fp8-e4m3", torch's float8_e4m3fn, ...
_UNSAFE = re.compile(r"[^a-z0-9_.]+")


def weight_format_label(description: str) -> str:
    """The label of a runner's weight description, at most MAX_WEIGHT_FORMAT_LABEL_LENGTH
    characters of [a-z0-9_.+-]: the stored types by family (`gguf-q4_1+q8_0`), else the
    dtype (`float32`)."""
    dtype, _, stored = description.partition(_STORED)
    counts = _stored_counts(stored)
    if not counts:
        family, kind = _family(dtype.strip(), is_stored=False)
        return _clip([_part(family, [kind])])
    by_family: dict[str, Counter[str]] = {}
    for (family, kind), count in counts.items():
        by_family.setdefault(family, Counter())[kind] += count
    families = sorted(by_family, key=lambda f: (-sum(by_family[f].values()), f))
    return _clip([_part(family, _most_common_first(by_family[family]))
                  for family in families])


def _stored_counts(stored: str) -> Counter[tuple[str, str]]:
    """(family, kind) -> matrices of `Q4_1 x120, Q4_K+Q6_K x2`."""
    counts: Counter[tuple[str, str]] = Counter()
    for entry in filter(None, (e.strip() for e in stored.split(","))):
        kinds, _, times = entry.rpartition(" x")
        if not kinds or not times.isdigit():
            kinds, times = entry, "1"
        for kind in kinds.split("+"):
            counts[_family(kind.strip(), is_stored=True)] += int(times)
    return counts


def _family(kind: str, *, is_stored: bool) -> tuple[str, str]:
    """(family, kind) of a stored type (is_stored) or of the dtype: ("gguf", "q4_1"),
    ("awq", "int4"), ("fp8", ""), ("", "bfloat16")."""
    lowered = _UNSAFE.sub("_", kind.lower()).strip("_")
    if _FLOAT8.match(lowered):
        return "fp8", ""
    for family, default in _FAMILY_DEFAULTS.items():
        if lowered.startswith(family):
            width = _WIDTH.search(lowered, len(family))
            return family, width.group(0) if width else default
    return ("gguf" if is_stored else ""), lowered


def _most_common_first(counts: Counter[str]) -> list[str]:
    return sorted(counts, key=lambda kind: (-counts[kind], kind))


def _part(family: str, kinds: list[str]) -> str:
    kinds = [kind for kind in kinds if kind]
    if not family:
        return "+".join(kinds) or "unknown"
    return f"{family}-{'+'.join(kinds)}" if kinds else family


def _clip(parts: list[str]) -> str:
    """parts joined by "+"; the least common types dropped (for "+more") when too long."""
    kinds = "+".join(parts).split("+")
    label = "+".join(kinds)
    while len(label) > MAX_WEIGHT_FORMAT_LABEL_LENGTH and len(kinds) > 1:
        kinds.pop()
        label = "+".join(kinds) + _TRUNCATED
    return label[:MAX_WEIGHT_FORMAT_LABEL_LENGTH]
