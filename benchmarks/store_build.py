"""Building the token store against the bare tokenizer, on mixed records, with where the rest goes.

    python -m benchmarks.store_build [--records 200000] [--reps 3] [--suffix _NAME]

The records are drawn (seeded, with replacement) from the three shared files: single-turn
instructions (alpaca_en_demo.json), multi-turn chats (chat_multiturn_demo.json) and assistant
threads (oasst_top_paths.jsonl), written as one JSONL file. Interleaved, `--reps` times:

  - `encode_batch`: the Rust tokenizer alone on the records' rendered texts, 512 at a time (the
    rendering is not timed): what tokenizing these records costs at the least;
  - `store`: `open_or_build` of the JSONL file into an empty cache: read, normalize, render, encode,
    label and write, as a run's first start does.

The ratio is best store rate over best `encode_batch` rate (examples/s). Then each stage the store
runs besides the encode is timed alone over the same records, one after another (reading and
normalizing, rendering with the chat template, serializing the record, labels from the encodings,
freeing the encodings), to show what the build pays per record beyond the tokenizer.

Writes benchmarks/results/store_build{suffix}.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import shutil
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The tokenizer on its own threads, as in a training run (benchmarks.common turns them off for the
# step benchmarks, where tokenizing is not what is timed); TOKENIZERS_PARALLELISM=false beforehand
# measures the single-threaded tokenizer instead.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

from benchmarks.common import machine_info, machine_line, write_results  # noqa: E402

SHARED = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"
SOURCES = ("alpaca_en_demo.json", "chat_multiturn_demo.json", "oasst_top_paths.jsonl")
BATCH = 512
TARGET_OVER_ENCODE = 0.8
"""The store's build rate over the bare `encode_batch`'s."""


def mixed_records(count: int, seed: int) -> list[dict]:
  from jaxsft.data import load_records

  pool = [r for name in SOURCES for r in load_records(SHARED / name)]
  rng = random.Random(seed)
  return [pool[rng.randrange(len(pool))] for _ in range(count)]


def stages(records: list[dict], path: pathlib.Path, tokenizer) -> dict:
  """Seconds of each stage of the build alone, on this thread, over `records`."""
  from jaxsft.data import tokenize
  from jaxsft.data.records import iter_records
  from jaxsft.data.template import SpanRenderer

  backend = tokenizer.backend_tokenizer
  seconds = {}

  def timed(name, fn):
    t0 = time.perf_counter()
    out = fn()
    seconds[name] = time.perf_counter() - t0
    return out

  read = timed("read and normalize", lambda: list(iter_records(path)))
  renderer = SpanRenderer(tokenizer)
  rendered = timed("render (chat template, spans)", lambda: [renderer(r) for r in read])
  timed("serialize record", lambda: [json.dumps(r, ensure_ascii=False).encode() for r in read])
  encoded = timed("encode_batch", lambda: [backend.encode_batch([t for t, _ in rendered[i:i + BATCH]],
                                                                add_special_tokens=False)
                                           for i in range(0, len(rendered), BATCH)])
  contiguous = tokenize._contiguous_offsets(backend)
  timed("labels from encodings", lambda: [
      tokenize._labels_batch(e, [(r, t, s) for r, (t, s) in zip(read[k * BATCH:(k + 1) * BATCH],
                                                                 rendered[k * BATCH:(k + 1) * BATCH])],
                             k * BATCH, 1024, contiguous) for k, e in enumerate(encoded)])
  timed("free encodings", encoded.clear)
  return {"seconds": {k: round(v, 3) for k, v in seconds.items()}, "fast_path_template": renderer.opaque,
          "fallbacks": renderer.fallbacks}


def run(args) -> dict:
  from jaxsft.data import open_or_build
  from jaxsft.data.template import SpanRenderer
  from jaxsft.models.hub import load_tokenizer

  tokenizer = load_tokenizer(args.model)
  records = mixed_records(args.records, args.seed)
  work = pathlib.Path(tempfile.mkdtemp(prefix="jaxsft-store-build-"))
  try:
    path = work / "mixed.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    renderer = SpanRenderer(tokenizer)
    texts = [renderer(r)[0] for r in records]
    backend = tokenizer.backend_tokenizer
    rates = {"encode_batch": [], "store": []}
    for rep in range(args.reps):
      t0 = time.perf_counter()
      for i in range(0, len(texts), BATCH):
        backend.encode_batch(texts[i:i + BATCH], add_special_tokens=False)
      rates["encode_batch"].append(len(texts) / (time.perf_counter() - t0))
      t0 = time.perf_counter()
      built = open_or_build(path, tokenizer, max_length=args.max_length, cache_dir=work / f"cache{rep}")
      rates["store"].append(len(texts) / (time.perf_counter() - t0))
      assert built.built, "an empty cache folder holds no store"
      manifest = built.store.manifest
      print(json.dumps({"rep": rep, **{k: round(v[-1]) for k, v in rates.items()}}), flush=True)
    stage_seconds = stages(records, path, tokenizer)
  finally:
    shutil.rmtree(work, ignore_errors=True)
  best = {k: round(max(v), 1) for k, v in rates.items()}  # the ratio is of the figures the file holds
  return {"records": len(records), "sources": list(SOURCES), "seed": args.seed, "max_length": args.max_length,
          "reps": args.reps, "examples_per_s": {k: [round(x, 1) for x in v] for k, v in rates.items()},
          "best_examples_per_s": best,
          "store_over_encode_batch": round(best["store"] / best["encode_batch"], 3),
          "kept": manifest["num_kept"], "tokens": manifest["num_tokens"], "stages": stage_seconds,
          "tokenizers_parallelism": os.environ.get("TOKENIZERS_PARALLELISM", "unset")}


def markdown(result: dict) -> str:
  r = result["run"]
  best = r["best_examples_per_s"]
  lines = ["# Token store build against the bare tokenizer", "",
           f"Machine: {machine_line(result['machine'])}", "",
           f"{r['records']:,} records drawn from {', '.join(f'`{s}`' for s in r['sources'])} (seed {r['seed']}), "
           f"max_length {r['max_length']}, {r['reps']} interleaved repetitions, TOKENIZERS_PARALLELISM="
           f"{r['tokenizers_parallelism']}. Command: `{result['command']}`", "",
           "| | examples/s, each repetition | best |", "| --- | --- | ---: |"]
  for name in ("encode_batch", "store"):
    lines.append(f"| {'bare `encode_batch`' if name == 'encode_batch' else 'file -> token store'} | "
                 f"{', '.join(f'{x:,.0f}' for x in r['examples_per_s'][name])} | {best[name]:,.0f} |")
  lines += ["", f"**store / encode_batch: {r['store_over_encode_batch']:.2f}** "
            f"(target: at least {TARGET_OVER_ENCODE})", "",
            "Each stage of the build timed alone, one after another, over the same records (the encode runs "
            "on the tokenizer's threads, the rest on Python's; the build overlaps the two):", "",
            "| stage | seconds | µs per record |", "| --- | ---: | ---: |"]
  for name, seconds in r["stages"]["seconds"].items():
    lines.append(f"| {name} | {seconds:.2f} | {1e6 * seconds / r['records']:.1f} |")
  lines += ["", f"Chat template proved content-opaque (no render per record): {r['stages']['fast_path_template']}; "
            f"records on the reference path: {r['stages']['fallbacks']}.", ""]
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="smollm2-135m-instruct")
  parser.add_argument("--records", type=int, default=200_000)
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--max-length", type=int, default=1024)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--suffix", default="")
  args = parser.parse_args(argv)
  info = machine_info()
  result = {"machine": info, "command": " ".join(["python -m benchmarks.store_build", *(argv or sys.argv[1:])]),
            "run": run(args)}
  write_results(f"store_build{args.suffix}", result, markdown(result))
  print(markdown(result))
  return 0


if __name__ == "__main__":
  sys.exit(main())
