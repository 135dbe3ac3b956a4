"""How many calls the warm-up's step timing needs: each call's seconds, shape after shape, in fresh
processes.

    python -m benchmarks.time_step_calls [--model smollm2-135m] [--shapes 16x64 8x120 3x312 2x504]
        [--calls 3] [--reps 3] [--suffix _NAME]

A run that fits its collation cost (`data.time_shapes`, and `auto`'s probes) times its compiled
shapes before step 1 (`jaxsft.collation.probe.fit_from_steps`), narrowest first, then the widest
once more with every label trained. Here the trainer's step (`benchmarks.common.JaxsftStep`, float32,
LoRA r 8 on q/v, random weights of the model's real configuration) compiles `--shapes` (default:
the default run's four) and each is called `--calls` times in a row, in that order, in each of
`--reps` fresh processes. The table gives every call's seconds and the first call over the least
of the later ones: where the first call costs what the later ones do, one call times a shape.

Writes benchmarks/results/time_step_calls{suffix}.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from benchmarks import common


def worker(model_name: str, shapes: list[tuple[int, int]], calls: int) -> dict:
  from jaxsft.models import init_random

  runner = common.JaxsftStep(init_random(common.random_model_config(model_name), dtype="float32"), common.train_config())
  keys = ("input_ids", "attention_mask", "labels")
  runner.warm_up(shapes)
  order = [(shape, False) for shape in sorted(shapes, key=lambda s: (s[1], s[0]))]
  order.append((order[-1][0], True))  # the widest again, every label trained
  rows = []
  for shape, trained in order:
    seconds = [runner.steps.time_step(shape, keys, fused=True, trained=trained, calls=1) for _ in range(calls)]
    rows.append({"shape": f"{shape[0]}x{shape[1]}", "trained": trained, "seconds": seconds})
  return {"rows": rows}


def markdown(result: dict) -> str:
  calls = result["calls"]
  lines = [f"# The warm-up's step timing, call by call ({result['model']}, float32)", "",
           f"`{result['command']}`", "", f"Machine: {common.machine_line(result['machine'])}.", "",
           f"Each fresh process compiles the shapes, then calls each {calls} times in a row, in the order "
           "a run times them (narrowest first; \"trained\": the widest again with every label trained).", "",
           "| process | shape | " + " | ".join(f"call {i + 1} s" for i in range(calls)) +
           " | call 1 / least later |", "| --- | --- | " + " | ".join("---:" for _ in range(calls)) + " | ---: |"]
  for rep, run in enumerate(result["runs"], 1):
    for row in run["rows"]:
      s = row["seconds"]
      name = row["shape"] + (" trained" if row["trained"] else "")
      lines.append(f"| {rep} | {name} | " + " | ".join(f"{x:.3f}" for x in s) + f" | {s[0] / min(s[1:]):.2f} |")
  firsts = [run["rows"][0]["seconds"] for run in result["runs"]]
  later = [row["seconds"] for run in result["runs"] for row in run["rows"][1:]]
  lines += ["", f"The process's first shape: call 1 / least later, median "
            f"{statistics.median(s[0] / min(s[1:]) for s in firsts):.2f}; every later shape: median "
            f"{statistics.median(s[0] / min(s[1:]) for s in later):.2f} (range "
            f"{min(s[0] / min(s[1:]) for s in later):.2f}–{max(s[0] / min(s[1:]) for s in later):.2f})."]
  return "\n".join(lines) + "\n"


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="smollm2-135m", help="a random-weight model name (benchmarks.common)")
  parser.add_argument("--shapes", nargs="+", default=["16x64", "8x120", "3x312", "2x504"], help="B x T")
  parser.add_argument("--calls", type=int, default=3)
  parser.add_argument("--reps", type=int, default=3, help="fresh processes")
  parser.add_argument("--suffix", default="", help="appended to the result files' name")
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  shapes = [tuple(int(x) for x in text.split("x")) for text in args.shapes]
  if args.worker:
    from jaxsft import host_memory

    host_memory.reexec_with_huge_pages()  # the step's memory as the `jaxsft` command line sets it
    print(json.dumps(worker(args.model, shapes, args.calls)), flush=True)
    return
  if args.calls < 2:
    parser.error("--calls must be at least 2: the first call is compared with the later ones")
  command = (f"python -m benchmarks.time_step_calls --model {args.model} --shapes {' '.join(args.shapes)} "
             f"--calls {args.calls} --reps {args.reps}" + (f" --suffix {args.suffix}" if args.suffix else ""))
  result = {"model": args.model, "calls": args.calls, "machine": common.machine_info(), "command": command, "runs": []}
  for _ in range(args.reps):
    out = subprocess.run([sys.executable, "-m", "benchmarks.time_step_calls", "--worker", "--model", args.model,
                          "--calls", str(args.calls), "--shapes", *args.shapes], capture_output=True, text=True,
                         check=True, cwd=common.ROOT)
    result["runs"].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(markdown(result), flush=True)
  common.write_results(f"time_step_calls{args.suffix}", result, markdown(result))


if __name__ == "__main__":
  main()
