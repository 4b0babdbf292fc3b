"""A 1B-shape GGUF file in a K-quant (Q4_K by default), served as stored: memory and speed.

    python -m ops.bench.gguf_1b_stored [--workdir DIR] [--tokens 64] [--seed 0] [--type Q4_K]

Writes a Llama of Llama-3.2-1B's layer shapes (hidden 2048, intermediate 8192, 16 layers, 32
heads of 64, 8 KV heads) with the default model's tokenizer (vocabulary 49,152) and seeded
random weights as an F16 GGUF file, quantizes it with the `llama-quantize` that `tiergate
bench peer --compare-llamacpp` builds (`quantized_model`: `--pure Q4_K`, every matrix Q4_K;
--type Q4_K_M: llama-quantize's mixture, some matrices Q6_K, as the files people download),
and builds the engine `tiergate serve` builds for it with `--dtype auto` (the file's blocks
as stored). It prints the files' sizes, what the engine kept as stored and the bytes of its
weights, the process's resident memory before and after the engine is built, and one greedy
request's decode time per token (a prompt of 128 random ids, --tokens new tokens). Minutes:
the build of llama.cpp on first use, then writing 2 GB and quantizing it.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import random
import statistics
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

from bench.serve.llamacpp_build import ensure_built, quantized_model
from engine import SamplingParams
from engine.checkpoints.gguf_checkpoint import GGUFCheckpoint
from engine.models.config import ModelConfig
from engine.models.cpu_decode import PanelEmbedding, PanelLinear
from engine.models.loader import random_hf_state_dict
from engine.worker.model_runner import TorchModelRunner
from gateway.server.model_source import default_model_file, resolve_model
from gateway.server.model_spec import ModelSpec
from gateway.server.served_model import build_engine
from gateway.server.settings import GatewaySettings
from policies import TierTable
from tests.engine.checkpoints.gguf_files import TokenizerFields, write_gguf

SHAPE = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "max_position_embeddings": 4096, "tie_word_embeddings": True,
}


def resident_mb() -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def write_random_model(path: Path, seed: int) -> None:
    """The shape above with the default model's tokenizer, F16."""
    source = GGUFCheckpoint.open(default_model_file(Path.home() / ".cache/tiergate/models"))
    fields = source.tokenizer_fields()
    config = dict(SHAPE, vocab_size=len(fields.tokens))
    tokenizer = TokenizerFields(
        list(fields.tokens), list(fields.token_types), list(fields.merges),
        pre=fields.pre or "gpt-2", model=fields.model, bos_token_id=fields.bos_token_id,
        eos_token_id=fields.eos_token_id, unk_token_id=fields.unk_token_id,
        add_bos_token=fields.add_bos_token, chat_template=fields.chat_template)
    state = random_hf_state_dict(ModelConfig.from_dict(config), seed)
    write_gguf(path, "llama", config, {k: v.half() for k, v in state.items()},
               tokenizer, tensor_type=GGMLQuantizationType.F16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--workdir", type=Path, default=Path.home() / ".cache/tiergate/1b")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--type", default="Q4_K", choices=("Q4_K", "Q4_K_M", "Q5_K", "Q6_K"))
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    f16 = args.workdir / "llama-1b-shape.F16.gguf"
    if not f16.exists():
        write_random_model(f16, args.seed)
    quantized = quantized_model(ensure_built(), f16, args.type)
    print(f"{f16.name}: {f16.stat().st_size / 1e9:.2f} GB; {quantized.name}: "
          f"{quantized.stat().st_size / 1e9:.2f} GB")
    settings = GatewaySettings(max_num_seqs=8, max_model_len=1024, kv_cache_bytes=256 << 20)
    source = resolve_model(str(quantized), args.workdir / "cache", args.workdir / "demo", None)
    gc.collect()
    before = resident_mb()
    engine = build_engine(settings, TierTable(), ModelSpec(), source.model_dir,
                          source.gguf_file)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    runner = engine.runner
    assert isinstance(runner, TorchModelRunner)
    panels = {id(m.panels): m.panels.nbytes for m in runner.model.modules()
              if isinstance(m, PanelLinear | PanelEmbedding)}
    floats = sum(p.nbytes for p in runner.model.parameters())
    kv = sum(k.nbytes + v.nbytes for k, v in runner.kv_caches)
    print(f"weights: {runner.weight_format}: panels {sum(panels.values()) / 1e9:.3f} GB "
          f"({sum(panels.values()) / quantized.stat().st_size:.2f}x the file), float32 "
          f"{floats / 1e6:.1f} MB; KV cache {kv / 1e6:.0f} MB")
    print(f"resident: {before:.0f} MB before the engine (imports), {resident_mb():.0f} MB "
          f"after it is built")
    rng = random.Random(args.seed)
    prompt = [rng.randrange(1000, 40000) for _ in range(128)]
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=args.tokens,
                                                  ignore_eos=True))
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    print(f"one request: first step {times[0] * 1e3:.0f} ms, decode median "
          f"{statistics.median(times[2:]) * 1e3:.1f} ms per token over {len(times) - 2} steps, "
          f"{torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
