"""The matmul kernels under the train step: XLA's (jax.jit) against PyTorch's, float32 or bfloat16.

    python -m benchmarks.matmul [--dtype bfloat16] [--threads 2] [--calls 30] [--reps 2] [--suffix _1thread]

One (tokens, in) x (in, out) product at the real SmolLM2 MLP shape (1024 x 576 x 1536) and its
backward dX = dY W^T, each framework in its own fresh process, alternated `--reps` times;
median of `--calls` calls after two warm-up calls. PyTorch runs with `--threads` threads; XLA
with `--threads` cores (`taskset`; all cores when the machine has no more). On the JAX side the
products are the model's own (`jaxsft.matmul`: in bfloat16 on a CPU, float32-accumulating
products that XLA hands to its library kernels); a bfloat16 row also gives XLA's plain
`x @ w` in bfloat16, which XLA converts to float32. Writes
benchmarks/results/matmul{suffix}.{json,md}.
"""

from __future__ import annotations

import json

from benchmarks import common

M, K, N = 1024, 576, 1536


def worker(framework: str, threads: int, calls: int, dtype: str = "float32") -> dict:
  import numpy as np

  rng = np.random.default_rng(0)
  x = rng.standard_normal((M, K), np.float32)
  w = rng.standard_normal((K, N), np.float32)
  dy = rng.standard_normal((M, N), np.float32)
  gflop = 2 * M * K * N / 1e9

  if framework == "torch":
    import torch

    torch.set_num_threads(threads)
    to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(getattr(torch, dtype))  # noqa: E731
    tx, tw, tdy = to(x), to(w.T), to(dy)
    forward = common.median_call_seconds(lambda: torch.nn.functional.linear(tx, tw), calls)
    backward = common.median_call_seconds(lambda: tdy @ tw, calls)
    return {"forward_gflops": gflop / forward, "backward_gflops": gflop / backward}

  import jax
  import jax.numpy as jnp

  from jaxsft import matmul as matmul_lib

  # (tokens, in) activations as the model holds them, (B, T, in): the leading axis is part of the form
  jx, jw, jdy = (jnp.asarray(a, dtype) for a in (x.reshape(8, M // 8, K), w, dy.reshape(8, M // 8, N)))
  fwd = jax.jit(matmul_lib.matmul)
  bwd = jax.jit(lambda d, b: jax.vjp(lambda x: matmul_lib.matmul(x, b), jnp.zeros_like(jx))[1](d)[0])
  forward = common.median_call_seconds(lambda: fwd(jx, jw).block_until_ready(), calls)
  backward = common.median_call_seconds(lambda: bwd(jdy, jw).block_until_ready(), calls)
  out = {"forward_gflops": gflop / forward, "backward_gflops": gflop / backward,
         "path": matmul_lib.cpu_matmul_path(dtype)}
  if dtype != "float32":  # what a plain 16-bit product gets from XLA
    plain = jax.jit(lambda a, b: a @ b)
    out["plain_forward_gflops"] = gflop / common.median_call_seconds(lambda: plain(jx, jw).block_until_ready(), calls)
  return out


def main(argv=None):
  parser = common.kernel_benchmark_parser(__doc__, calls=30)
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  args = parser.parse_args(argv)
  if args.worker:
    print(json.dumps(worker(args.worker, args.threads, args.calls, args.dtype)))
    return

  runs = common.alternate_workers("benchmarks.matmul", ("jax", "torch"),
                                  ["--threads", str(args.threads), "--calls", str(args.calls), "--dtype", args.dtype],
                                  reps=args.reps, threads=args.threads)

  info = common.machine_info()
  rows = []
  for framework, reps in runs.items():
    fwd = common.median([r["forward_gflops"] for r in reps])
    bwd = common.median([r["backward_gflops"] for r in reps])
    loads = ", ".join(f"{r['load_at_start']:.1f}" for r in reps)
    rows.append(f"| {framework} | {fwd:.0f} | {bwd:.0f} | {loads} |")
    plain = common.median([r.get("plain_forward_gflops") for r in reps])
    if plain:
      rows.append(f"| {framework}, plain `x @ w` | {plain:.0f} | | |")
  command = f"python -m benchmarks.matmul --dtype {args.dtype} --threads {args.threads} --calls {args.calls} --reps {args.reps}"
  command += f" --suffix {args.suffix}" if args.suffix else ""
  path = next((r.get("path") for r in runs.get("jax", []) if r.get("path")), None)
  markdown = "\n".join([
      f"# {args.dtype} matmul kernels: XLA against PyTorch", "", f"`{command}`", "",
      f"Machine: {common.machine_line(info)}; {args.threads} thread(s) each.", "",
      f"One {M}x{K} · {K}x{N} product (forward, y = x W) and its backward dX = dY Wᵀ in {args.dtype}; fresh processes "
      f"alternated {args.reps} times, median of {args.calls} calls each, then the median over repetitions.", "",
      *([f"JAX side: jaxsft's products (`jaxsft.matmul`): {path}.", ""] if path else []),
      "| framework | forward GFLOP/s | backward dX GFLOP/s | load at start |",
      "| --- | ---: | ---: | --- |", *rows, ""])
  common.write_results(f"matmul{args.suffix}", {"command": command, "machine": info, "threads": args.threads,
                                                "dtype": args.dtype, "runs": runs}, markdown)
  print(markdown)


if __name__ == "__main__":
  main()
