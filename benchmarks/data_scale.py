"""Data at scale: a large JSONL file -> token store, then a second run's start to its first batch.

    .venv/bin/python benchmarks/data_scale.py [--records 1000000] [--cores 2] [--max-length 1024]

Generates `--records` varied records (JSONL, alpaca rows and `messages` conversations drawn from
the shared files, each made unique) into a temp dir, then in fresh processes pinned to `--cores`
CPUs:

- build: raw file -> token store (`open_or_build`, nothing cached): seconds, examples/s, peak RSS
  above the interpreter's RSS before the build (tokenizer loaded), store size on disk; then the
  bare `encode_batch` rate on the rendered texts of a sample of the same records, for reference;
- first step: a second run's `load_data` + `plan_data` (jaxsft.train.data_plan) + first batch of the training
  pipeline (the trainer's own functions; the model load is not included): seconds from the
  process's start, imports included.

Writes benchmarks/results/data_scale.{json,md}. Timings are only meaningful on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time

T_START = time.perf_counter()
ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
RESULTS = ROOT / "benchmarks" / "results"
MODEL = "smollm2-135m-instruct"


def _pin(cores: int) -> None:
  """This process on its first `cores` CPUs; the Rust tokenizer's pool sized to match."""
  cpus = sorted(os.sched_getaffinity(0))[:cores]
  os.sched_setaffinity(0, cpus)


def _rss(field: str) -> int:
  """VmRSS (now) or VmHWM (peak) of this process, bytes."""
  for line in pathlib.Path("/proc/self/status").read_text().splitlines():
    if line.startswith(field + ":"):
      return int(line.split()[1]) * 1024
  raise RuntimeError(field)


# ---------------------------------------------------------------------------------------------
# The data.


def generate(path: pathlib.Path, n: int, seed: int = 0) -> dict:
  """n JSONL rows: alpaca rows (from the alpaca files and gsm8k) and `messages` conversations
  (multi-turn and OpenAssistant), each with a numbered, reworded instruction so no two are equal."""
  rng = random.Random(seed)
  alpaca = [r for name in ("alpaca_en_demo.json", "code_alpaca_2k.json") for r in json.loads((SHARED / name).read_text())
            if r.get("output", "").strip()]
  alpaca += [{"instruction": r["question"], "input": "", "output": r["answer"]}
             for r in map(json.loads, (SHARED / "gsm8k_test.jsonl").read_text().splitlines())]
  chats = [r["messages"] for r in json.loads((SHARED / "chat_multiturn_demo.json").read_text())]
  chats += [json.loads(l)["messages"] for l in (SHARED / "oasst_top_paths.jsonl").read_text().splitlines()]
  leads = ["", "Please answer: ", "Task {i}. ", "Question #{i}: ", "Help me with this ({i}): ", "Briefly, "]
  systems = ["", "", "", "You are a careful assistant.", "Answer concisely."]
  counts = {"alpaca": 0, "messages": 0}
  with open(path, "w", encoding="utf-8") as f:
    for i in range(n):
      lead = rng.choice(leads).format(i=i) or f"[{i}] "
      if rng.random() < 0.8:
        r = dict(rng.choice(alpaca))
        r["instruction"] = lead + r["instruction"]
        if system := rng.choice(systems):
          r["system"] = system
        counts["alpaca"] += 1
      else:
        messages = [dict(m) for m in rng.choice(chats)]
        messages[0]["content"] = lead + messages[0]["content"]
        r = {"messages": messages}
        counts["messages"] += 1
      f.write(json.dumps(r, ensure_ascii=False) + "\n")
  return {"records": n, "bytes": path.stat().st_size, **counts}


# ---------------------------------------------------------------------------------------------
# Phases (each in a fresh process).


