"""Compile and step time of a jitted LoRA value_and_grad step on SmolLM2-135M-Instruct.

  python benchmarks/model_step_speed.py --shapes 8x128 4x512 --attention xla einsum

Prints one JSON line per (dtype, attention, remat, shape): compile seconds (lower + compile of
one bucket shape) and the median seconds of `--steps` steps after a warm-up step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsft import lora, loss
from jaxsft.models import load_causal_lm, llama


def lora_step(model, batch):
  def loss_fn(m):
    logits = m(batch["input_ids"], attention_mask=batch["attention_mask"])
    return loss.cross_entropy_sum(logits, batch["labels"])

  (nll, count), grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam),
                                           has_aux=True)(model)
  return loss.normalize_by_valid((nll, grads), count)


def measure(model, b, t, steps):
  rng = np.random.default_rng(0)
  batch = {"input_ids": rng.integers(3, model.config.vocab_size, (b, t)).astype(np.int32),
           "attention_mask": np.ones((b, t), np.int32)}
  batch["labels"] = batch["input_ids"].copy()
  graphdef, state = nnx.split(model)
  step = jax.jit(lambda state, batch: lora_step(nnx.merge(graphdef, state), batch))
  start = time.perf_counter()
  compiled = step.lower(state, batch).compile()
  compile_s = time.perf_counter() - start
  jax.block_until_ready(compiled(state, batch))
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    jax.block_until_ready(compiled(state, batch))
    times.append(time.perf_counter() - start)
  return compile_s, statistics.median(times)


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="smollm2-135m-instruct")
  parser.add_argument("--shapes", nargs="+", default=["8x128", "4x512"])
  parser.add_argument("--attention", nargs="+", default=["xla", "einsum"])
  parser.add_argument("--dtype", nargs="+", default=["float32"])
  parser.add_argument("--remat", nargs="+", default=["none"])
  parser.add_argument("--steps", type=int, default=3)
  args = parser.parse_args()
  base = load_causal_lm(args.model)
  tensors = llama.to_hf_state_dict(base)
  for dtype in args.dtype:
    for attention in args.attention:
      for remat in args.remat:
        model = llama.from_hf_state_dict(base.config, tensors, dtype=dtype, attention=attention,
                                         remat=None if remat == "none" else remat)
        lora.apply_lora(model, r=8, alpha=16, target_modules=("q_proj", "v_proj"))
        for shape in args.shapes:
          b, t = map(int, shape.split("x"))
          compile_s, step_s = measure(model, b, t, args.steps)
          print(json.dumps({"model": args.model, "dtype": dtype, "attention": attention, "remat": remat,
                            "batch": b, "seq": t, "compile_s": round(compile_s, 2),
                            "step_s": round(step_s, 3), "backend": jax.default_backend(),
                            "cpus": os.cpu_count(), "machine": platform.machine()}), flush=True)


if __name__ == "__main__":
  main()
