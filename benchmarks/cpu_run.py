"""Every CPU figure the performance targets name, measured on this machine in one command, and
the verdict: each target beside what this CPU gave.

    python -m benchmarks.cpu_run [--only CELL ...] [--reps 2] [--tag TAG]

  matmul_f32          one 1024x576 · 576x1536 product and its dX, XLA against torch, float32
                      (`benchmarks.matmul`; the file matmul_<tag>)
  matmul_bf16         the same in bfloat16 (matmul_bf16_<tag>)
  step_f32            SmolLM2-135M-Instruct (real weights), LoRA r 8 on q/v, 8x128 and 4x512:
                      jaxsft against torch eager + peft and torch.compile, fresh processes
                      interleaved (`benchmarks.vs_torch`; vs_torch_smollm2_f32_<tag>)
  step_bf16           the same with the model in bfloat16 on both sides (vs_torch_smollm2_bf16_<tag>;
                      by default only on a CPU with bfloat16 units, as profile_bf16: `UNITS_ONLY`)
  compile_prediction  the collation cost model's compile and step seconds against a run's, on a
                      held-out file, cold cache and warm (`benchmarks.compile_prediction`;
                      compile_prediction_smollm2_<tag>)
  store_build         the token store against the bare `encode_batch`, 200,000 mixed records
                      (`benchmarks.store_build`; store_build_<tag>)
  profile_f32         the float32 8x128 step op by op in XLA's profile (`benchmarks.step_profile`;
                      step_profile_smollm2_f32_8x128_<tag>)
  profile_bf16        the same in bfloat16 (step_profile_smollm2_bf16_8x128_<tag>)

The step cells also time the step's parts (attention, frozen projections, LM head and loss, the
layers' backward) alone on both sides (`vs_torch --profile`), so that where a target is missed
the verdict shows where the step's time goes, op by op and part by part against torch.

TAG names the CPU in every file, so that runs on different CPUs sit side by side: by default the
vendor and its best matrix unit (`cpu_tag`: intel_amx, amd_avx512_bf16, amd_avx2, ...). Each cell
runs in its own process group under its own time limit; one that fails or runs out of time says
why and the next one runs. Then cpu_run_<tag>.{json,md} lists every target (`targets`) with the
value its cell's file holds: a cell not run this time is read from its earlier file of the same
tag, so `--only` reruns a cell and the verdict keeps the rest.

Run it on a quiet machine: `benchmarks.vs_torch` waits for the load to settle before each run and
marks a run that started on a busy machine as contended.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

# Each benchmark sets its own TOKENIZERS_PARALLELISM default (the token store's build times the
# tokenizer on its threads, the step benchmarks turn them off); `common` sets one on import, which
# the cells must not inherit unless the caller set it.
_CALLERS_TOKENIZERS_PARALLELISM = os.environ.get("TOKENIZERS_PARALLELISM")

from benchmarks import common  # noqa: E402
from benchmarks.compile_prediction import TARGET_COMPILE_RATIO, TARGET_STEPS_WITHIN  # noqa: E402
from benchmarks.store_build import TARGET_OVER_ENCODE  # noqa: E402
from jaxsft.matmul import cpu_features, has_bf16_units  # noqa: E402

MODEL = "smollm2-135m-instruct"
SHAPES = ("8x128", "4x512")
PROFILED_SHAPE = "8x128"
BF16_OVER_F32 = 1.5
"""bfloat16's step against the same machine's float32 step, where the CPU has AMX tiles (the
other targets are their benchmarks': `vs_torch.targets`, `compile_prediction`, `store_build`)."""


@dataclasses.dataclass(frozen=True)
class Cell:
  name: str
  what: str
  limit_s: int
  stem: str  # the result file's name before the tag

  def command(self, tag: str, reps: int) -> list[str]:
    python, suffix = sys.executable, f"_{tag}"
    dtype = "bfloat16" if self.name.endswith("bf16") else "float32"  # the matmul, step and profile cells'
    if self.name.startswith("matmul"):
      return [python, "-m", "benchmarks.matmul", "--dtype", dtype, "--reps", str(max(reps, 3)),
              "--suffix", self.stem.removeprefix("matmul") + suffix]
    if self.name.startswith("step"):
      return [python, "-m", "benchmarks.vs_torch", "--model", MODEL, "--dtype", dtype, "--shapes", *SHAPES,
              "--steps", "6", "--reps", str(reps), "--frameworks", "jaxsft", "torch_eager", "torch_compile",
              "--compile-timeout", "600", "--profile", "--suffix", self.stem.removeprefix("vs_torch") + suffix]
    if self.name.startswith("profile"):
      return [python, "-m", "benchmarks.step_profile", "--model", "smollm2-135m", "--dtype", dtype, "--shape",
              PROFILED_SHAPE, "--steps", "3", "--suffix", self.stem.removeprefix("step_profile") + suffix]
    if self.name == "compile_prediction":
      return [python, "-m", "benchmarks.compile_prediction", "--steps", "10", "--suffix", "_smollm2" + suffix]
    return [python, "-m", "benchmarks.store_build", "--records", "200000", "--reps", "3", "--suffix", suffix]


# Limits: 3.5 to 24 times what each cell took on the 2-core AMD EPYC with avx512_bf16
# (cpu_run_amd_avx512_bf16.md), so that the AVX2-only EPYC, about 3x slower, fits too.
CELLS = (
    Cell("matmul_f32", "one 1024x576·576x1536 product and its dX, XLA against torch, float32", 600, "matmul"),
    Cell("matmul_bf16", "the same product in bfloat16", 600, "matmul_bf16"),
    Cell("step_f32", f"{MODEL} LoRA step, float32, {' and '.join(SHAPES)}: jaxsft, torch eager + peft, "
         "torch.compile", 5400, "vs_torch_smollm2_f32"),
    Cell("step_bf16", "the same step in bfloat16", 5400, "vs_torch_smollm2_bf16"),
    Cell("compile_prediction", "the cost model's compile and step seconds against a run's, cold and warm",
         2700, "compile_prediction_smollm2"),
    Cell("store_build", "the token store against the bare encode_batch, 200,000 records", 2700, "store_build"),
    Cell("profile_f32", f"the float32 {PROFILED_SHAPE} step op by op", 600, f"step_profile_smollm2_f32_{PROFILED_SHAPE}"),
    Cell("profile_bf16", f"the bfloat16 {PROFILED_SHAPE} step op by op", 600, f"step_profile_smollm2_bf16_{PROFILED_SHAPE}"),
)


UNITS_ONLY = ("step_bf16", "profile_bf16")
"""Cells run by default only where the CPU has bfloat16 units (AMX, avx512_bf16): elsewhere no
bfloat16 target applies, and torch's bf16 products there run at a few GFLOP/s, hours for the step
cell (`matmul_bf16`, a minute, still shows it)."""


def cells_to_run(only: list[str] | None, flags: tuple[str, ...]) -> tuple[list[Cell], list[Cell]]:
  """(the cells to run, the cells left out): those `only` names, or every cell, less `UNITS_ONLY`
  where `flags` has no bfloat16 units."""
  if only:
    return [c for c in CELLS if c.name in only], []
  units = has_bf16_units(flags)
  return ([c for c in CELLS if units or c.name not in UNITS_ONLY],
          [c for c in CELLS if not units and c.name in UNITS_ONLY])


def cpu_tag(cpuinfo: str | None = None) -> str:
  """The CPU's name in result files: its vendor and best matrix unit, e.g. "intel_amx",
  "amd_avx512_bf16", "amd_avx512", "amd_avx2" (from `cpuinfo`, default /proc/cpuinfo)."""
  cpuinfo = common.read_cpuinfo() if cpuinfo is None else cpuinfo
  vendor_id = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("vendor_id")), "")
  vendor = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(vendor_id, "cpu")
  features = cpu_features(cpuinfo)  # best first: amx_bf16, avx512_bf16, avx512f, avx2
  unit = {"amx_bf16": "amx", "avx512f": "avx512"}.get(features[0], features[0]) if features else "no_avx2"
  return f"{vendor}_{unit}"


