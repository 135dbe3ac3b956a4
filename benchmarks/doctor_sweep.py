"""The doctor's verdicts on real short runs: one model and data set trained by `jaxsft.train` at
several learning rates, each run read by `jaxsft.doctor`.

    python -m benchmarks.doctor_sweep --steps 8 --lrs 1e-7 1e-4 3e-4 1e-3 3e-3 0.01 0.03 0.1 0.3
    python -m benchmarks.doctor_sweep --steps 24 --eval-every 12 --lrs 1e-6 1e-5 1e-4 1e-3 1e-2 \
        --suffix _24_steps_validated

By default the settings of `tests/test_real_runs.py`'s doctor test: SmolLM2-135M-Instruct on the
built-in task set, 192 tokens a batch (~10 trained tokens), 4 validation examples, no warmup,
cosine decay; with XLA's default flags (the tests' differ, so losses differ in the last digits from
a test's). Not a timing:
each row is a run's verdict, its summary, and the losses, gradient norms and validation losses it
came from (`benchmarks/results/doctor_sweep<suffix>.{json,md}`); the doctor's calibration notes
quote these runs. Every run sees the same batches in the same order (the default seed).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

from benchmarks import common

SETTINGS = ["data.synthetic_size=240", "data.max_length=256", "data.num_buckets=2", "data.max_val_examples=4",
            "eval.generate=false", "--no-progress", "save_every=0", "data.time_shapes=false",
            "optim.warmup_steps=0"]


def sweep_one(out: pathlib.Path, lr: str, args) -> dict:
  """Train one run into `out` and diagnose it: the row of the results."""
  from jaxsft import doctor, run_files
  from jaxsft.train import main as train_main

  argv = ["--output-dir", str(out), *SETTINGS, "--lr", lr, f"max_steps={args.steps}",
          f"data.tokens_per_batch={args.tokens_per_batch}", f"eval.eval_every={args.eval_every}"]
  argv += ["--model", args.model] if args.model else []
  argv += ["--data", args.data] if args.data else []
  start = time.time()
  code = train_main(argv)
  if code != 0:
    return {"lr": lr, "status": f"the run exited with {code}"}
  diagnosis = doctor.diagnose_run(out)
  m = run_files.read_metrics(out)
  return {"lr": lr, "status": "ok", "seconds": round(time.time() - start, 1), "pattern": diagnosis.pattern,
          "summary": diagnosis.summary, "likely_cause": diagnosis.likely_cause, "evidence": diagnosis.evidence,
          "loss": [round(x, 4) for x in m.train_loss], "grad_norm": [round(x, 3) for x in m.train_grad_norm],
          "validation": [[s, round(v, 4)] for s, v in zip(m.val_steps, m.val_loss)]}


def markdown(rows: list[dict], command: str, info: dict, args) -> str:
  lines = ["# The doctor on real short runs", "", f"`{command}`", "",
           f"Machine: {common.machine_line(info)}. Model {args.model or common.REAL_MODEL}, data "
           f"{args.data or common.BUILTIN}, {args.steps} steps of {args.tokens_per_batch} tokens, validation "
           + (f"before step 1, every {args.eval_every} steps and at the end." if args.eval_every else
              "at the end only.") + " Losses rounded to 3 digits.", "",
           "| lr | verdict | summary | losses | validation |", "| --- | --- | --- | --- | --- |"]
  for r in rows:
    if r["status"] != "ok":
      lines.append(f"| {r['lr']} | – | {r['status']} | – | – |")
      continue
    losses = ", ".join(f"{x:.3g}" for x in r["loss"])
    val = ", ".join(f"{s}: {v:.4g}" for s, v in r["validation"])
    lines.append(f"| {r['lr']} | **{r['pattern']}** | {r['summary']} | {losses} | {val} |")
  return "\n".join(lines + [""])


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.doctor_sweep", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--lrs", nargs="+", required=True, help="learning rates, one run each")
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument("--eval-every", type=int, default=0, help="0: validation at the end only")
  parser.add_argument("--tokens-per-batch", type=int, default=192)
  parser.add_argument("--model", help=f"a model name or folder (default: {common.REAL_MODEL})")
  parser.add_argument("--data", help="a data file (default: the built-in task set)")
  parser.add_argument("--suffix", default="")
  parser.add_argument("--results-dir", default=str(common.RESULTS))
  args = parser.parse_args(argv)

  info = common.machine_info()
  rows = []
  with tempfile.TemporaryDirectory(prefix="doctor-sweep-") as tmp:
    for lr in args.lrs:
      rows.append(row := sweep_one(pathlib.Path(tmp) / f"lr-{lr}", lr, args))
      print(f"lr {lr}: {row.get('pattern', row['status'])} | {row.get('summary', '')}", flush=True)
  command = "python -m benchmarks.doctor_sweep " + " ".join(sys.argv[1:] if argv is None else argv)
  common.write_results(f"doctor_sweep{args.suffix}", {"command": command, "machine": info, "steps": args.steps,
                                                       "eval_every": args.eval_every, "runs": rows},
                       markdown(rows, command, info, args), results_dir=pathlib.Path(args.results_dir))
  return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
