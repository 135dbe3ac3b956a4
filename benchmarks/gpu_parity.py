"""Loss and LoRA-gradient parity of jaxsft against transformers + peft on one device, float32.

    python -m benchmarks.gpu_parity [--device cuda] [--out benchmarks/results/parity_gpu.json] [--torch-python PY]

The tiny random Llama (`benchmarks.common.tiny_config`) written once as safetensors, one LoRA
adapter (r 8 / alpha 16 on q_proj, v_proj, down_proj; B drawn non-zero so A's gradients are not
zero) loaded by both, one batch of `alpaca_en_demo.json` from jaxsft's pipeline. Both sides in
float32 at full precision: JAX under `jax.default_matmul_precision("highest")`, torch with TF32
off for matmuls and cuDNN. Compared: the mean loss (Σ nll / Σ trained tokens; |Δ| ≤ 1e-5) and
every LoRA gradient (max |Δ| / max |torch| per tensor, the worst tensor ≤ 1e-4). Each side runs
in its own process (the PyTorch one under `--torch-python` where given) and leaves its loss and
gradients in an .npz file.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

from benchmarks import common

LOSS_TOLERANCE, GRAD_TOLERANCE = 1e-5, 1e-4
TARGETS = ("q_proj", "v_proj", "down_proj")


def prepare(workdir: pathlib.Path, shape=(2, 64), *, dataset: str = "alpaca_en_demo.json", tokenizer_dir=None) -> dict:
  """Weights, an adapter with non-zero B, and one batch, written into `workdir`."""
  from safetensors.numpy import load_file, save_file

  from benchmarks import vs_torch

  meta = vs_torch.prepare(workdir, model_name="tiny", shapes=[shape], steps=1, lora_targets=TARGETS, dataset=dataset,
                          tokenizer_dir=tokenizer_dir, log=lambda s: None)
  path = pathlib.Path(meta["adapter"]) / "adapter_model.safetensors"
  tensors = load_file(str(path))
  rng = np.random.default_rng(0)
  tensors = {k: (0.05 * rng.standard_normal(v.shape)).astype(v.dtype) if "lora_B" in k else v for k, v in tensors.items()}
  save_file(tensors, str(path))
  (workdir / "meta.json").write_text(json.dumps({**meta, "shape": list(shape)}))
  return load_meta(workdir)


def load_meta(workdir: pathlib.Path) -> dict:
  meta = json.loads((workdir / "meta.json").read_text())
  batch = np.load(workdir / f"batches_{meta['shape'][0]}x{meta['shape'][1]}.npz")
  return {**meta, "batch": {k: batch[k][0] for k in batch.files}}


def save_side(path: pathlib.Path, loss: float, grads: dict[str, np.ndarray]) -> None:
  np.savez(path, __loss__=np.float64(loss), **grads)


def load_side(path: pathlib.Path) -> tuple[float, dict[str, np.ndarray]]:
  data = np.load(path)
  return float(data["__loss__"]), {k: data[k] for k in data.files if k != "__loss__"}


def run_side(side: str, workdir: pathlib.Path, device: str, python: str) -> tuple[float, dict[str, np.ndarray]]:
  """One side's loss and gradients, computed in a fresh process."""
  cmd = [python, "-m", "benchmarks.gpu_parity", "--side", side, "--workdir", str(workdir), "--device", device]
  env = dict(os.environ, PYTHONPATH=str(common.ROOT))
  proc = subprocess.run(cmd, cwd=common.ROOT, env=env, capture_output=True, text=True)
  if proc.returncode != 0:
    raise RuntimeError(f"the {side} side failed: {' | '.join(proc.stderr.strip().splitlines()[-3:])}")
  return load_side(workdir / f"{side}.npz")


def jax_loss_and_grads(meta: dict) -> tuple[float, dict[str, np.ndarray]]:
  import jax
  from flax import nnx

  from jaxsft import lora, loss

  model = common.load_jax_model(meta["jax_source"], dtype="float32")
  lora.apply_lora(model, r=8, alpha=16, dropout=0.0, target_modules=TARGETS, seed=0)
  lora.load_adapter(model, meta["adapter"])
  batch = meta["batch"]
  inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}

  @nnx.jit
  def sums_and_grads(m):
    return nnx.value_and_grad(lambda m: loss.cross_entropy_sum(m(**inputs), batch["labels"]),
                              argnums=nnx.DiffState(0, nnx.LoRAParam), has_aux=True)(m)

  with jax.default_matmul_precision("highest"):
    (nll, count), grads = sums_and_grads(model)
  # The gradients under PEFT's names: set them as a copy's LoRA factors and write those out.
  holder = nnx.clone(model)
  for name in TARGETS:
    src = grads["layers"]
    for attr in lora.module_paths(holder)[name]:
      src = src[attr]
    proj = lora._projection(holder, name)
    proj.lora_a.set_value(src["lora_a"][...] / count)
    proj.lora_b.set_value(src["lora_b"][...] / count)
  return float(nll) / int(count), {k: np.asarray(v, np.float64) for k, v in lora.adapter_tensors(holder).items()}


