"""How long a command line takes to answer, in fresh processes: each command's `--help`, a value
the config refuses, and a training run up to the point where it starts reading its data.

    python -m benchmarks.cli_start [--reps 5] [--against DIR] [--suffix _NAME]

Each case is `python -m jaxsft.COMMAND ...` in a fresh interpreter, timed from start to exit; the
run's case names a data file that is not there, so it ends with its error as soon as the trainer
is set up and opens the data. `--against DIR` runs the same cases in another checkout of jaxsft
(DIR first on the path), interleaved with this one, repetition by repetition; the table gives
the median and the minimum of each. Python writes no bytecode where PYTHONDONTWRITEBYTECODE is
set (the result's machine line says so): every start then compiles jaxsft's own modules.

Writes benchmarks/results/cli_start{suffix}.json and .md.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import time

from benchmarks import common

CASES = {
    "train --help": ["jaxsft.train", "--help"],
    "train, a refused value (--lr abc)": ["jaxsft.train", "--lr", "abc"],
    "train, up to reading its data (a missing file)": ["jaxsft.train", "--data", "no/such/file.jsonl"],
    "evaluate --help": ["jaxsft.evaluate", "--help"],
    "chat --help": ["jaxsft.chat", "--help"],
    "export --help": ["jaxsft.export", "--help"],
    "data --help": ["jaxsft.data", "--help"],
    "doctor --help": ["jaxsft.doctor", "--help"],
}


def time_case(checkout: pathlib.Path, args: list[str]) -> float:
  env = dict(os.environ, PYTHONPATH=str(checkout), HF_HUB_OFFLINE="1")
  t0 = time.perf_counter()
  subprocess.run([sys.executable, "-m", *args], cwd=checkout, env=env, capture_output=True, timeout=600)
  return time.perf_counter() - t0


def markdown(result: dict, command: str) -> str:
  against = result.get("against")
  head = "| case | this checkout: median (min) s |" + (" against: median (min) s | against / this |" if against else "")
  lines = ["# How long a command line takes to answer", "", f"`{command}`", "",
           f"Machine: {common.machine_line(result['machine'])}; PYTHONDONTWRITEBYTECODE="
           f"{result['no_bytecode'] or 'unset'}; {result['reps']} repetitions, interleaved.", "",
           f"This checkout at {result['checkout']}" + (f"; against: a checkout at {against}" if against else ""), "",
           head, "| --- | ---: |" + (" ---: | ---: |" if against else "")]
  for case, row in result["cases"].items():
    line = f"| {case} | {row['this']['median']:.2f} ({row['this']['min']:.2f}) |"
    if against:
      line += f" {row['against']['median']:.2f} ({row['against']['min']:.2f}) | {row['against']['median'] / row['this']['median']:.1f}× |"
    lines.append(line)
  return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--against", type=pathlib.Path, default=None, help="another jaxsft checkout, timed alongside")
  parser.add_argument("--suffix", default="")
  args = parser.parse_args(argv)
  checkouts = {"this": common.ROOT}
  if args.against:
    checkouts["against"] = args.against.resolve()
  times = {case: {name: [] for name in checkouts} for case in CASES}
  for rep in range(args.reps):
    for case, case_args in CASES.items():
      for name, checkout in checkouts.items():
        times[case][name].append(time_case(checkout, case_args))
    print(f"repetition {rep + 1}: " + ", ".join(f"{c}: {t['this'][-1]:.2f} s" for c, t in times.items()), flush=True)

  def git_head(checkout: pathlib.Path) -> str:
    out = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"

  result = {"machine": common.machine_info(), "reps": args.reps, "no_bytecode": os.environ.get("PYTHONDONTWRITEBYTECODE"),
            "checkout": git_head(common.ROOT), "against": git_head(checkouts["against"]) if args.against else None,
            "cases": {case: {name: {"median": common.median(ts), "min": min(ts), "all": ts} for name, ts in per.items()}
                      for case, per in times.items()},
            "command": "python -m benchmarks.cli_start " + " ".join(argv if argv is not None else sys.argv[1:])}
  common.write_results(f"cli_start{args.suffix}", result, markdown(result, result["command"]))
  print(markdown(result, result["command"]))
  return 0


if __name__ == "__main__":
  sys.exit(main())
