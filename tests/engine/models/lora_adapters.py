"""Random PEFT LoRA adapters for the tiny checkpoints, and PEFT's greedy tokens as reference."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, PreTrainedModel

from engine.checkpoints.lora_adapter import TARGET_MODULES
from engine.types import LoraRequest


@dataclass
class Adapter:
    """An adapter saved in PEFT's format, and the PEFT model that runs it."""

    lora: LoraRequest
    peft_model: PeftModel

    @property
    def reference(self) -> PreTrainedModel:
        """The adapted HF model (for hf_greedy)."""
        model: PreTrainedModel = self.peft_model.base_model.model
        return model


def make_adapter(
    base_dir: Path,
    path: Path,
    rank: int,
    seed: int,
    targets: tuple[str, ...] = TARGET_MODULES,
    use_rslora: bool = False,
    alpha: float | None = None,
    **extra: object,
) -> Adapter:
    """A rank-`rank` adapter of random A and B (std 0.1) on targets of the checkpoint at
    base_dir, saved to path; named after the path."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="sdpa")
    config = PeftLoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank,
                            target_modules=list(targets), init_lora_weights=False,
                            use_rslora=use_rslora, lora_dropout=0.0, **extra)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.1)
    model.eval()
    model.save_pretrained(path)
    return Adapter(LoraRequest(name=path.name, path=str(path)), model)
