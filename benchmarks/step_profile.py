"""Where jaxsft's train step spends its time, op by op, from JAX's profiler.

    python -m benchmarks.step_profile [--model smollm2-135m] [--dtype bfloat16] [--shape 8x128] [--steps 2]

Compiles the trainer's fused step (`benchmarks.common.JaxsftStep`, LoRA r 8 on q/v) for one
(B, T) shape on random weights of the model's real configuration (speed does not depend on the
values), runs two steps, then traces `--steps` more with `jax.profiler.trace` and reads the
trace's per-op events. Every XLA op of the compiled program is one row: its seconds per step,
how many times a step runs it (30 for an op inside a 30-layer scan), its output shape and the
JAX operation it came from (the HLO's `op_name`). Ops are grouped into

    library products   XLA's YNNPACK/oneDNN fusions (the matmuls on the CPU's library kernels)
    other products     dots XLA emits itself
    conversions        fusions whose work is a dtype conversion (float normalization of 16-bit ops)
    everything else    elementwise fusions, copies, slices, the LM head's conditionals (whose
                       products also show as their own rows)

On a CPU XLA's thunk executor runs independent ops at once, so the rows add up to more than the
step's wall time. Writes benchmarks/results/step_profile{suffix}.{json,md}.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile
import time

import numpy as np

from benchmarks import common


def op_table(hlo_text: str) -> dict[str, tuple[str, str]]:
  """{instruction name: (output shape, op_name metadata)} of a compiled HLO module's text."""
  table = {}
  for line in hlo_text.splitlines():
    m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (\S+)", line)
    if m and m.group(1) not in table:
      op = re.search(r'op_name="([^"]+)"', line)
      table[m.group(1)] = (m.group(2), op.group(1) if op else "")
  return table


def group_of(name: str) -> str:
  """The group of an op of the compiled step, by the name XLA gave it (see the module docstring)."""
  if name.startswith(("ynn_fusion", "xnn_fusion", "onednn")):
    return "library products"
  if name.startswith(("dot", "custom-call")):
    return "other products"
  if "convert" in name:
    return "conversions"
  return "everything else"


def trace_events(trace_dir: str) -> list[dict]:
  """The complete ('X') events of the perfetto trace `jax.profiler.trace` wrote."""
  path = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]
  return [e for e in json.load(gzip.open(path))["traceEvents"] if e.get("ph") == "X"]


def profile(model_name: str, dtype: str, shape: tuple[int, int], steps: int) -> dict:
  import jax

  from jaxsft.matmul import cpu_matmul_path
  from jaxsft.models import init_random

  b, t = shape
  model = init_random(common.random_model_config(model_name), dtype=dtype)
  step = common.JaxsftStep(model, common.train_config())
  step.warm_up([shape])
  rng = np.random.default_rng(0)
  batch = {"input_ids": rng.integers(3, model.config.vocab_size, (b, t)).astype(np.int32),
           "attention_mask": np.ones((b, t), np.int32)}
  batch["labels"] = batch["input_ids"].copy()
  batch["labels"][:, : t // 2] = -100  # the first half of every row is an untrained prompt
  for _ in range(2):
    step.step(batch)
  with tempfile.TemporaryDirectory(prefix="jaxsft_step_profile_") as trace_dir:
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      t0 = time.perf_counter()
      for _ in range(steps):
        step.step(batch)
      wall = (time.perf_counter() - t0) / steps
    events = trace_events(trace_dir)
  ops = op_table(step.steps.compiled("train_step", shape).as_text())
  seconds, calls = collections.Counter(), collections.Counter()
  for e in events:
    if e["name"] in ops:
      seconds[e["name"]] += e["dur"] / 1e6 / steps
      calls[e["name"]] += 1
  rows = [{"op": name, "seconds": s, "calls": calls[name] // steps, "shape": ops[name][0], "from": ops[name][1],
           "group": group_of(name)} for name, s in seconds.most_common()]
  groups = collections.Counter()
  for r in rows:
    groups[r["group"]] += r["seconds"]
  return {"step_wall_s": wall, "rows": rows, "groups": dict(groups), "matmul_path": cpu_matmul_path(model.dtype)}


def markdown(result: dict, command: str, top: int) -> str:
  lines = [f"# jaxsft's train step, op by op ({result['model']}, {result['dtype']}, {result['shape']})", "",
           f"`{command}`", "", f"Machine: {common.machine_line(result['machine'])}.", "",
           f"Step wall time while traced: {result['step_wall_s']:.3f} s. Products: {result['matmul_path']}.", "",
           "| group | seconds per step (ops overlap) |", "| --- | ---: |",
           *[f"| {g} | {s:.3f} |" for g, s in sorted(result["groups"].items(), key=lambda kv: -kv[1])], "",
           f"The {top} costliest ops:", "",
           "| op | group | s per step | runs per step | output | from |", "| --- | --- | ---: | ---: | --- | --- |"]
  for r in result["rows"][:top]:
    lines.append(f"| {r['op']} | {r['group']} | {r['seconds']:.3f} | {r['calls']} | `{r['shape']}` | "
                 f"{r['from'][-80:]} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> None:
  from jaxsft import host_memory

  host_memory.reexec_with_huge_pages()  # the step's memory as the `jaxsft` command line sets it
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="smollm2-135m", help="a random-weight model name (benchmarks.common)")
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  parser.add_argument("--shape", default="8x128", help="B x T (default: %(default)s)")
  parser.add_argument("--steps", type=int, default=2, help="traced steps (default: %(default)s)")
  parser.add_argument("--top", type=int, default=30, help="ops listed in the markdown (default: %(default)s)")
  parser.add_argument("--suffix", default="", help="appended to the result files' name")
  args = parser.parse_args(argv)
  shape = tuple(int(x) for x in args.shape.split("x"))
  result = {"model": args.model, "dtype": args.dtype, "shape": args.shape, "machine": common.machine_info(),
            **profile(args.model, args.dtype, shape, args.steps)}
  command = (f"python -m benchmarks.step_profile --model {args.model} --dtype {args.dtype} --shape {args.shape} "
             f"--steps {args.steps}" + (f" --suffix {args.suffix}" if args.suffix else ""))
  result["command"] = command
  text = markdown(result, command, args.top)
  common.write_results(f"step_profile{args.suffix}", result, text)
  print(text)


if __name__ == "__main__":
  main()
