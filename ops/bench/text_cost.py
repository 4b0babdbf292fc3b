"""What making a sample's text costs per token, with and without stop strings: the figure
behind where text is made (docs/ARCHITECTURE.md, "Where text is made").

    python -m ops.bench.text_cost [--tokens 2000] [--repeats 5] [--seed 0]

The default model's tokenizer (SmolLM2, from its GGUF file) detokenizes --tokens random
token ids of its vocabulary one step at a time, as the engine's step or the gateway's job
would: `IncrementalDetokenizer` alone, and `TextOutputState` with two stop strings that never
match. Printed: microseconds per token, the minimum of --repeats runs.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from pathlib import Path

from engine import IncrementalDetokenizer, SamplingParams
from engine.checkpoints.gguf_checkpoint import GGUFCheckpoint
from engine.text.text_output import TextOutputState
from gateway.server.model_source import default_model_file
from gateway.server.settings import GatewaySettings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model_file = default_model_file(Path(GatewaySettings().model_cache_dir))
    tokenizer = GGUFCheckpoint.open(model_file).tokenizer()
    rng = random.Random(args.seed)
    ids = [rng.randrange(1000, 40000) for _ in range(args.tokens)]
    prompt = ids[:8]
    params = SamplingParams(stop=["\u2603never one", "\u2603nor this"])

    def detokenize() -> None:
        detokenizer = IncrementalDetokenizer(tokenizer, prompt, True)
        for token in ids:
            detokenizer.add_tokens([token])

    def with_stops() -> None:
        state = TextOutputState(tokenizer, prompt, params)
        for token in ids:
            state.append([token], finished=False)
            state.take_delta()

    print(f"text per token, SmolLM2 tokenizer, {args.tokens} tokens, min of {args.repeats}")
    print("| what | us per token |\n|---|---|")
    for name, run in (("detokenize", detokenize), ("detokenize + 2 stop strings", with_stops)):
        best = min(_timed(run) for _ in range(args.repeats))
        print(f"| {name} | {best / args.tokens * 1e6:.2f} |")
    return 0


def _timed(run: Callable[[], None]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


if __name__ == "__main__":
    raise SystemExit(main())