def run_cell(cell: Cell, tag: str, reps: int, log=print) -> dict:
  cmd = cell.command(tag, reps)
  env = dict(os.environ, PYTHONPATH=str(common.ROOT), HF_HUB_OFFLINE="1")
  if _CALLERS_TOKENIZERS_PARALLELISM is None:
    env.pop("TOKENIZERS_PARALLELISM", None)
  log(f"== {cell.name}: {cell.what} (limit {cell.limit_s} s)\n   {' '.join(cmd[1:])}")
  started_at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
  t0 = time.perf_counter()
  # A session of its own: at the limit the cell's workers (and torch.compile's) go with it.
  proc = subprocess.Popen(cmd, cwd=common.ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)
  tail = collections.deque(maxlen=4)

  def relay() -> None:  # the cell's lines as they come: a cell can take an hour
    for line in proc.stdout:
      tail.append(line.rstrip())
      log("   | " + line.rstrip())

  reader = threading.Thread(target=relay, daemon=True)
  reader.start()
  try:
    proc.wait(timeout=cell.limit_s)
    status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    status = f"ran past its {cell.limit_s} s limit"
  reader.join(timeout=10)
  tail = list(tail)
  seconds = time.perf_counter() - t0
  log(f"   {cell.name}: {status} in {seconds:.0f} s" + ("" if status == "ok" else ": " + " | ".join(tail)))
  return {"cell": cell.name, "command": "python " + " ".join(cmd[1:]), "started_at": started_at, "status": status,
          "seconds": seconds, "last_lines": tail}


