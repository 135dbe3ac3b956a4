"""`python -m jaxsft.data stats --data FILE [--model M] [--max-length N] [--buckets K] [--field-map JSON]
[--batch-size B]`: token length distribution and the padding of static/dynamic/bucketed/packed batching."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from jaxsft.data.tokenize import TRAIN_ON


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jaxsft.data", description=__doc__.split(":")[0])
  sub = parser.add_subparsers(dest="command", required=True)
  stats = sub.add_parser("stats", help="length histogram and padded tokens per batching mode")
  stats.add_argument("--data", required=True, help="JSON array or JSONL (.gz ok) instruction file")
  stats.add_argument("--model", default="smollm2-135m-instruct", help="tokenizer source (default: %(default)s)")
  stats.add_argument("--max-length", type=int, default=1024, help="truncation length (default: %(default)s)")
  stats.add_argument("--buckets", type=int, default=8, help="number of buckets to choose (default: %(default)s)")
  stats.add_argument("--batch-size", type=int, default=8, help="rows per batch (default: %(default)s)")
  stats.add_argument("--pad-to-multiple-of", type=int, default=8, help="(default: %(default)s)")
  stats.add_argument("--field-map", type=json.loads, default=None,
                     help='canonical -> file field names, e.g. \'{"instruction": "question", "output": "answer"}\'')
  stats.add_argument("--format", default="auto", help="record format (default: auto-detect)")
  stats.add_argument("--train-on", default="all_assistant", choices=TRAIN_ON)
  args = parser.parse_args(argv)
  logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

  from jaxsft.data.records import DataError, SkipReport, load_records
  from jaxsft.data.stats import compare_batching, format_comparison, length_summary, text_histogram
  from jaxsft.data.tokenize import tokenize_records
  from jaxsft.models.hub import load_tokenizer

  report = SkipReport()
  try:
    records = load_records(args.data, fmt=args.format, field_map=args.field_map, on_error="skip", report=report)
  except DataError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  tokenizer = load_tokenizer(args.model)
  tokenized = tokenize_records(tokenizer, records, max_length=args.max_length, train_on=args.train_on)
  summary = length_summary(tokenized)
  print(f"{args.data}: {len(records)} records ({report.num_skipped} skipped), tokenizer {args.model}")
  print(f"tokens per example (before truncation): min {summary['min']}, p50 {summary['p50']:.0f}, "
        f"p90 {summary['p90']:.0f}, p99 {summary['p99']:.0f}, max {summary['max']}, mean {summary['mean']:.1f}")
  print(f"max_length {args.max_length}: {summary['truncated']} truncated, {summary['dropped']} dropped "
        "(no trained token left)\n")
  print(text_histogram(summary["lengths"], max_length=args.max_length))
  print(f"\nbatch size {args.batch_size}, one epoch, pad to a multiple of {args.pad_to_multiple_of}:")
  print(format_comparison(compare_batching(records, tokenizer, max_length=args.max_length, num_buckets=args.buckets,
                                           batch_size=args.batch_size, pad_to_multiple_of=args.pad_to_multiple_of,
                                           train_on=args.train_on, tokenized=tokenized)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
