"""A 16-bit train step on a CPU with its frozen base packed once (as the trainer holds it) against
packed inside every step: seconds per step, interleaved in one process.

    python -m benchmarks.frozen_packing [--model smollm2-135m] [--dtype bfloat16]
        [--shapes 8x128 4x512] [--steps 12] [--suffix _NAME]

On a CPU the decoder slices its 16-bit layer stacks as float32 words (`jaxsft.models.stack16`);
packing them is a pass over the whole stack. The trainer packs the frozen base once, at setup
(`decoder.with_layers_packed`); "every step" hands the steps the base as loaded, so each compiled
step packs it itself. Both steps are the trainer's (`benchmarks.common.JaxsftStep`, LoRA r 8 on
q/v, AdamW) on random weights of the model's real configuration and the same batch (the first
half of each row an untrained prompt), compiled ahead; after one untimed step each, they run
alternately, `--steps` times each. The table gives each one's median and fastest step, the ratio
of the medians, and the largest difference between their losses (the same math: 0).

Writes benchmarks/results/frozen_packing{suffix}.json and .md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from benchmarks import common

VARIANTS = ("once", "every step")


def measure(model_name: str, dtype: str, shape: tuple[int, int], steps: int) -> dict:
  from jaxsft.models import init_random

  b, t = shape
  runners = {}
  for variant in VARIANTS:
    model = init_random(common.random_model_config(model_name), dtype=dtype)
    runners[variant] = common.JaxsftStep(model, common.train_config(), pack_frozen=variant == "once")
    runners[variant].warm_up([shape])
  rng = np.random.default_rng(0)
  batch = {"input_ids": rng.integers(3, common.random_model_config(model_name).vocab_size, (b, t)).astype(np.int32),
           "attention_mask": np.ones((b, t), np.int32)}
  batch["labels"] = batch["input_ids"].copy()
  batch["labels"][:, : t // 2] = -100
  seconds = {v: [] for v in VARIANTS}
  losses = {v: [] for v in VARIANTS}
  for i in range(steps + 1):
    for variant, runner in runners.items():
      t0 = time.perf_counter()
      loss = runner.step(batch)
      if i:  # the first call of an executable pays one-off costs
        seconds[variant].append(time.perf_counter() - t0)
        losses[variant].append(loss)
  medians = {v: statistics.median(seconds[v]) for v in VARIANTS}
  return {"shape": f"{b}x{t}", "seconds": seconds, "median_s": medians, "min_s": {v: min(seconds[v]) for v in VARIANTS},
          "every_step_over_once": medians["every step"] / medians["once"],
          "max_loss_difference": max(abs(a - b) for a, b in zip(losses["once"], losses["every step"]))}


def markdown(result: dict) -> str:
  lines = [f"# A {result['dtype']} step with its frozen base packed once against in every step ({result['model']})", "",
           f"`{result['command']}`", "", f"Machine: {common.machine_line(result['machine'])}.", "",
           f"Interleaved in one process, {result['steps']} steps each after one untimed step.", "",
           "| shape | packed once: median s (min) | packed in every step: median s (min) | every step / once | "
           "largest loss difference |", "| --- | ---: | ---: | ---: | ---: |"]
  for row in result["rows"]:
    lines.append(f"| {row['shape']} | {row['median_s']['once']:.3f} ({row['min_s']['once']:.3f}) | "
                 f"{row['median_s']['every step']:.3f} ({row['min_s']['every step']:.3f}) | "
                 f"{row['every_step_over_once']:.3f} | {row['max_loss_difference']:.2g} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> None:
  from jaxsft import host_memory

  host_memory.reexec_with_huge_pages()  # the step's memory as the `jaxsft` command line sets it
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="smollm2-135m", help="a random-weight model name (benchmarks.common)")
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
  parser.add_argument("--shapes", nargs="+", default=["8x128", "4x512"], help="B x T (default: %(default)s)")
  parser.add_argument("--steps", type=int, default=12, help="timed steps of each (default: %(default)s)")
  parser.add_argument("--suffix", default="", help="appended to the result files' name")
  args = parser.parse_args(argv)
  command = (f"python -m benchmarks.frozen_packing --model {args.model} --dtype {args.dtype} --shapes "
             f"{' '.join(args.shapes)} --steps {args.steps}" + (f" --suffix {args.suffix}" if args.suffix else ""))
  result = {"model": args.model, "dtype": args.dtype, "steps": args.steps, "machine": common.machine_info(),
            "command": command, "rows": []}
  for text in args.shapes:
    shape = tuple(int(x) for x in text.split("x"))
    result["rows"].append(measure(args.model, args.dtype, shape, args.steps))
    print(markdown(result), flush=True)
  common.write_results(f"frozen_packing{args.suffix}", result, markdown(result))


if __name__ == "__main__":
  main()
