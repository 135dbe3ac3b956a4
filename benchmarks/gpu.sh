#!/usr/bin/env bash
# The GPU run: every cell of `benchmarks/gpu_run.py` (a float32 parity check, then jaxsft against
# torch eager + peft and torch.compile at SmolLM2-135M, Llama-3.2-1B and Llama-3.1-8B shapes, and
# jaxsft's 8B step on an NF4 base) on
# one NVIDIA GPU, in at most 17.5 minutes (the cells' limits add up to 17; where a call is capped at 10
# minutes, run it as two calls with --only), with no network:
#
#   python -m benchmarks.gpu_wheels     # where pip reaches PyPI, once: the wheels the image lacks
#                                       # (grain, gguf, ...) into benchmarks/gpu_wheels (~8 MB, ignored)
#   bash benchmarks/gpu.sh              # on the GPU machine, from the repository root
#   bash benchmarks/gpu.sh --rehearse   # here, first: the same script on the CPU at tiny sizes
#   bash benchmarks/gpu.sh --only parity llama8b_bf16   # some cells again (gpu_run's arguments)
#
# It runs with the machine's own python3 (PYTHON to choose another), which must be 3.12 and hold
# jax with CUDA, flax, optax, orbax-checkpoint, transformers, tokenizers, safetensors, torch with
# CUDA and peft. It prints the versions it found, refuses in one line what cannot work, makes a
# venv that sees those packages (`--system-site-packages`) and installs the gathered wheels into it
# offline (`--no-index --no-deps`), then runs the cells, each under its own limit; a failing cell
# says why and the rest go on. Results: benchmarks/results/vs_torch_<cell>_gpu.{json,md},
# qlora_llama-3.1-8b_nf4_gpu.{json,md}, parity_gpu.json and the list of cells gpu_run_gpu.{json,md}. The model weights are random, drawn
# from the real configs in configs/models (no download; speed does not depend on the values).
#
# --rehearse: the "image" is a python3.12 venv pinned to the GPU image's versions (made once with
# pip: jax 0.11.2 for the CPU, transformers 5.17, ..., and jinja2, which the image's torch brings;
# REHEARSE_IMAGE names it), every cell runs on
# the CPU with the tiny model at 2x64, and the results go to benchmarks/results/gpu_rehearsal.md.
# PyPI's only cp312 torch 2.11 is the CUDA build (several GB of nvidia-* wheels), so the PyTorch
# side of the rehearsal runs under TORCH_PYTHON (default: the project's .venv/bin/python).
set -uo pipefail
cd "$(dirname "$0")/.."

MODE=gpu
[ "${1:-}" = "--rehearse" ] && MODE=rehearse && shift
WHEELS=benchmarks/gpu_wheels
RUN_VENV="${RUN_VENV:-${TMPDIR:-/tmp}/jaxsft-gpu-run-venv}"
TOTAL_LIMIT="${TOTAL_LIMIT:-1050}"
start=$(date +%s)
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH="$PWD"
refuse() { echo "gpu.sh: cannot run: $*" >&2; exit 2; }

run_args=()
if [ "$MODE" = rehearse ]; then
  REHEARSE_IMAGE="${REHEARSE_IMAGE:-${TMPDIR:-/tmp}/jaxsft-image-py312}"
  if [ ! -x "$REHEARSE_IMAGE/bin/python" ]; then
    echo "gpu.sh: making the rehearsal image $REHEARSE_IMAGE (python3.12, the GPU image's versions, CPU jax)"
    PYENV_VERSION="${PYENV_VERSION:-3.12.1}" python3.12 -m venv "$REHEARSE_IMAGE" \
      && "$REHEARSE_IMAGE/bin/python" -m pip install -q jax==0.11.2 jaxlib==0.11.2 flax optax orbax-checkpoint \
           transformers==5.17.0 tokenizers pyarrow jinja2 \
      && "$REHEARSE_IMAGE/bin/python" -m pip install -q --no-deps peft \
      || refuse "could not make the rehearsal image $REHEARSE_IMAGE"
  fi
  PYTHON="$REHEARSE_IMAGE/bin/python"
  TORCH_PYTHON="${TORCH_PYTHON:-$PWD/.venv/bin/python}"
  run_args+=(--rehearse --torch-python "$TORCH_PYTHON")
  export JAX_PLATFORMS=cpu
