"""Peak memory of the loss + its gradient: plain (full logits) vs chunked cross-entropy.

  python benchmarks/chunked_loss_memory.py [--batch 8 --seq 2048 --vocab 49152 --hidden 576]

The figure is XLA's own accounting of the compiled `value_and_grad` of each loss w.r.t. the
hidden states and the output embedding (`compiled.memory_analysis()`: temporaries + arguments +
outputs), so it needs no run of the 8 x 2048 x 49,152 step. `--run` also executes the chunked
one once and checks it against the plain one on a smaller batch. Writes
benchmarks/results/chunked_loss_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxsft import loss


def plain(hidden, embedding, labels):
  return loss.normalize_by_valid(*loss.cross_entropy_sum(hidden @ embedding.T, labels))


def chunked(chunk_size):
  def f(hidden, embedding, labels):
    return loss.normalize_by_valid(*loss.chunked_cross_entropy_sum(hidden, embedding, labels,
                                                                   chunk_size=chunk_size))
  return f


def memory(fn, args):
  compiled = jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).lower(*args).compile()
  m = compiled.memory_analysis()
  return {"temp_bytes": int(m.temp_size_in_bytes), "argument_bytes": int(m.argument_size_in_bytes),
          "output_bytes": int(m.output_size_in_bytes),
          "peak_bytes": int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes)}


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=2048)
  parser.add_argument("--vocab", type=int, default=49152)
  parser.add_argument("--hidden", type=int, default=576)
  parser.add_argument("--dtype", default="float32")
  parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[1024, 4096])
  parser.add_argument("--run", action="store_true", help="also check values on a 2 x 256 batch")
  parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "chunked_loss_memory.json"))
  args = parser.parse_args()

  b, t, v, h = args.batch, args.seq, args.vocab, args.hidden
  dtype = jnp.dtype(args.dtype)
  shapes = (jax.ShapeDtypeStruct((b, t, h), dtype), jax.ShapeDtypeStruct((v, h), dtype),
            jax.ShapeDtypeStruct((b, t), jnp.int32))
  result = {"batch": b, "seq": t, "vocab": v, "hidden": h, "dtype": args.dtype,
            "full_logits_bytes": b * t * v * dtype.itemsize, "backend": jax.default_backend(),
            "jax": jax.__version__, "machine": platform.machine(), "cpus": os.cpu_count()}
  result["plain"] = memory(plain, shapes)
  for c in args.chunk_sizes:
    result[f"chunked_{c}"] = memory(chunked(c), shapes)
    result[f"chunked_{c}"]["peak_vs_plain"] = round(result[f"chunked_{c}"]["peak_bytes"] /
                                                    result["plain"]["peak_bytes"], 4)

  if args.run:
    rng = np.random.default_rng(0)
    small = (jnp.asarray(rng.normal(size=(2, 256, h)), dtype), jnp.asarray(rng.normal(size=(v, h)) * 0.05, dtype),
             np.where(rng.random((2, 256)) < 0.3, -100, rng.integers(0, v, (2, 256))).astype(np.int32))
    with jax.default_matmul_precision("highest"):
      v1, g1 = jax.jit(jax.value_and_grad(plain, argnums=(0, 1)))(*small)
      start = time.perf_counter()
      v2, g2 = jax.jit(jax.value_and_grad(chunked(args.chunk_sizes[0]), argnums=(0, 1)))(*small)
      jax.block_until_ready(g2)
    result["check_2x256"] = {
        "value_rel_err": float(abs(v2 - v1) / abs(v1)),
        "grad_rel_err": max(float(jnp.abs(a - c).max() / jnp.abs(a).max()) for a, c in zip(g1, g2)),
        "chunked_seconds_incl_compile": round(time.perf_counter() - start, 2)}

  pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
  gib = 2 ** 30
  print(f"B={b} T={t} V={v} H={h} {args.dtype}: full logits {result['full_logits_bytes'] / gib:.2f} GiB")
  for key in [k for k in result if k == "plain" or k.startswith("chunked_")]:
    print(f"  {key:>14}: peak {result[key]['peak_bytes'] / gib:6.2f} GiB (temporaries {result[key]['temp_bytes'] / gib:.2f})")
  if "check_2x256" in result:
    print("  check:", result["check_2x256"])


if __name__ == "__main__":
  main()
