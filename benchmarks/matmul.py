"""The float32 matmul kernels under the train step: XLA's (jax.jit) against PyTorch's.

    python -m benchmarks.matmul [--threads 2] [--calls 30] [--reps 2] [--suffix _1thread]

One (tokens, in) x (in, out) product at the real SmolLM2 MLP shape (1024 x 576 x 1536) and its
backward dX = dY W^T, each framework in its own fresh process, alternated `--reps` times;
median of `--calls` calls after two warm-up calls. PyTorch runs with `--threads` threads; XLA
with `--threads` cores (`taskset`; all cores when the machine has no more). Writes
benchmarks/results/matmul{suffix}.{json,md}.
"""

from __future__ import annotations

import json

from benchmarks import common

M, K, N = 1024, 576, 1536


def worker(framework: str, threads: int, calls: int) -> dict:
  import numpy as np

  rng = np.random.default_rng(0)
  x = rng.standard_normal((M, K), np.float32)
  w = rng.standard_normal((K, N), np.float32)
  dy = rng.standard_normal((M, N), np.float32)

  if framework == "torch":
    import torch

    torch.set_num_threads(threads)
    tx, tw, tdy = torch.from_numpy(x), torch.from_numpy(np.ascontiguousarray(w.T)), torch.from_numpy(dy)
    forward = common.median_call_seconds(lambda: torch.nn.functional.linear(tx, tw), calls)
    backward = common.median_call_seconds(lambda: tdy @ tw, calls)
  else:
    import jax
    import jax.numpy as jnp

    jx, jw, jdy = jnp.asarray(x), jnp.asarray(w), jnp.asarray(dy)
    fwd, bwd = jax.jit(lambda a, b: a @ b), jax.jit(lambda d, b: d @ b.T)
    forward = common.median_call_seconds(lambda: fwd(jx, jw).block_until_ready(), calls)
    backward = common.median_call_seconds(lambda: bwd(jdy, jw).block_until_ready(), calls)
  gflop = 2 * M * K * N / 1e9
  return {"forward_gflops": gflop / forward, "backward_gflops": gflop / backward}


def main(argv=None):
  parser = common.kernel_benchmark_parser(__doc__, calls=30)
  args = parser.parse_args(argv)
  if args.worker:
    print(json.dumps(worker(args.worker, args.threads, args.calls)))
    return

  runs = common.alternate_workers("benchmarks.matmul", ("jax", "torch"),
                                  ["--threads", str(args.threads), "--calls", str(args.calls)],
                                  reps=args.reps, threads=args.threads)

  info = common.machine_info()
  rows = []
  for framework, reps in runs.items():
    fwd = common.median([r["forward_gflops"] for r in reps])
    bwd = common.median([r["backward_gflops"] for r in reps])
    loads = ", ".join(f"{r['load_at_start']:.1f}" for r in reps)
    rows.append(f"| {framework} | {fwd:.0f} | {bwd:.0f} | {loads} |")
  command = f"python -m benchmarks.matmul --threads {args.threads} --calls {args.calls} --reps {args.reps}"
  command += f" --suffix {args.suffix}" if args.suffix else ""
  markdown = "\n".join([
      "# float32 matmul kernels: XLA against PyTorch", "", f"`{command}`", "",
      f"Machine: {common.machine_line(info)}; {args.threads} thread(s) each.", "",
      f"One {M}x{K} · {K}x{N} product (forward, y = x W) and its backward dX = dY Wᵀ; fresh processes "
      f"alternated {args.reps} times, median of {args.calls} calls each, then the median over repetitions.", "",
      "| framework | forward GFLOP/s | backward dX GFLOP/s | load at start |",
      "| --- | ---: | ---: | --- |", *rows, ""])
  common.write_results(f"matmul{args.suffix}", {"command": command, "machine": info, "threads": args.threads, "runs": runs},
                       markdown)
  print(markdown)


if __name__ == "__main__":
  main()
