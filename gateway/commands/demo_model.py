"""`tiergate demo-model DIR`: write the tiny random-weight Llama checkpoint the engine can serve."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine import write_demo_model


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "demo-model",
        help="write a small random-weight Llama checkpoint with a real tokenizer",
        description="Write config.json, model.safetensors, generation_config.json, "
        "tokenizer.json and tokenizer_config.json into DIR. Deterministic for a seed.",
    )
    parser.add_argument("dir", type=Path, help="output directory (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        path = write_demo_model(args.dir, seed=args.seed)
    except OSError as exc:
        print(f"demo-model: cannot write {args.dir}: {exc}", file=sys.stderr)
        return 1
    files = sorted(p.name for p in path.iterdir() if p.is_file())
    if args.json:
        print(json.dumps({"path": str(path.resolve()), "seed": args.seed, "files": files}))
    else:
        print(f"wrote the demo model (seed {args.seed}) to {path}: {', '.join(files)}")
    return 0