def torch_loss_and_grads(meta: dict, device: str) -> tuple[float, dict[str, np.ndarray]]:
  import peft
  import torch
  import transformers

  torch.backends.cuda.matmul.allow_tf32 = False
  torch.backends.cudnn.allow_tf32 = False
  base = transformers.AutoModelForCausalLM.from_pretrained(meta["hf_dir"], dtype=torch.float32).to(device)
  model = peft.PeftModel.from_pretrained(base, meta["adapter"], is_trainable=True).to(device)
  batch = {k: torch.tensor(v, dtype=torch.long, device=device) for k, v in meta["batch"].items()}
  logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
  targets = batch["labels"][:, 1:].reshape(-1)
  nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).double(), targets,
                                          ignore_index=-100, reduction="sum")
  mean = nll / (targets != -100).sum()
  mean.backward()
  grads = {name.replace(".default", ""): p.grad.detach().double().cpu().numpy()
           for name, p in model.named_parameters() if "lora_" in name}
  return mean.item(), grads


def compare(jax_side, torch_side) -> dict:
  (j_loss, j_grads), (t_loss, t_grads) = jax_side, torch_side
  if sorted(j_grads) != sorted(t_grads):
    raise RuntimeError(f"LoRA tensors differ: {sorted(set(j_grads) ^ set(t_grads))[:4]}")
  errors = {k: float(np.abs(j_grads[k] - t_grads[k]).max() / max(np.abs(t_grads[k]).max(), 1e-30)) for k in t_grads}
  worst = max(errors, key=errors.get)
  loss_diff = abs(j_loss - t_loss)
  return {"loss_jaxsft": j_loss, "loss_torch": t_loss, "loss_abs_diff": loss_diff, "grad_max_rel_err": errors[worst],
          "worst_tensor": worst, "tensors": len(errors),
          "ok": loss_diff <= LOSS_TOLERANCE and errors[worst] <= GRAD_TOLERANCE,
          "tolerances": {"loss_abs": LOSS_TOLERANCE, "grad_rel": GRAD_TOLERANCE}}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--device", default="cuda", help="torch's device (JAX uses its default backend)")
  parser.add_argument("--out", help="write the result as JSON here")
  parser.add_argument("--dataset", default="alpaca_en_demo.json", help="as benchmarks.vs_torch's (`builtin`: generated)")
  parser.add_argument("--tokenizer", help="as benchmarks.vs_torch's")
  parser.add_argument("--torch-python", help="interpreter for the PyTorch side (default: this one)")
  parser.add_argument("--side", choices=("jax", "torch"), help=argparse.SUPPRESS)
  parser.add_argument("--workdir", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.side:  # worker
    workdir = pathlib.Path(args.workdir)
    meta = load_meta(workdir)
    side = jax_loss_and_grads(meta) if args.side == "jax" else torch_loss_and_grads(meta, args.device)
    save_side(workdir / f"{args.side}.npz", *side)
    return 0
  import jax

  with tempfile.TemporaryDirectory(prefix="jaxsft_parity_") as tmp:
    workdir = pathlib.Path(tmp)
    prepare(workdir, dataset=common.BUILTIN if args.dataset == "builtin" else args.dataset, tokenizer_dir=args.tokenizer)
    result = compare(run_side("jax", workdir, args.device, sys.executable),
                     run_side("torch", workdir, args.device, args.torch_python or sys.executable))
  result.update(jax_backend=jax.default_backend(), device=args.device)
  print(f"parity ({jax.default_backend()} / torch {args.device}): |Δloss| {result['loss_abs_diff']:.1e} "
        f"(≤ {LOSS_TOLERANCE:.0e}), LoRA grads max rel err {result['grad_max_rel_err']:.1e} (≤ {GRAD_TOLERANCE:.0e}, "
        f"{result['worst_tensor']}): {'ok' if result['ok'] else 'FAILED'}", flush=True)
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
  return 0 if result["ok"] else 1


if __name__ == "__main__":
  sys.exit(main())
