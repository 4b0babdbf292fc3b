"""Products over each GGUF block type as stored, against float32 panels, in pairs.

    python -m ops.bench.panel_formats [--pairs 5] [--rows 1 8 32] [--shape 8192 2048]
        [--steps 30] [--seed 0]

One matrix of --shape (out, in: the 1B Llama shape's gate/up by default) of seeded random
blocks per type that the CPU kernels read as stored (engine.models.quantized.panels), and the
same weights dequantized into float32 panels; x @ W^T of R rows through PanelLinear
(cpu_decode.cpp) on all the process's threads. Per row count, a markdown table per type of
each pair's median step time (q, then f; the order reversed every other pair), q / f with its
median, min and max, and the panels' bytes per weight.
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from engine.models.cpu_decode import PanelLinear
from engine.models.quantized.panels import PANEL_TYPES, float_panels, gguf_panels
from ops.bench.quantized_decode import median_step_ms

# Where each type's float16 fields sit in its block (offset, count); the rest random bytes.
_SCALES = {GGMLQuantizationType.Q6_K: (208, 1)}


def random_blocks(kind: GGMLQuantizationType, rows: int, cols: int,
                  rng: np.random.Generator) -> np.ndarray:
    block, size = GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    offset, count = _SCALES.get(kind, (0, 2 if kind.name.endswith(("_1", "_K")) else 1))
    scales = rng.uniform(1e-3, 2e-3, size=(rows, cols // block, count)).astype(np.float16)
    raw[..., offset:offset + 2 * count] = scales.view(np.uint8).reshape(
        rows, cols // block, 2 * count)
    return raw.reshape(rows, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--shape", type=int, nargs=2, default=[8192, 2048])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    num_out, num_in = args.shape
    rng = np.random.default_rng(args.seed)
    print(f"[{num_out}, {num_in}], {torch.get_num_threads()} threads, seed {args.seed}\n")
    for kind in sorted(PANEL_TYPES, key=int):
        raw = random_blocks(kind, num_out, num_in, rng)
        stored = PanelLinear(gguf_panels(raw, kind, num_out, num_in))
        weights = torch.from_numpy(dequantize(raw, kind).reshape(num_out, num_in))
        floats = PanelLinear(float_panels(weights.to(torch.float32)))
        bits = 8 * stored.panels.nbytes / (num_out * num_in)
        print(f"### {kind.name} ({bits:.2f} bits per weight as stored)\n")
        print("| rows | q (ms) per pair | f (ms) per pair | q / f median (min-max) |")
        print("|---|---|---|---|")
        for rows in args.rows:
            x = torch.randn(rows, num_in, generator=torch.Generator().manual_seed(rows))
            ratios: list[float] = []
            qs: list[float] = []
            fs: list[float] = []
            with torch.inference_mode():
                for pair in range(args.pairs):
                    order = ((stored, qs), (floats, fs))
                    for module, into in order if pair % 2 == 0 else order[::-1]:
                        into.append(median_step_ms(partial(module, x), args.steps))
                    ratios.append(qs[-1] / fs[-1])
            print(f"| {rows} | {' '.join(f'{t:.2f}' for t in qs)} | "
                  f"{' '.join(f'{t:.2f}' for t in fs)} | {statistics.median(ratios):.3f} "
                  f"({min(ratios):.3f}-{max(ratios):.3f}) |")
        print()


if __name__ == "__main__":
    main()