# ---------------------------------------------------------------------------------------------
# The verdict, from the cells' files.


def read_result(stem: str, tag: str, results_dir: pathlib.Path = common.RESULTS) -> dict | None:
  path = results_dir / f"{stem}_{tag}.json"
  return json.loads(path.read_text()) if path.is_file() else None


def _row(target: str, value: float | None, wanted: str, met: bool | None, required: bool, source: str) -> dict:
  return {"target": target, "value": value, "wanted": wanted, "met": met, "required": required, "source": source}


def targets(results: dict[str, dict | None], flags: tuple[str, ...]) -> list[dict]:
  """Each target with what `results` (cell stem → its result file's JSON, None where absent)
  hold for it; `required` says whether the target applies to a CPU with these matrix flags:
  float32 everywhere; bfloat16 against torch eager where the CPU has bf16 units
  (avx512_bf16 or AMX), against torch.compile and its own float32 step where it has AMX."""
  bf16_units = has_bf16_units(flags)
  amx = "amx_bf16" in flags
  rows = []
  f32 = (results.get("vs_torch_smollm2_f32") or {}).get("summary", {})
  for dtype, stem in (("float32", "vs_torch_smollm2_f32"), ("bfloat16", "vs_torch_smollm2_bf16")):
    result = results.get(stem) or {}
    for shape in SHAPES:
      summary = result.get("summary", {}).get(shape, {})
      verdicts = result.get("targets", {}).get(shape, {})  # vs_torch's own, against its targets
      for fw, key, required in (("torch eager", "torch_eager", dtype == "float32" or bf16_units),
                                ("torch compile", "torch_compile", dtype == "float32" or amx),
                                ("", "jaxsft_mfu", dtype == "float32" or bf16_units)):
        v = verdicts.get(key, {})
        name = f"jaxsft over {fw}" if fw else "model FLOP rate over the single-matmul rate"
        rows.append(_row(f"{dtype} {shape}: {name}", v.get("ratio", v.get("mfu")), f">= {v.get('target', '?')}",
                         v.get("met"), required, stem))
      if dtype == "bfloat16":
        step, step_f32 = summary.get("jaxsft", {}).get("step_s"), f32.get(shape, {}).get("jaxsft", {}).get("step_s")
        ratio = step_f32 / step if step and step_f32 else None
        rows.append(_row(f"bfloat16 {shape}: jaxsft float32 step over its bfloat16 step", ratio, f">= {BF16_OVER_F32}",
                         None if ratio is None else ratio >= BF16_OVER_F32, amx, f"{stem}, vs_torch_smollm2_f32"))
  prediction = {r["run"]: r for r in (results.get("compile_prediction_smollm2") or {}).get("rows", [])}
  low, high = TARGET_COMPILE_RATIO
  for run in ("held-out cold", "held-out warm"):
    row = prediction.get(run, {})
    ratio = row.get("compiles_ratio")
    rows.append(_row(f"compile seconds predicted over measured, {run}", ratio, f"{low} to {high}",
                     None if ratio is None else low <= ratio <= high, True, "compile_prediction_smollm2"))
    ratio = row.get("steps_ratio")
    rows.append(_row(f"step seconds predicted over measured, {run}", ratio,
                     f"{1 - TARGET_STEPS_WITHIN:.2f} to {1 + TARGET_STEPS_WITHIN:.2f}",
                     None if ratio is None else abs(ratio - 1) <= TARGET_STEPS_WITHIN, True,
                     "compile_prediction_smollm2"))
  ratio = ((results.get("store_build") or {}).get("run") or {}).get("store_over_encode_batch")
  rows.append(_row("token store build over the bare encode_batch", ratio, f">= {TARGET_OVER_ENCODE}",
                   None if ratio is None else ratio >= TARGET_OVER_ENCODE, True, "store_build"))
  return rows


def where_the_time_goes(results: dict[str, dict | None]) -> list[dict]:
  """Per dtype, the profiled step's wall time and op time by group (`benchmarks.step_profile`)
  and each part timed alone on both sides (`vs_torch --profile`), where their files hold them."""
  stems, out = {c.name: c.stem for c in CELLS}, []
  for dtype, short in (("float32", "f32"), ("bfloat16", "bf16")):
    profile = results.get(stems[f"profile_{short}"]) or {}
    parts = ((results.get(stems[f"step_{short}"]) or {}).get("profile") or {}).get(PROFILED_SHAPE, {})
    if profile or parts:
      out.append({"dtype": dtype, "step_wall_s": profile.get("step_wall_s"), "groups": profile.get("groups", {}),
                  "matmul_path": profile.get("matmul_path"), "parts": parts})
  return out