else
  PYTHON="${PYTHON:-python3}"
  [ -n "${TORCH_PYTHON:-}" ] && run_args+=(--torch-python "$TORCH_PYTHON")
fi

# 1. What is there.
echo "gpu.sh ($MODE): $("$PYTHON" --version 2>&1) at $(command -v "$PYTHON" || echo "$PYTHON")"
"$PYTHON" - <<'EOF'
from importlib import metadata
names = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "optax", "orbax-checkpoint", "grain", "gguf",
         "transformers", "peft", "tokenizers", "safetensors", "pyarrow", "torch", "trl", "google-tunix",
         # what the peers import beyond the gathered wheels: TRL's `datasets` imports pandas, Tunix
         # imports pandas and pillow (its RL modules), together ~18 MB of wheels the folder has no room for
         "pandas", "pillow", "accelerate")
found = []
for name in names:
  try:
    found.append(f"{name} {metadata.version(name)}")
  except metadata.PackageNotFoundError:
    found.append(f"{name} -")
print("gpu.sh: image: " + ", ".join(found))
EOF
if [ "$MODE" = gpu ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
    || refuse "nvidia-smi failed: no NVIDIA GPU or driver"
else
  echo "gpu.sh: torch side: $("$TORCH_PYTHON" -c 'import sys, torch; print(f"python {sys.version.split()[0]}, torch {torch.__version__}")' 2>&1 | tail -1)"
fi

# 2. Refuse early, in one line, what cannot work.
"$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' \
  || refuse "$PYTHON is $("$PYTHON" --version 2>&1), the gathered wheels are for CPython 3.12"
ls "$WHEELS"/*.whl "$WHEELS"/tokenizer/tokenizer.json >/dev/null 2>&1 \
  || refuse "no wheels or tokenizer in $WHEELS: run 'python -m benchmarks.gpu_wheels' where pip reaches PyPI, then bring the tree"
missing=$("$PYTHON" -c '
import importlib.util
mods = ("jax", "flax", "optax", "orbax.checkpoint", "transformers", "tokenizers", "safetensors", "numpy", "yaml", "jinja2")
print(" ".join(m for m in mods if importlib.util.find_spec(m) is None))')
[ -z "$missing" ] || refuse "the image lacks $missing (not among the gathered wheels)"
if [ "$MODE" = gpu ]; then
  "$PYTHON" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' \
    || refuse "JAX does not see the GPU (backend $("$PYTHON" -c 'import jax; print(jax.default_backend())' 2>&1 | tail -1))"
  "${TORCH_PYTHON:-$PYTHON}" -c 'import torch, peft, sys; sys.exit(not torch.cuda.is_available())' \
    || refuse "torch with CUDA and peft are not importable, or torch does not see the GPU"
fi

# 3. A venv that sees the image's packages, with the wheels installed offline. The image's
# site-packages also go in a .pth file: `--system-site-packages` reaches only a base interpreter's,
# and the rehearsal's image is itself a venv.
rm -rf "$RUN_VENV"
"$PYTHON" -m venv --system-site-packages "$RUN_VENV" || refuse "could not make a venv at $RUN_VENV"
"$PYTHON" -c 'import site; print("\n".join(site.getsitepackages()))' \
  > "$("$RUN_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/image_site_packages.pth"
"$RUN_VENV/bin/python" -m pip install --quiet --no-index --no-deps "$WHEELS"/*.whl \
  || refuse "the wheels in $WHEELS did not install offline"
"$RUN_VENV/bin/python" -c 'import grain, gguf, jaxsft.train, benchmarks.vs_torch' \
  || refuse "jaxsft does not import in $RUN_VENV (a package the image lacks is missing from benchmarks/gpu_wheels.py)"
echo "gpu.sh: venv ready in $(( $(date +%s) - start )) s"

# 4. The cells, each under its own limit; the whole under TOTAL_LIMIT seconds.
left=$(( TOTAL_LIMIT - ($(date +%s) - start) ))
[ "$MODE" = rehearse ] && left=3600  # a shared 2-core CPU: the rehearsal is not timed
timeout "$left" "$RUN_VENV/bin/python" -m benchmarks.gpu_run "${run_args[@]}" "$@"
status=$?
echo "gpu.sh: done in $(( $(date +%s) - start )) s (exit $status)"
exit $status
