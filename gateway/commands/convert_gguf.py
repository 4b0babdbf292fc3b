"""`tiergate convert-gguf FILE OUTDIR`: write a GGUF model as a HF checkpoint directory."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from engine import GGUFCheckpoint, ModelConfigError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "convert-gguf",
        help="convert a GGUF model (llama.cpp's format) to a checkpoint directory",
        description="Dequantize a GGUF file (Llama, Qwen2, Qwen3; F32, F16, BF16, Q8_0, Q4_0, "
        "Q4_1, Q5_0, Q5_1 and the K-quants) into OUTDIR: config.json, safetensors weights, "
        "tokenizer.json, tokenizer_config.json and chat_template.jinja. `tiergate serve "
        "--model FILE.gguf` does this once by itself, into its model cache.",
    )
    parser.add_argument("file", type=Path, help="the .gguf file")
    parser.add_argument("outdir", type=Path, help="output directory (created if missing)")
    parser.add_argument(
        "--dtype", choices=sorted(_DTYPES), default="float32", help="weights' dtype (float32)"
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        checkpoint = GGUFCheckpoint.open(args.file)
        path = checkpoint.convert(args.outdir, _DTYPES[args.dtype])
    except ModelConfigError as exc:
        print(f"convert-gguf: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"convert-gguf: cannot write {args.outdir}: {exc}", file=sys.stderr)
        return 1
    files = sorted(p.name for p in path.iterdir() if p.is_file())
    if args.json:
        print(json.dumps({"path": str(path.resolve()), "dtype": args.dtype, "files": files}))
    else:
        print(f"wrote {args.file.name} ({args.dtype}) to {path}: {', '.join(files)}")
    return 0