def phase_build(args) -> dict:
  _pin(args.cores)
  from jaxsft.data import iter_records, open_or_build
  from jaxsft.data.template import SpanRenderer
  from jaxsft.models.hub import load_tokenizer

  tokenizer = load_tokenizer(MODEL)
  rss_before = _rss("VmRSS")
  start = time.perf_counter()
  result = open_or_build(args.data, tokenizer, max_length=args.max_length, cache_dir=args.cache)
  seconds = time.perf_counter() - start
  peak = _rss("VmHWM")
  m = result.store.manifest
  out = {"built": result.built, "seconds": seconds, "records": m["num_records"],
         "examples_per_s": m["num_records"] / seconds, "kept": m["num_kept"], "dropped": m["num_dropped"],
         "truncated": m["num_truncated"], "tokens": m["num_tokens"],
         "store_bytes": sum(f["bytes"] for f in m["files"].values()),
         "store_bytes_by_file": {k: f["bytes"] for k, f in m["files"].items()},
         "rss_before_build": rss_before, "rss_peak": peak, "rss_peak_above_before": peak - rss_before}
  # Reference: encode_batch alone on the rendered texts of the first `sample` records.
  renderer, texts = SpanRenderer(tokenizer), []
  for record in iter_records(args.data):
    texts.append(renderer(record)[0])
    if len(texts) == args.sample:
      break
  backend = tokenizer.backend_tokenizer
  start = time.perf_counter()
  for lo in range(0, len(texts), 512):
    backend.encode_batch(texts[lo:lo + 512], add_special_tokens=False)
  encode_seconds = time.perf_counter() - start
  out["encode_batch_sample"] = {"records": len(texts), "examples_per_s": len(texts) / encode_seconds}
  return out


def phase_first_step(args) -> dict:
  _pin(args.cores)
  marks = {}
  from jaxsft import config as config_lib
  from jaxsft.train.data_plan import load_data, plan_data
  from jaxsft.models.hub import load_tokenizer

  marks["imports"] = time.perf_counter() - T_START
  cfg = config_lib.TrainConfig()
  cfg.data.path, cfg.data.cache_dir, cfg.data.max_length = str(args.data), str(args.cache), args.max_length
  train_records, val_records = load_data(cfg)
  marks["load_data (store found)"] = time.perf_counter() - T_START
  tokenizer = load_tokenizer(cfg.model.name)  # what the model load returns with the model
  marks["tokenizer"] = time.perf_counter() - T_START
  plan = plan_data(cfg, train_records, val_records, tokenizer, batch_multiple_of=1)
  marks["plan_data"] = time.perf_counter() - T_START
  batch = next(iter(plan.train_batches(tokenizer, seed=cfg.data.seed, num_epochs=1, worker_count=0)))
  marks["first batch"] = time.perf_counter() - T_START
  return {"seconds_to_first_batch": marks["first batch"], "marks": marks, "first_batch_shape": batch["input_ids"].shape,
          "train_records": len(train_records), "val_records": len(val_records), "shapes": len(plan.shapes),
          "batches_per_epoch": plan.batches_per_epoch, "rss_peak": _rss("VmHWM")}


