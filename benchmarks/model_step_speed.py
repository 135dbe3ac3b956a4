"""Compile and step time of a jitted LoRA value_and_grad step on SmolLM2-135M-Instruct.

  python benchmarks/model_step_speed.py --shapes 8x128 4x512 --attention xla dense --remat none dots

Prints one JSON line per (dtype, attention, remat, shape): compile seconds (lower + compile of
one bucket shape), the median and minimum seconds of `--steps` steps after a warm-up step, and
XLA's cost analysis of the compiled step (flops, bytes accessed: load-independent, loop bodies
counted once). The loss is the train step's (LM head at trained positions only); the first half
of every row is an untrained prompt. `--remat` takes `jaxsft.models.decoder.REMAT_POLICIES` names (what the
layer scan saves for the backward pass) or none.
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
from jaxsft import step as step_lib
from jaxsft.models import hf_weights, load_causal_lm


def lora_step(model, batch):
  def loss_fn(m):
    hidden = m.hidden_states(batch["input_ids"], attention_mask=batch["attention_mask"])
    return loss.trained_cross_entropy_sum(hidden, m.output_embedding(), batch["labels"],
                                          chunk_size=step_lib.loss_chunk_size())

  (nll, count), grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam),
                                           has_aux=True)(model)
  return loss.normalize_by_valid((nll, grads), count)


def measure(model, b, t, steps):
  rng = np.random.default_rng(0)
  batch = {"input_ids": rng.integers(3, model.config.vocab_size, (b, t)).astype(np.int32),
           "attention_mask": np.ones((b, t), np.int32)}
  batch["labels"] = batch["input_ids"].copy()
  batch["labels"][:, : t // 2] = -100  # the prompt
  graphdef, state = nnx.split(model)
  step = jax.jit(lambda state, batch: lora_step(nnx.merge(graphdef, state), batch))
  start = time.perf_counter()
  compiled = step.lower(state, batch).compile()
  compile_s = time.perf_counter() - start
  cost = compiled.cost_analysis() or {}
  cost = cost[0] if isinstance(cost, list) else cost
  jax.block_until_ready(compiled(state, batch))
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    jax.block_until_ready(compiled(state, batch))
    times.append(time.perf_counter() - start)
  return compile_s, statistics.median(times), min(times), cost


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="smollm2-135m-instruct")
  parser.add_argument("--shapes", nargs="+", default=["8x128", "4x512"])
  parser.add_argument("--attention", nargs="+", default=["xla", "dense"])
  parser.add_argument("--dtype", nargs="+", default=["float32"])
  parser.add_argument("--remat", nargs="+", default=["none"])
  parser.add_argument("--steps", type=int, default=3)
  args = parser.parse_args()
  base = load_causal_lm(args.model)
  tensors = hf_weights.to_hf_state_dict(base)
  for dtype in args.dtype:
    for attention in args.attention:
      for remat in args.remat:
        model = hf_weights.from_hf_state_dict(base.config, tensors, dtype=dtype, attention=attention,
                                              remat=None if remat == "none" else remat)
        lora.apply_lora(model, r=8, alpha=16, target_modules=("q_proj", "v_proj"))
        for shape in args.shapes:
          b, t = map(int, shape.split("x"))
          compile_s, step_s, min_s, cost = measure(model, b, t, args.steps)
          print(json.dumps({"model": args.model, "dtype": dtype, "attention": attention, "remat": remat,
                            "batch": b, "seq": t, "compile_s": round(compile_s, 2),
                            "step_s": round(step_s, 3), "step_min_s": round(min_s, 3),
                            "xla_gflops": round(cost.get("flops", 0) / 1e9, 2),
                            "xla_gb_accessed": round(cost.get("bytes accessed", 0) / 1e9, 3),
                            "load_average": round(os.getloadavg()[0], 2), "backend": jax.default_backend(),
                            "cpus": os.cpu_count(), "machine": platform.machine()}), flush=True)


if __name__ == "__main__":
  main()