def _time_markdown(rows: list[dict]) -> list[str]:
  lines = []
  for r in rows:
    lines += [f"## Where the {r['dtype']} {PROFILED_SHAPE} step's time goes", ""]
    if r["groups"]:
      lines += [f"XLA's profile of jaxsft's step: {r['step_wall_s']:.3f} s wall while traced; {r['matmul_path']}. "
                "Op time by group (ops overlap, so the groups add up to more than the wall time): "
                + ", ".join(f"{group} {seconds:.3f} s" for group, seconds in r["groups"].items()) + ".", ""]
    if r["parts"]:
      lines += ["Each part timed alone, forward + backward (median s):", "",
                "| part | jaxsft | torch eager | torch / jaxsft |", "| --- | ---: | ---: | ---: |"]
      for part, seconds in r["parts"].items():
        j, t = seconds.get("jaxsft"), seconds.get("torch")
        lines.append(f"| {part} | {'' if j is None else f'{j:.3f}'} | {'' if t is None else f'{t:.3f}'} | "
                     f"{f'{t / j:.2f}' if j and t else ''} |")
      lines.append("")
  return lines


def markdown(result: dict) -> str:
  tag = result["tag"]
  lines = [f"# The CPU run on {tag}", "", f"`{result['command']}`", "",
           f"Machine: {common.machine_line(result['machine'])}.", "",
           "| target | this CPU | wanted | met | applies to this CPU | file |", "| --- | ---: | --- | --- | --- | --- |"]
  for r in result["targets"]:
    value = "not measured" if r["value"] is None else f"{r['value']:.3f}"
    met = "" if r["met"] is None else ("yes" if r["met"] else "**no**")
    lines.append(f"| {r['target']} | {value} | {r['wanted']} | {met} | {'yes' if r['required'] else 'no'} | "
                 f"`{r['source'].replace(', ', f'_{tag}`, `')}_{tag}` |")
  lines += [""] + _time_markdown(result.get("time", []))
  lines += ["Each cell's last run (with `--only`, the other cells are those of an earlier call):", "",
            "| cell | status | started | seconds | command |", "| --- | --- | --- | ---: | --- |"]
  for c in result["cells"]:
    lines.append(f"| {c['cell']} | {c['status']} | {c['started_at']} | {c['seconds']:.0f} | `{c['command']}` |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--only", nargs="+", choices=[c.name for c in CELLS], help="run only these cells")
  parser.add_argument("--reps", type=int, default=2, help="interleaved repetitions of each step comparison")
  parser.add_argument("--tag", default=cpu_tag(), help="the CPU's name in the result files (default: %(default)s)")
  args = parser.parse_args(argv)
  log = lambda s: print(s, flush=True)
  machine = common.machine_info()
  cells, left_out = cells_to_run(args.only, tuple(machine.get("cpu_flags", ())))
  for c in left_out:
    log(f"== {c.name}: left out, no bfloat16 units on this CPU (`--only {c.name}` runs it)")
  ran = [run_cell(c, args.tag, args.reps, log) for c in cells]
  command = (f"python -m benchmarks.cpu_run --reps {args.reps}" + (f" --only {' '.join(args.only)}" if args.only else "")
             + ("" if args.tag == cpu_tag() else f" --tag {args.tag}"))
  results = {c.stem: read_result(c.stem, args.tag) for c in CELLS}
  earlier = read_result("cpu_run", args.tag) if args.only else None
  if earlier:  # the cells not run again keep their earlier entries, as their files keep their figures
    by_name = {c["cell"]: c for c in earlier["cells"]} | {c["cell"]: c for c in ran}
  else:
    by_name = {c["cell"]: c for c in ran}
  result = {"command": command, "tag": args.tag, "machine": machine,
            "cells": [by_name[c.name] for c in CELLS if c.name in by_name],
            "targets": targets(results, tuple(machine.get("cpu_flags", ()))), "time": where_the_time_goes(results)}
  common.write_results(f"cpu_run_{args.tag}", result, markdown(result))
  missed = [r["target"] for r in result["targets"] if r["required"] and r["met"] is False]
  log(f"cpu_run: {sum(c['status'] == 'ok' for c in ran)}/{len(ran)} cells ok; {len(missed)} required targets missed"
      + "".join(f"\n   missed: {m}" for m in missed))
  return 0 if all(c["status"] == "ok" for c in ran) else 1


if __name__ == "__main__":
  sys.exit(main())