def _run_phase(phase: str, args, data: pathlib.Path, cache: pathlib.Path) -> dict:
  env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="true", RAYON_NUM_THREADS=str(args.cores),
             JAX_PLATFORMS="cpu")
  cmd = [sys.executable, __file__, "--phase", phase, "--data", str(data), "--cache", str(cache),
         "--cores", str(args.cores), "--max-length", str(args.max_length), "--sample", str(args.sample)]
  done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
  if done.returncode:
    raise SystemExit(f"{phase} failed:\n{done.stderr[-4000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--records", type=int, default=1_000_000)
  parser.add_argument("--cores", type=int, default=2, help="CPUs each phase is pinned to (default: %(default)s)")
  parser.add_argument("--max-length", type=int, default=1024)
  parser.add_argument("--sample", type=int, default=20_000, help="records for the bare encode_batch reference")
  parser.add_argument("--keep", default=None, help="generate into (and keep) this folder instead of a temp dir")
  parser.add_argument("--phase", choices=("build", "first-step"), help=argparse.SUPPRESS)
  parser.add_argument("--data", help=argparse.SUPPRESS)
  parser.add_argument("--cache", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.phase:
    out = (phase_build if args.phase == "build" else phase_first_step)(args)
    print(json.dumps(out))
    return

  work = pathlib.Path(args.keep) if args.keep else pathlib.Path(tempfile.mkdtemp(prefix="jaxsft-data-scale-"))
  work.mkdir(parents=True, exist_ok=True)
  data, cache = work / "data.jsonl", work / "tokens"
  shutil.rmtree(cache, ignore_errors=True)
  try:
    t = time.perf_counter()
    generated = generate(data, args.records)
    generated["seconds"] = time.perf_counter() - t
    print("generated", generated, flush=True)
    build = _run_phase("build", args, data, cache)
    print("build", build, flush=True)
    first = _run_phase("first-step", args, data, cache)
    print("first step", first, flush=True)
  finally:
    if not args.keep:
      shutil.rmtree(work, ignore_errors=True)
  result = {"machine": {"cpus": os.cpu_count(), "cores_used": args.cores, "python": platform.python_version(),
                        "load_average_at_start": os.getloadavg()},
            "max_length": args.max_length, "generated": generated, "build": build, "first_step": first}
  result["build"]["vs_encode_batch"] = build["examples_per_s"] / build["encode_batch_sample"]["examples_per_s"]
  RESULTS.mkdir(parents=True, exist_ok=True)
  (RESULTS / "data_scale.json").write_text(json.dumps(result, indent=2) + "\n")
  (RESULTS / "data_scale.md").write_text(markdown(result, args))
  print((RESULTS / "data_scale.md").read_text())


def markdown(result, args) -> str:
  g, b, f = result["generated"], result["build"], result["first_step"]
  gib = lambda n: n / 2**30
  lines = [
      "# Data at scale: JSONL -> token store -> first batch", "",
      f"`.venv/bin/python benchmarks/data_scale.py --records {g['records']} --cores {args.cores} --max-length "
      f"{args.max_length}`: {g['records']:,} generated records ({g['alpaca']:,} alpaca rows, {g['messages']:,} "
      f"conversations; {gib(g['bytes']):.2f} GiB of JSONL), each phase in a fresh process pinned to {args.cores} "
      f"of {result['machine']['cpus']} CPUs; 1-minute load average at start "
      f"{result['machine']['load_average_at_start'][0]:.1f}.", "",
      "| measure | value |", "| --- | ---: |",
      f"| first build (raw file -> store) | {b['seconds']:.1f} s |",
      f"| build rate | {b['examples_per_s']:,.0f} examples/s |",
      f"| bare `encode_batch` on the rendered texts ({b['encode_batch_sample']['records']:,}-record sample) | "
      f"{b['encode_batch_sample']['examples_per_s']:,.0f} examples/s |",
      f"| build / bare encode_batch | {b['vs_encode_batch']:.2f} |",
      f"| peak RSS during the build, above the interpreter's before it | {gib(b['rss_peak_above_before']):.2f} GiB |",
      f"| store on disk | {gib(b['store_bytes']):.2f} GiB ({b['tokens']:,} tokens) |",
      f"| second run: start -> first batch (no model load) | {f['seconds_to_first_batch']:.1f} s |",
      f"| examples kept / dropped / truncated at {args.max_length} | {b['kept']:,} / {b['dropped']:,} / "
      f"{b['truncated']:,} |", "",
      "Second run, seconds since process start: "
      + ", ".join(f"{k} {v:.2f}" for k, v in f["marks"].items()) + ".", "",
      "Store files (bytes): " + ", ".join(f"{k} {v:,}" for k, v in b["store_bytes_by_file"].items()) + ".",
  ]
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  main()
