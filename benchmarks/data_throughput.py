"""Data pipeline benchmark: tokenize+batch throughput, and padded tokens per batching mode.

    .venv/bin/python benchmarks/data_throughput.py [--workers 2] [--examples 4000]

Writes benchmarks/results/data_throughput.{json,md}. Throughput counts examples that come out
of `make_batches` (tokenization inside the pipeline, explicit bucket boundaries, so nothing is
tokenized up front) per second of wall time, worker start-up included and excluded; plus the
up-front batched tokenization the default bucketed mode does (`tokenize_records`). The padding
comparison runs one epoch of the real pipeline per mode at max_length 1024, K = 8 buckets,
batch size 8, on the three shared files. Building the token store against the bare tokenizer:
benchmarks/store_build.py.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
RESULTS = ROOT / "benchmarks" / "results"


def pipeline_rate(records, tokenizer, *, workers, examples, max_length=1024):
  from jaxsft.data import make_batches

  epochs = max(1, -(-examples // len(records)))
  # No `tokenized=` and explicit buckets: the pipeline tokenizes every record as it reads it.
  ds = make_batches(records, tokenizer, max_length=max_length, bucket_lengths=[128, 256, 384, 512, 640, 768, 896, 1024],
                    batch_size=8, num_epochs=epochs, worker_count=workers)
  start = time.perf_counter()
  it = iter(ds)
  first = next(it)
  after_first = time.perf_counter()
  rows = int((first["attention_mask"].sum(1) > 0).sum())
  rows_after_first = 0
  for batch in it:
    rows_after_first += int((batch["attention_mask"].sum(1) > 0).sum())
  end = time.perf_counter()
  if hasattr(it, "close"):
    it.close()
  total = rows + rows_after_first
  return {"workers": workers, "examples": total, "epochs": epochs, "seconds": end - start,
          "examples_per_s": total / (end - start),
          "examples_per_s_after_first_batch": rows_after_first / (end - after_first),
          "first_batch_s": after_first - start}


def upfront_rate(records, tokenizer, *, max_length=1024):
  from jaxsft.data import tokenize_records

  start = time.perf_counter()
  tokenize_records(tokenizer, records, max_length=max_length)
  seconds = time.perf_counter() - start
  return {"examples": len(records), "seconds": seconds, "examples_per_s": len(records) / seconds,
          "tokenizers_parallelism": os.environ.get("TOKENIZERS_PARALLELISM", "unset")}


def main():
  if "--markdown-only" in __import__("sys").argv:  # rewrite the .md from the saved .json
    result = json.loads((RESULTS / "data_throughput.json").read_text())
    workers = next(int(k.split("_")[1]) for k in next(iter(result["throughput"].values())) if k.endswith("_workers")
                   and not k.startswith("pipeline_0"))
    (RESULTS / "data_throughput.md").write_text(markdown(result, workers))
    return
  parser = argparse.ArgumentParser()
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--examples", type=int, default=4000, help="examples per throughput run")
  args = parser.parse_args()

  from jaxsft.data import load_records
  from jaxsft.collation.compare import compare_batching
  from jaxsft.models.hub import load_tokenizer

  tokenizer = load_tokenizer("smollm2-135m-instruct")
  result = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "load_average_at_start": os.getloadavg()}, "throughput": {},
            "padding": {}}
  for name in ("alpaca_en_demo.json", "chat_multiturn_demo.json"):
    records = load_records(SHARED / name)
    runs = {"upfront_tokenize_records": upfront_rate(records, tokenizer),
            "pipeline_0_workers": pipeline_rate(records, tokenizer, workers=0, examples=args.examples // 2),
            f"pipeline_{args.workers}_workers": pipeline_rate(records, tokenizer, workers=args.workers,
                                                              examples=args.examples)}
    result["throughput"][name] = runs
    print(name, json.dumps(runs, indent=1))
  for name in ("alpaca_en_demo.json", "chat_multiturn_demo.json", "oasst_top_paths.jsonl"):
    cmp = compare_batching(load_records(SHARED / name), tokenizer, max_length=1024, num_buckets=8, batch_size=8)
    b, d, s = cmp["bucketed"], cmp["dynamic"], cmp["static"]
    waste = lambda r: r["padded"] - r["real"]
    cmp["ratios"] = {
        "bucketed_over_dynamic_padded": b["padded"] / d["padded"],
        "static_over_bucketed_padded": s["padded"] / b["padded"],
        "bucketed_over_dynamic_waste": waste(b) / waste(d),
        "static_over_bucketed_waste": waste(s) / waste(b),
    }
    result["padding"][name] = cmp
    print(name, json.dumps(cmp["ratios"]))
  RESULTS.mkdir(parents=True, exist_ok=True)
  (RESULTS / "data_throughput.json").write_text(json.dumps(result, indent=2) + "\n")
  (RESULTS / "data_throughput.md").write_text(markdown(result, args.workers))
  print((RESULTS / "data_throughput.md").read_text())


def markdown(result, workers):
  lines = ["# Data pipeline benchmark", "",
           f"`.venv/bin/python benchmarks/data_throughput.py --workers {workers}` on {result['machine']['cpus']} CPU "
           "cores (SmolLM2-135M-Instruct tokenizer, max_length 1024); 1-minute load average at start "
           f"{result['machine']['load_average_at_start'][0]:.1f} (it includes the decaying load of whatever ran "
           "just before; a figure is a result only on an otherwise quiet machine)."]
  if result.get("store"):  # results from before the store's own benchmark (benchmarks/store_build.py)
    lines += ["", "## Raw file -> token store vs the tokenizer alone (examples/s, best of interleaved runs)", "",
              "| file | records | bare `encode_batch` | file -> store | in-memory `tokenize_records` | store / encode_batch |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in result["store"].items():
      e = r["examples_per_s"]
      lines.append(f"| `{name}` | {r['examples']:,} | {e['encode_batch']:,.0f} | {e['store_build']:,.0f} | "
                   f"{e['tokenize_records']:,.0f} | {r['store_over_encode_batch']:.2f} |")
  lines += ["", "## Tokenize + batch throughput (examples/s)", "",
           "| file | up-front `tokenize_records` | pipeline, 0 workers | "
           f"pipeline, {workers} workers (total) | pipeline, {workers} workers (after first batch) |",
           "| --- | ---: | ---: | ---: | ---: |"]
  for name, runs in result["throughput"].items():
    w = runs[f"pipeline_{workers}_workers"]
    lines.append(f"| `{name}` | {runs['upfront_tokenize_records']['examples_per_s']:,.0f} | "
                 f"{runs['pipeline_0_workers']['examples_per_s']:,.0f} | {w['examples_per_s']:,.0f} | "
                 f"{w['examples_per_s_after_first_batch']:,.0f} |")
  lines += ["", "## Padded tokens per batching mode (one epoch, batch size 8, K = 8 buckets)", "",
            "padded = B x T summed over batches (fill rows included); waste = padded - real.", "",
            "| file | mode | padded | waste | waste % | shapes |", "| --- | --- | ---: | ---: | ---: | ---: |"]
  for name, cmp in result["padding"].items():
    for mode in ("static", "dynamic", "bucketed", "packed"):
      r = cmp[mode]
      lines.append(f"| `{name}` | {mode} | {r['padded']:,} | {r['padded'] - r['real']:,} | "
                   f"{100 * r['waste_frac']:.1f} | {r['shapes']} |")
  lines += ["", "| file | bucketed / dynamic padded | static / bucketed padded | bucketed / dynamic waste | "
            "static / bucketed waste | buckets |", "| --- | ---: | ---: | ---: | ---: | --- |"]
  for name, cmp in result["padding"].items():
    t = cmp["ratios"]
    lines.append(f"| `{name}` | {t['bucketed_over_dynamic_padded']:.2f} | {t['static_over_bucketed_padded']:.2f} | "
                 f"{t['bucketed_over_dynamic_waste']:.2f} | {t['static_over_bucketed_waste']:.2f} | "
                 f"{cmp['bucketed']['buckets']} |")
  names = list(result["padding"])
  joined = lambda values, fmt: " / ".join(fmt.format(v) for v in values)  # noqa: E731
  ratios = lambda key: [result["padding"][n]["ratios"][key] for n in names]  # noqa: E731
  static_over_real = [result["padding"][n]["static"]["padded"] / result["padding"][n]["static"]["real"] for n in names]
  runs = result["throughput"]
  upfront = [r["upfront_tokenize_records"]["examples_per_s"] for r in runs.values()]
  pipe0 = [r["pipeline_0_workers"]["examples_per_s"] for r in runs.values()]
  pipew = [r[f"pipeline_{workers}_workers"] for r in runs.values()]
  lines += ["", "## Summary", "",
            f"- Tokenize + batch on {' / '.join(f'`{n}`' for n in runs)}: fastest up front with `tokenize_records`, "
            f"{joined(upfront, '{:,.0f}')} examples/s; the pipeline tokenizing as it reads does {joined(pipe0, '{:,.0f}')} "
            f"with 0 workers and {joined([w['examples_per_s'] for w in pipew], '{:,.0f}')} with {workers} "
            f"({joined([w['examples_per_s_after_first_batch'] for w in pipew], '{:,.0f}')} after the first batch).",
            f"- Bucketed (K = 8) against static, counting padded = B x T: {joined(ratios('static_over_bucketed_padded'), '{:.2f}x')} "
            f"fewer tokens on {' / '.join(f'`{n}`' for n in names)}, where static's B x T is "
            f"{joined(static_over_real, '{:.2f}x')} the real tokens (the most any batching could save); counting padding "
            f"tokens only, {joined(ratios('static_over_bucketed_waste'), '{:.2f}x')} fewer.",
            f"- Bucketed against dynamic: {joined(ratios('bucketed_over_dynamic_padded'), '{:.2f}')} of its padded tokens, "
            f"{joined(ratios('bucketed_over_dynamic_waste'), '{:.2f}')} of its padding tokens."]
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  main()
