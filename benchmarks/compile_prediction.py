"""Compile cost, predicted against measured, with a cold and a warm persistent cache, on this CPU.

    .venv/bin/python -m benchmarks.compile_prediction [--model smollm2-135m-instruct] [--steps 10]
        [--calibrate ../shared/data/code_alpaca_2k.json] [--heldout ../shared/data/alpaca_en_demo.json]
        [--suffix _amd]

The runs are `python -m jaxsft.train` with `batching: auto`. Each run is a fresh process, and all
three share one fresh jaxsft cache, which holds the compile calibration:

  1. calibrate     on `--calibrate`, with an empty persistent compilation cache A: its compiles
                   are this machine's calibration;
  2. held-out cold on `--heldout`, with an empty persistent cache B: every program compiles;
  3. held-out warm the same run again, with cache B now holding its programs.

For each run the benchmark reports, from the run's summary.json: the predicted and measured
seconds of compiles and of steps and their ratios; the cache state predicted and the state that
happened; and the compiled programs. Measured compiles are the sum of trace, lowering and backend
seconds over every program the run built, from JAX's events (jaxsft.collation.compiles). The target is a
predicted/measured compile ratio within 0.75 to 1.33 for the held-out runs, cold and warm, on every
CPU. Seconds are wall-clock: on a shared machine others' work inflates them.

Writes benchmarks/results/compile_prediction{suffix}.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from benchmarks.common import machine_info, machine_line, write_results

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
TARGET_COMPILE_RATIO = (0.75, 1.33)
"""Predicted over measured compile seconds, held-out runs, cold cache and warm."""
TARGET_STEPS_WITHIN = 0.15
"""Predicted step seconds within this fraction of the measured ones."""


def train(args, data: pathlib.Path, out: pathlib.Path, xla_cache: pathlib.Path, jaxsft_cache: pathlib.Path) -> dict:
  """One run in a fresh process: its summary's collation, and the run's wall seconds."""
  env = dict(os.environ, HF_HUB_OFFLINE="1", JAX_COMPILATION_CACHE_DIR=str(xla_cache), JAXSFT_CACHE=str(jaxsft_cache))
  cmd = [sys.executable, "-m", "jaxsft.train", "--model", args.model, "--data", str(data), "data.batching=auto",
         f"max_steps={args.steps}", f"data.max_length={args.max_length}", f"data.tokens_per_batch={args.tokens_per_batch}",
         "data.on_error=skip", f"eval.num_prompts={args.num_prompts}", "--output-dir", str(out), "--quiet",
         "--no-progress"]
  t0 = time.time()
  r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
  if r.returncode != 0:
    raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
  from jaxsft.run_files import RunFiles

  collation = json.loads(RunFiles(out, writer=False).summary.read_text())["collation"]
  return {"collation": collation, "wall_seconds": round(time.time() - t0, 1)}


def row(name: str, data: pathlib.Path, run: dict) -> dict:
  c = run["collation"]
  predicted, measured = c["predicted_seconds"], c["measured_seconds"]
  return {"run": name, "data": data.name, "choice": c["choice"],
          "cache_predicted": c["cache"]["predicted"], "cache_measured": c["cache"]["measured"],
          "compiles_predicted": predicted["compiles"], "compiles_measured": measured["compiles"],
          "compiles_ratio": round(predicted["compiles"] / measured["compiles"], 3) if measured["compiles"] else None,
          "steps_predicted": predicted["steps"], "steps_measured": measured["steps"],
          "steps_ratio": round(predicted["steps"] / measured["steps"], 3) if measured["steps"] else None,
          "programs_predicted": c["compiles"]["predicted"]["programs"],
          "programs_measured": c["compiles"]["measured"]["programs"],
          "phases_measured": c["compiles"]["measured"]["phases"], "prices": c["compiles"]["predicted"]["prices"],
          "wall_seconds": run["wall_seconds"]}


def markdown(result: dict) -> str:
  lines = ["# Compile cost: predicted against measured, cold and warm persistent cache", "",
           f"Machine: {machine_line(result['machine'])}", "",
           f"Model {result['model']}, `batching: auto`, {result['steps']} steps, max_length {result['max_length']}, "
           f"tokens_per_batch {result['tokens_per_batch']}. Command: `{result['command']}`", "",
           "| run | data | choice | cache predicted / measured | compiles predicted / measured s (ratio) "
           "| steps predicted / measured s (ratio) |", "| --- | --- | --- | --- | --- | --- |"]
  for r in result["rows"]:
    lines.append(f"| {r['run']} | {r['data']} | {r['choice']} | {r['cache_predicted']} / {r['cache_measured']} "
                 f"| {r['compiles_predicted']:.1f} / {r['compiles_measured']:.1f} ({r['compiles_ratio']}) "
                 f"| {r['steps_predicted']:.1f} / {r['steps_measured']:.1f} ({r['steps_ratio']}) |")
  low, high = TARGET_COMPILE_RATIO
  lines += ["", f"Target: compile ratio within {low}–{high} on the held-out runs, cold and warm; steps within "
            f"{TARGET_STEPS_WITHIN:.0%}.",
            "Seconds are wall-clock; see the load average above.", ""]
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="smollm2-135m-instruct")
  parser.add_argument("--calibrate", type=pathlib.Path, default=SHARED / "code_alpaca_2k.json")
  parser.add_argument("--heldout", type=pathlib.Path, default=SHARED / "alpaca_en_demo.json")
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--max-length", type=int, default=512)
  parser.add_argument("--tokens-per-batch", type=int, default=2048)
  parser.add_argument("--num-prompts", type=int, default=8)
  parser.add_argument("--suffix", default="")
  args = parser.parse_args(argv)
  info = machine_info()
  with tempfile.TemporaryDirectory(prefix="jaxsft-compile-prediction-") as work:
    work = pathlib.Path(work)
    runs = [("calibrate", args.calibrate, "xla_a"), ("held-out cold", args.heldout, "xla_b"),
            ("held-out warm", args.heldout, "xla_b")]
    rows = []
    for i, (name, data, xla) in enumerate(runs):
      rows.append(row(name, data, train(args, data, work / f"run{i}", work / xla, work / "jaxsft")))
      print(json.dumps({k: rows[-1][k] for k in ("run", "cache_predicted", "cache_measured", "compiles_ratio",
                                                  "steps_ratio")}), flush=True)
  result = {"machine": info, "model": args.model, "steps": args.steps, "max_length": args.max_length,
            "tokens_per_batch": args.tokens_per_batch, "command": " ".join(["python -m benchmarks.compile_prediction",
                                                                             *(argv or sys.argv[1:])]),
            "rows": rows}
  write_results(f"compile_prediction{args.suffix}", result, markdown(result))
  return 0


if __name__ == "__main__":
  sys.exit(main())
