"""Quantized weights served as stored.

`panels`: GGUF files' blocks repacked into the CPU kernels' panels (engine.models.cpu_decode).
Weight-only quantized linear layers of AWQ, GPTQ and fp8 HF checkpoints: `linear` holds the
module and its two layouts with their torch reference, `triton_matmul` the CUDA kernels,
`layouts` the repacking of each checkpoint format, `loading` the loader that
engine.models.loader.load_model hands such a checkpoint to.
"""

from engine.models.quantized.linear import (
    QuantizedFormat,
    QuantizedLinear,
    WeightKind,
    dequantize_fp8,
    dequantize_int,
)

__all__ = [
    "QuantizedFormat",
    "QuantizedLinear",
    "WeightKind",
    "dequantize_fp8",
    "dequantize_int",
]
