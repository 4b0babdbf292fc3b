#!/usr/bin/env bash
# The device check of the engine (issue 35), in one run on a machine with an NVIDIA GPU.
#
#   ops/gpu_check.sh wheels   here, before: the packages the device image lacks, into .whl/
#                             (llguidance, redis, gguf and jsonschema, for its Python 3.12;
#                             .whl is ignored)
#   ops/gpu_check.sh run      there, from the repository root (the device tool's run, with
#                             carry [".whl"], timeout_s 600): the whole check, at most 590 s
#   DEVICE=cpu TINY=1 ops/gpu_check.sh run   here: the same steps on tiny sizes, to try it
#   STEPS="engine lora-1b" ops/gpu_check.sh run   only the steps named (a rerun of those)
#
# In order, each with its own time limit, each log under $OUT (default /tmp/gpu-check):
#   1. engine: the whole engine on the GPU against HF transformers (greedy tokens equal, with
#      async scheduling on and off; CUDA graphs fed through engine.worker.graph_inputs; every
#      sampling feature; LoRA adapters through the Triton SGMV kernels against PEFT),
#      tests/engine/models/test_engine_devices.py, and grammar masks applied on the device
#      through preemption (the cuda cases of tests/engine/structured_output);
#   2. lora-1b: ops/bench/lora_throughput on the 1B Llama shape (bfloat16, random weights):
#      32 requests over 8 rank-16 adapters against the base model, in pairs;
#   3. kernels: the Triton kernel tests (attention with an fp8 KV cache too, fused add-norm,
#      LoRA shrink/expand, the AWQ/GPTQ int4/int8 and fp8 weight-only products);
#   4. bench-1b: `bench engine --device cuda --compare-hf` on the 1B Llama shape (bfloat16):
#      host work, step against forward at 1, 32, 128, 256 decodes, copy-rate fractions, and
#      offline tok/s against HF generate (128 requests of the offline workload);
#   5. bench-8b: the same on the Llama-3-8B shape at 1 and 128 decodes, without HF.
set -u
cd "$(dirname "$0")/.."
case "${1:-}" in
  wheels)
    grep -qx /.whl/ .git/info/exclude || echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
      --platform manylinux_2_17_x86_64 -d .whl llguidance==1.9.1 redis==8.1.0 gguf==0.19.0 \
      jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 \
      rpds-py==2026.9.1
    exit $? ;;
  run) ;;
  *) sed -n 2,19p "$0"; exit 2 ;;
esac

OUT=${OUT:-/tmp/gpu-check}
DEVICE=${DEVICE:-cuda}
TINY=${TINY:-0}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ "$DEVICE" = cuda ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
  PYTHON=python3
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
else
  export PYTHONPATH=$PWD TRITON_INTERPRET=1
  PYTHON=${PYTHON:-.venv/bin/python}
fi
$PYTHON -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton',
triton.__version__, 'transformers', transformers.__version__)" | tee "$OUT/versions.txt"

step() {  # name, seconds, command...
  local name=$1 limit=$2
  shift 2
  case " ${STEPS:-$name} " in *" $name "*) ;; *) return 0 ;; esac
  echo "== $name (limit ${limit} s) $(date +%T)"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 40 "$OUT/$name.log"
  echo "== $name: exit $rc $(date +%T)"
}

CONFIGS=$(mktemp -d)
$PYTHON - "$CONFIGS" <<'PY'
import json, sys
from engine.testing.no_work_runner import LLAMA_1B
eight_b = dict(LLAMA_1B, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               tie_word_embeddings=False)
for name, config in (("llama-1b", LLAMA_1B), ("llama-8b", eight_b)):
    with open(f"{sys.argv[1]}/{name}.json", "w") as f:
        json.dump(config, f)
PY

if [ "$TINY" = 1 ]; then  # the bench model, tiny batches: the plumbing only
  MODEL_1B=ops/bench/inputs/bench-model.json; MODEL_8B=$MODEL_1B; DTYPE=float32
  BATCHES_1B="1 3"; BATCHES_8B="1 2"; DEVICE_STEPS=6; OFFLINE=4; REPEATS=1; COPY=$((1 << 22))
else
  MODEL_1B=$CONFIGS/llama-1b.json; MODEL_8B=$CONFIGS/llama-8b.json; DTYPE=bfloat16
  BATCHES_1B="1 32 128 256"; BATCHES_8B="1 128"; DEVICE_STEPS=60; OFFLINE=128; REPEATS=3
  COPY=$((1 << 30))
fi

step engine 100 $PYTHON -m pytest -q -p no:cacheprovider tests/engine/models/test_engine_devices.py \
  tests/engine/structured_output/test_structured_output.py -k "cuda or devices"
if [ "$TINY" = 1 ]; then LORA="--quick"; else LORA="--pairs 3"; fi
# shellcheck disable=SC2086
step lora-1b 130 $PYTHON -m ops.bench.lora_throughput --device "$DEVICE" --dtype "$DTYPE" \
  --model-config "$MODEL_1B" $LORA
step kernels 80 $PYTHON -m pytest -q -p no:cacheprovider \
  tests/engine/attention/test_triton_kernels.py tests/engine/models/test_triton_add_norm.py \
  tests/engine/models/test_triton_lora.py tests/engine/models/test_quantized_linear.py
# shellcheck disable=SC2086
step bench-1b 170 $PYTHON -m bench.engine --device "$DEVICE" --dtype "$DTYPE" \
  --model-config "$MODEL_1B" --batches $BATCHES_1B --repeats "$REPEATS" \
  --device-steps "$DEVICE_STEPS" --copy-bytes "$COPY" --compare-hf --offline-requests "$OFFLINE"
# shellcheck disable=SC2086
step bench-8b 110 $PYTHON -m bench.engine --device "$DEVICE" --dtype "$DTYPE" \
  --model-config "$MODEL_8B" --batches $BATCHES_8B --repeats 1 --steps 10 \
  --device-steps "$DEVICE_STEPS" --copy-bytes "$COPY"
