"""Weight matrices in the CPU kernels' panels (cpu_decode.cpp), float32 or quantized as stored.

A matrix W [N, K] (out, in features) in panels is N / 16 panels of 16 outputs each. Float32
panels are [N / 16][K][16]. Quantized panels keep GGUF's blocks of 32 inputs: per panel and
block, a scale per output, a minimum per output below 8 bits (both float16 as GGUF stores
them), and the 32 x 16 quantized values k-major, so the kernel dequantizes 16 outputs of one
input with one vector load, convert and multiply-add (`PanelFormat`); 5- and 6-bit values keep
their low four bits as nibbles and their high bits apart, 16 lanes to a 32-bit word.
`gguf_panels` repacks a GGUF tensor's raw blocks into them without going through float
weights: Q8_0 into 8-bit panels (scale times value), Q4_0, Q4_1, Q5_0 and Q5_1 into 4- and
5-bit panels (scale times value plus minimum), Q4_K and Q5_K into panels that keep, per block,
the super-block's scales and the sub-block's 6-bit factors (their product, which float16 does
not hold exactly, is taken in float32 by the kernel, as gguf dequantizes), Q6_K into 6-bit
panels with the super-block's scale and the two 8-bit factors of the block's halves. The
panels take the bytes of the blocks they come from (Q8_0, Q4_1, Q5_1), 1.07x (Q6_K: the
super-block's scale repeated), 1.09x (Q5_0), 1.11x (Q4_0: a minimum per block added), 1.18x
(Q5_K) and 1.22x (Q4_K).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch
from gguf import GGMLQuantizationType

__all__ = [
    "PANEL",
    "PANEL_TYPES",
    "QBLOCK",
    "PanelFormat",
    "PanelMatrix",
    "float_panels",
    "gguf_panels",
    "interleave_panels",
    "stack_panels",
]

PANEL = 16  # outputs per panel
QBLOCK = 32  # inputs per quantized block


class PanelFormat(IntEnum):  # cpu_decode.cpp's WeightFormat; scales in float16
    F32 = 0
    Q8 = 1  # per block: scale[16], int8 q[32][16]
    Q4 = 2  # per block: scale[16], min[16], uint8 q[16][16] (low nibbles: inputs 0..15 of the
    # block, high nibbles: 16..31)
    Q4_K = 3  # per block: d[16], dmin[16], uint8 sc[16], uint8 m[16], q as Q4;
    # w = (d sc) q - dmin m
    Q5 = 4  # per block: scale[16], min[16], uint32 high[16] (bit l of word i: the fifth bit of
    # input i of lane l, bit 16 + l: of input i + 16), q as Q4
    Q5_K = 5  # per block: d, dmin, sc, m as Q4_K, high as Q5, q as Q4
    Q6_K = 6  # per block: d[16], int8 sc[2][16] (inputs 0..15, 16..31), uint32 high[32]
    # (bits 2 l, 2 l + 1 of word k: bits 4 and 5 of input k of lane l), q as Q4;
    # w = (d sc) (q - 32)


_FLOAT16_MAX = 65504.0
_NIBBLES = QBLOCK // 2 * PANEL  # a block's low four bits of its values
_BLOCK_BYTES = {PanelFormat.Q8: PANEL * 2 + QBLOCK * PANEL,
                PanelFormat.Q4: 2 * PANEL * 2 + _NIBBLES,
                PanelFormat.Q4_K: 2 * PANEL * 2 + 2 * PANEL + _NIBBLES,
                PanelFormat.Q5: 2 * PANEL * 2 + QBLOCK // 2 * 4 + _NIBBLES,
                PanelFormat.Q5_K: 2 * PANEL * 2 + 2 * PANEL + QBLOCK // 2 * 4 + _NIBBLES,
                PanelFormat.Q6_K: PANEL * 2 + 2 * PANEL + QBLOCK * 4 + _NIBBLES}

# GGUF tensor types whose blocks repack into quantized panels, and into which format.
PANEL_TYPES = {
    GGMLQuantizationType.Q8_0: PanelFormat.Q8,
    GGMLQuantizationType.Q4_0: PanelFormat.Q4,
    GGMLQuantizationType.Q4_1: PanelFormat.Q4,
    GGMLQuantizationType.Q4_K: PanelFormat.Q4_K,
    GGMLQuantizationType.Q5_0: PanelFormat.Q5,
    GGMLQuantizationType.Q5_1: PanelFormat.Q5,
    GGMLQuantizationType.Q5_K: PanelFormat.Q5_K,
    GGMLQuantizationType.Q6_K: PanelFormat.Q6_K,
}


@dataclass(frozen=True)
class PanelMatrix:
    """A weight matrix [out_features, in_features] in panels of `format`; data is float32
    [N / 16, K, 16] or uint8 [N / 16, K / 32, block bytes]. A stack of matrices of different
    formats (stack_panels) keeps them as `parts`, rows in order; its own data is the first
    part's and its format the first part's (the kernels read the parts, cpu_decode._Matrix)."""

    data: torch.Tensor
    format: PanelFormat
    out_features: int
    in_features: int
    origin: str = "float32"  # what the values came from: float32, or the GGUF type(s)
    parts: tuple[PanelMatrix, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(part.data.nbytes for part in self.parts) if self.parts else self.data.nbytes


def float_panels(weight: torch.Tensor) -> PanelMatrix:
    """A float32 weight [N, K] in float32 panels (N % 16 == 0)."""
    num_out, num_in = weight.shape
    data = weight.detach().to(torch.float32).reshape(num_out // PANEL, PANEL, num_in)
    return PanelMatrix(data.transpose(1, 2).contiguous(), PanelFormat.F32, num_out, num_in)


def gguf_panels(raw: np.ndarray, tensor_type: GGMLQuantizationType, num_out: int,
                num_in: int) -> PanelMatrix:
    """A GGUF tensor's raw blocks (uint8 [num_out, bytes per row], its rows in the order the
    model wants them) in quantized panels: tensor_type in PANEL_TYPES, num_out % 16 == 0."""
    if tensor_type not in PANEL_TYPES:
        raise ValueError(f"no quantized panels for {tensor_type.name}")
    if num_out % PANEL or num_in % QBLOCK:
        raise ValueError(f"a [{num_out}, {num_in}] matrix does not cut into panels and blocks")
    rows = np.ascontiguousarray(raw, dtype=np.uint8).reshape(num_out, -1)
    fmt, fields, values = _DECODERS[tensor_type](rows, num_in // QBLOCK)
    panels, blocks = num_out // PANEL, num_in // QBLOCK

    def by_panel(per_row: np.ndarray) -> np.ndarray:  # [N, KB, ...] -> [N/16, KB, ...* 16]
        moved = per_row.reshape(panels, PANEL, blocks, *per_row.shape[2:])
        return np.ascontiguousarray(np.moveaxis(moved, 1, -1)).view(np.uint8).reshape(
            panels, blocks, -1)

    if fmt is PanelFormat.Q8:
        parts = [by_panel(values.astype(np.int8))]
    else:
        low = (values & 15).astype(np.uint8)
        nibbles = low[..., :QBLOCK // 2] | (low[..., QBLOCK // 2:] << 4)
        parts = [by_panel(nibbles)]
        if fmt is not PanelFormat.Q4 and fmt is not PanelFormat.Q4_K:
            parts.insert(0, _high_words(values, fmt, panels, blocks))
    data = np.concatenate([*(by_panel(field) for field in fields), *parts], axis=2)
    assert data.shape[2] == _BLOCK_BYTES[fmt]
    return PanelMatrix(torch.from_numpy(data), fmt, num_out, num_in, tensor_type.name)


def _high_words(values: np.ndarray, fmt: PanelFormat, panels: int, blocks: int) -> np.ndarray:
    """The values' bits above the nibble, [N, KB, 32] -> uint8 [N / 16, KB, words * 4]: per
    word, 16 lanes of one bit (Q5, Q5_K: inputs i and i + 16 in word i) or two (Q6_K: input k
    in word k)."""
    high = (values.astype(np.uint32) >> 4).reshape(panels, PANEL, blocks, QBLOCK)
    high = np.moveaxis(high, 1, -1)  # [P, KB, 32 inputs, 16 lanes]
    if fmt is PanelFormat.Q6_K:
        words = (high << (2 * np.arange(PANEL, dtype=np.uint32))).sum(axis=-1, dtype=np.uint32)
    else:
        lanes = high << np.arange(PANEL, dtype=np.uint32)
        words = (lanes[:, :, :QBLOCK // 2].sum(axis=-1, dtype=np.uint32)
                 | (lanes[:, :, QBLOCK // 2:].sum(axis=-1, dtype=np.uint32) << 16))
    return np.ascontiguousarray(words.astype("<u4")).view(np.uint8).reshape(panels, blocks, -1)


def stack_panels(matrices: list[PanelMatrix]) -> PanelMatrix | None:
    """Matrices of one input width stacked by rows (q, k and v into qkv), or None when their
    widths differ: one matrix where their formats are the same, else a stack of parts (the
    runs of one format, each concatenated), which the kernels take part by part."""
    first = matrices[0]
    if any(m.in_features != first.in_features or m.parts for m in matrices):
        return None
    runs: list[list[PanelMatrix]] = []
    for matrix in matrices:
        if runs and runs[-1][0].format == matrix.format:
            runs[-1].append(matrix)
        else:
            runs.append([matrix])
    parts = tuple(PanelMatrix(torch.cat([m.data for m in run]), run[0].format,
                              sum(m.out_features for m in run), first.in_features,
                              _origins(run)) for run in runs)
    if len(parts) == 1:
        return parts[0]
    return PanelMatrix(parts[0].data, parts[0].format, sum(m.out_features for m in matrices),
                       first.in_features, _origins(matrices), parts)


def interleave_panels(gate: PanelMatrix, up: PanelMatrix) -> PanelMatrix | None:
    """gate and up panels interleaved (gate 0, up 0, gate 1, ...: the decode forward's
    gate_up), or None when their formats or shapes differ."""
    if (gate.format, gate.out_features, gate.in_features) != (
            up.format, up.out_features, up.in_features) or gate.parts or up.parts:
        return None
    data = torch.stack([gate.data, up.data], dim=1).reshape(-1, *gate.data.shape[1:])
    return PanelMatrix(data, gate.format, 2 * gate.out_features, gate.in_features,
                       _origins([gate, up]))


def _origins(matrices: list[PanelMatrix]) -> str:
    return "+".join(sorted({matrix.origin for matrix in matrices}))


# Each decoder: raw rows [N, bytes] and blocks of 32 per row -> (format, the per-block fields
# in the format's order, each [N, KB] in its stored dtype, values [N, KB, 32] as int8 (Q8) or
# unsigned uint8 (0..15, 0..31 or 0..63)).
_Decoded = tuple[PanelFormat, list[np.ndarray], np.ndarray]


def _halves(rows: np.ndarray, offset: int, step: int) -> np.ndarray:
    """The float16 at byte `offset` of each `step`-byte block, [N, blocks]."""
    count = rows.shape[1] // step
    blocks = rows.reshape(rows.shape[0], count, step)
    return blocks[..., offset:offset + 2].copy().view(np.float16)[..., 0]


def _q8_0(rows: np.ndarray, num_blocks: int) -> _Decoded:
    blocks = rows.reshape(rows.shape[0], num_blocks, 34)
    return PanelFormat.Q8, [_halves(rows, 0, 34)], blocks[..., 2:].copy().view(np.int8)


def _q4_nibbles(qs: np.ndarray) -> np.ndarray:  # [..., 16] bytes -> [..., 32] values
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_0(rows: np.ndarray, num_blocks: int) -> _Decoded:
    scale = _halves(rows, 0, 18)
    values = _q4_nibbles(rows.reshape(rows.shape[0], num_blocks, 18)[..., 2:])
    if np.abs(scale.astype(np.float32)).max() * 8 <= _FLOAT16_MAX:
        return PanelFormat.Q4, [scale, -8 * scale], values
    # The minimum (-8 scale) is past float16's range: as a K-quant block, d = dmin = scale,
    # sc = 1, m = 8, the minimum computed in float32.
    ones = np.ones(scale.shape, dtype=np.uint8)
    return PanelFormat.Q4_K, [scale, scale, ones, 8 * ones], values


def _q4_1(rows: np.ndarray, num_blocks: int) -> _Decoded:
    values = _q4_nibbles(rows.reshape(rows.shape[0], num_blocks, 20)[..., 4:])
    return PanelFormat.Q4, [_halves(rows, 0, 20), _halves(rows, 2, 20)], values


def _q5_high(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 32 fifth bits (a little-endian uint32 per block, [N, KB, 4] bytes) as
    [N, KB, 32] values 0 or 16."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")
    return (bits << 4).astype(np.uint8)


def _q5_0(rows: np.ndarray, num_blocks: int) -> _Decoded:
    blocks = rows.reshape(rows.shape[0], num_blocks, 22)
    scale = _halves(rows, 0, 22)
    values = _q4_nibbles(blocks[..., 6:]) | _q5_high(blocks[..., 2:6])
    if np.abs(scale.astype(np.float32)).max() * 16 <= _FLOAT16_MAX:
        return PanelFormat.Q5, [scale, -16 * scale], values
    ones = np.ones(scale.shape, dtype=np.uint8)  # as Q4_0's, a K-quant block's minimum
    return PanelFormat.Q5_K, [scale, scale, ones, 16 * ones], values


def _q5_1(rows: np.ndarray, num_blocks: int) -> _Decoded:
    blocks = rows.reshape(rows.shape[0], num_blocks, 24)
    values = _q4_nibbles(blocks[..., 8:]) | _q5_high(blocks[..., 4:8])
    return PanelFormat.Q5, [_halves(rows, 0, 24), _halves(rows, 2, 24)], values


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of eight 6-bit sub-block scales and minimums, [N, S, 12] ->
    two [N, S, 8]."""
    sc = np.empty((*packed.shape[:2], 8), dtype=np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4] = packed[..., 0:4] & 63
    mn[..., :4] = packed[..., 4:8] & 63
    sc[..., 4:] = (packed[..., 8:12] & 0x0F) | ((packed[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (packed[..., 8:12] >> 4) | ((packed[..., 4:8] >> 6) << 4)
    return sc, mn


def _per_block(per_super: np.ndarray) -> np.ndarray:  # [N, S] -> [N, 8 S]
    return np.repeat(per_super, 8, axis=1)


def _k_quant(rows: np.ndarray, num_blocks: int, size: int, fmt: PanelFormat,
             values: np.ndarray) -> _Decoded:
    """A K-quant super-block's fields (float16 d and dmin, then its packed scales at byte 4)
    and its values in the panels' order."""
    num_out = rows.shape[0]
    supers = rows.reshape(num_out, num_blocks // 8, size)
    sc, mn = _k_scales(supers[..., 4:16])
    return fmt, [_per_block(_halves(rows, 0, size)), _per_block(_halves(rows, 2, size)),
                 sc.reshape(num_out, num_blocks), mn.reshape(num_out, num_blocks)], values


def _q4_k(rows: np.ndarray, num_blocks: int) -> _Decoded:
    # A super-block of 256: float16 d and dmin, 12 bytes of eight 6-bit sub-block scales and
    # minimums, 128 bytes of values: each 32 bytes hold two sub-blocks (low nibbles, then high).
    qs = rows.reshape(rows.shape[0], num_blocks // 8, 144)[..., 16:].reshape(-1, num_blocks // 8,
                                                                           4, 32)
    values = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(rows.shape[0], num_blocks, QBLOCK)
    return _k_quant(rows, num_blocks, 144, PanelFormat.Q4_K, values)


def _q5_k(rows: np.ndarray, num_blocks: int) -> _Decoded:
    # As Q4_K's (176 bytes), with 32 bytes of fifth bits before the nibbles: bit s of byte l
    # is the fifth bit of value l of sub-block s.
    num_out, supers = rows.shape[0], num_blocks // 8
    blocks = rows.reshape(num_out, supers, 176)
    qs = blocks[..., 48:].reshape(num_out, supers, 4, 32)
    low = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(num_out, supers, 8, 32)
    high = np.unpackbits(blocks[..., 16:48, None], axis=-1, bitorder="little")  # [N, S, 32, 8]
    values = low | (np.moveaxis(high, -1, 2) << 4)
    return _k_quant(rows, num_blocks, 176, PanelFormat.Q5_K,
                    values.reshape(num_out, num_blocks, QBLOCK))


def _q6_k(rows: np.ndarray, num_blocks: int) -> _Decoded:
    # A super-block of 256 (210 bytes): ql[128] (low nibbles), qh[64] (two bits each), int8
    # scales[16] (one per 16 values), float16 d. Each half of 128 takes 64 bytes of ql and 32
    # of qh: value l + 32 j of the half is nibble (j odd: high) of ql[l + 32 (j % 2)] and bits
    # 2 j, 2 j + 1 of qh[l].
    num_out, supers = rows.shape[0], num_blocks // 8
    blocks = rows.reshape(num_out, supers, 210)
    ql = blocks[..., :128].reshape(num_out, supers, 2, 2, 32)  # [half, ql part, l]
    qh = blocks[..., 128:192].reshape(num_out, supers, 2, 1, 32)
    low = np.stack([ql[..., 0, :] & 0x0F, ql[..., 1, :] & 0x0F, ql[..., 0, :] >> 4,
                    ql[..., 1, :] >> 4], axis=3)  # [N, S, half, j, l]
    high = np.stack([(qh[..., 0, :] >> (2 * j)) & 3 for j in range(4)], axis=3)
    values = (low | (high << 4)).reshape(num_out, num_blocks, QBLOCK)
    scales = blocks[..., 192:208].copy().view(np.int8).reshape(num_out, num_blocks, 2)
    d = _per_block(_halves(rows, 208, 210))
    return PanelFormat.Q6_K, [d, scales[..., 0].copy(), scales[..., 1].copy()], values


_DECODERS = {
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q5_0: _q5_0,
    GGMLQuantizationType.Q5_1: _q5_1,
    GGMLQuantizationType.Q5_K: _q5_k,
    GGMLQuantizationType.Q6_K: _q6_k,
}
