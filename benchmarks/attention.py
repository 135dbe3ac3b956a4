"""One layer's causal self-attention, forward and backward: jaxsft's against PyTorch's SDPA.

    python -m benchmarks.attention [--shapes 8x128 4x512] [--threads 2] [--calls 20] [--reps 2]

The real SmolLM2 attention shape (9 query heads sharing 3 key/value heads, head size 64),
float32, random q/k/v: jaxsft's `causal_block_attention` under `jax.jit` with the causal mask
the train step builds (`attention_mask_4d`), against `torch.nn.functional.scaled_dot_product_attention`
(`is_causal`, grouped heads: what transformers' "sdpa" attention runs for an unpadded batch).
"forward" is the output alone; "forward + backward" is the gradient of Σ out·w with respect to
q, k and v. Each framework runs in its own fresh process, alternated `--reps` times; median of
`--calls` calls after two warm-up calls. Writes benchmarks/results/attention{suffix}.{json,md}.
"""

from __future__ import annotations

import json

from benchmarks import common

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def worker(framework: str, shapes: list[tuple[int, int]], threads: int, calls: int) -> dict:
  import numpy as np

  results = {}
  for batch, length in shapes:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((batch, length, HEADS, HEAD_DIM), np.float32)
    k, v = (rng.standard_normal((batch, length, KV_HEADS, HEAD_DIM), np.float32) for _ in range(2))
    w = rng.standard_normal(q.shape, np.float32)
    scale = HEAD_DIM ** -0.5
    if framework == "torch":
      import torch
      import torch.nn.functional as F

      torch.set_num_threads(threads)
      tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(a.transpose(0, 2, 1, 3))).requires_grad_()
                    for a in (q, k, v))
      tw = torch.from_numpy(np.ascontiguousarray(w.transpose(0, 2, 1, 3)))
      attend = lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=True, scale=scale,  # noqa: E731
                                                      enable_gqa=True)

      def forward():
        with torch.no_grad():
          attend()

      def forward_backward():
        torch.autograd.grad((attend() * tw).sum(), (tq, tk, tv))
    else:
      import jax
      import jax.numpy as jnp

      from jaxsft.models.attention import attention_mask_4d, causal_block_attention

      jq, jk, jv, jw = (jnp.asarray(a) for a in (q, k, v, w))
      mask = attention_mask_4d(batch, length, jnp.ones((batch, length), jnp.int32), None, None)
      attend = lambda q, k, v: causal_block_attention(q, k, v, mask, scale, block=None,  # noqa: E731
                                                            sliding_window=None)
      fwd = jax.jit(attend)
      grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v) * jw), argnums=(0, 1, 2)))

      def forward():
        fwd(jq, jk, jv).block_until_ready()

      def forward_backward():
        jax.block_until_ready(grad(jq, jk, jv))
    results[f"{batch}x{length}"] = {"forward_ms": 1e3 * common.median_call_seconds(forward, calls),
                                    "forward_backward_ms": 1e3 * common.median_call_seconds(forward_backward, calls)}
  return results


def main(argv=None):
  parser = common.kernel_benchmark_parser(__doc__, calls=20)
  parser.add_argument("--shapes", nargs="+", default=["8x128", "4x512"], help="BATCHxLENGTH")
  args = parser.parse_args(argv)
  shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
  if args.worker:
    print(json.dumps(worker(args.worker, shapes, args.threads, args.calls)))
    return

  runs = common.alternate_workers("benchmarks.attention", ("jax", "torch"),
                                  ["--threads", str(args.threads), "--calls", str(args.calls),
                                   "--shapes", *args.shapes], reps=args.reps, threads=args.threads)
  info = common.machine_info()
  rows = []
  for shape in args.shapes:
    cell = {f: {m: common.median([r[shape][m] for r in runs[f]]) for m in ("forward_ms", "forward_backward_ms")}
            for f in runs}
    jax_ms, torch_ms = cell["jax"], cell["torch"]
    rows.append(f"| {shape} | {jax_ms['forward_ms']:.2f} | {torch_ms['forward_ms']:.2f} | "
                f"{jax_ms['forward_backward_ms']:.2f} | {torch_ms['forward_backward_ms']:.2f} | "
                f"{torch_ms['forward_backward_ms'] / jax_ms['forward_backward_ms']:.2f}x |")
  loads = ", ".join(f"{f} {r['load_at_start']:.1f}" for f in runs for r in runs[f])
  command = f"python -m benchmarks.attention --shapes {' '.join(args.shapes)} --threads {args.threads} " \
            f"--calls {args.calls} --reps {args.reps}" + (f" --suffix {args.suffix}" if args.suffix else "")
  markdown = "\n".join([
      "# Causal self-attention of one layer: jaxsft against PyTorch SDPA", "", f"`{command}`", "",
      f"Machine: {common.machine_line(info)}; {args.threads} thread(s) each; load at each run's start: {loads}.", "",
      f"{HEADS} query heads, {KV_HEADS} key/value heads, head size {HEAD_DIM}, float32; fresh processes "
      f"alternated {args.reps} times, median of {args.calls} calls each, then the median over repetitions. "
      "The train step runs this once per layer (30 layers in SmolLM2); its backward pass keeps the "
      "attention's output and row statistics from the forward (`ATTENTION_RESIDUALS`) and recomputes "
      "only the scores.", "",
      "| B x T | jaxsft forward ms | PyTorch forward ms | jaxsft fwd + bwd ms | PyTorch fwd + bwd ms | "
      "jaxsft speed (PyTorch = 1) |",
      "| --- | ---: | ---: | ---: | ---: | ---: |", *rows, ""])
  common.write_results(f"attention{args.suffix}", {"command": command, "machine": info, "threads": args.threads,
                                                   "runs": runs}, markdown)
  print(markdown)


if __name__ == "__main__":
  main()
