"""`jaxsft data build|stats --data FILE [--model M] [--max-length N] [--train-on W] ...`

build: tokenizes the data into its token store (or finds it) and says where it is, what it holds
and how long that took. stats: token length distribution, and the padding and predicted
end-to-end seconds (steps + compiles, under the collation cost model) of every batching mode and
of what `batching: auto` would choose, read from the same store."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from jaxsft.data.records import ON_ERROR
from jaxsft.data.template import TRAIN_ON


def _data_arguments(parser: argparse.ArgumentParser, *, max_length: int, on_error: str) -> None:
  data = parser.add_argument_group("the data and its tokenization")
  data.add_argument("--data", required=True,
                    help="JSON array or JSONL, CSV/TSV with a header (.gz ok), parquet/Arrow file, or a folder of parquet shards or "
                         "from datasets' save_to_disk")
  data.add_argument("--model", default="smollm2-135m-instruct", help="tokenizer source (default: %(default)s)")
  data.add_argument("--chat-template", default=None, metavar="PATH",
                    help="a Jinja chat template file, or a tokenizer folder whose template to use, as the train "
                         "command's model.chat_template (default: the tokenizer's own)")
  data.add_argument("--max-length", type=int, default=max_length, help="truncation length (default: %(default)s)")
  data.add_argument("--field-map", type=json.loads, default=None,
                    help='canonical -> file field names, e.g. \'{"instruction": "question", "output": "answer"}\'')
  data.add_argument("--format", default="auto", help="record format (default: auto-detect)")
  data.add_argument("--train-on", default="all_assistant", choices=TRAIN_ON,
                    help="all_assistant: every reply is trained; last: only the final one")
  data.add_argument("--on-error", default=on_error, choices=ON_ERROR,
                    help="raise (the first bad record is an error) or skip (bad records are counted and left "
                         "out); default: %(default)s")
  data.add_argument("--cache-dir", default=None, help="token store folder (default: $JAXSFT_CACHE/tokens, ~/.cache/jaxsft/tokens)")
  data.add_argument("--no-cache", action="store_true", help="tokenize in memory, without the token store")


def build_parser() -> argparse.ArgumentParser:
  from jaxsft.cli import HelpFormatter

  parser = argparse.ArgumentParser(prog="jaxsft data", description=__doc__.split("\n")[0],
                                   formatter_class=HelpFormatter)
  sub = parser.add_subparsers(dest="command", required=True)
  build = sub.add_parser("build", formatter_class=HelpFormatter, help="tokenize a data file into its token store (or find it)")
  _data_arguments(build, max_length=512, on_error="raise")  # the trainer's defaults: it finds this store
  stats = sub.add_parser("stats", formatter_class=HelpFormatter, help="length histogram and padded tokens per batching mode")
  _data_arguments(stats, max_length=1024, on_error="skip")
  priced = stats.add_argument_group("the batching it prices")
  priced.add_argument("--buckets", type=int, default=8, help="number of buckets to choose (default: %(default)s)")
  priced.add_argument("--batch-size", type=int, default=8, help="rows per batch (default: %(default)s)")
  priced.add_argument("--pad-to-multiple-of", type=int, default=8,
                      help="batch widths are rounded up to a multiple of this (default: %(default)s)")
  priced.add_argument("--epochs", type=float, default=1.0, help="epochs the predicted seconds cover (default: %(default)s)")
  priced.add_argument("--cost-from", default=None, metavar="RUN_DIR",
                      help="price steps and compiles with the cost the run in RUN_DIR measured (its summary.json); "
                           "default: the built-in default cost")
  return parser


def parse_args(argv=None) -> argparse.Namespace:
  parser = build_parser()
  args = parser.parse_args(argv)
  if args.command == "build" and args.no_cache:
    parser.error("build writes the token store: --no-cache does not apply")
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

  from jaxsft import errors

  return errors.run_cli(lambda: _main(args))


def _main(args) -> int:
  from jaxsft.data.records import DataError
  from jaxsft.models.hub import load_tokenizer

  tokenizer = load_tokenizer(args.model, chat_template=args.chat_template)
  try:
    if args.command == "stats":
      args.cost = _cost(args.cost_from)
    records, tokenized, result, skipped = _tokenized(args, tokenizer)
  except DataError as e:
    raise (e.with_skip_hint("--on-error skip") if args.on_error == "raise" else e) from None
  except ValueError as e:  # a setting the tokenizer or batching refuses (e.g. a bad --format)
    raise DataError(str(e)) from None
  if args.command == "build":
    from jaxsft.data.store import describe

    info = describe(result)
    print(f"token store: {info['store']} ({'built' if info['built'] else 'found'} in {info['seconds']:.2f}s)")
    print(f"{result.store.summary()}")
    print(f"{info['bytes'] / 2**20:.1f} MiB on disk")
    return 0
  return _stats(args, tokenizer, records, tokenized, skipped)


def _tokenized(args, tokenizer):
  """(records, TokenizedRecords, StoreResult or None, the skipped records ({reason: count}, the first
  three's (where, reason))), from the store unless --no-cache."""
  settings = dict(max_length=args.max_length, train_on=args.train_on, fmt=args.format, field_map=args.field_map,
                  on_error=args.on_error)
  if args.no_cache:
    from jaxsft.data.records import SkipReport
    from jaxsft.data.tokenize import tokenize_file

    report = SkipReport()
    records, tokenized = tokenize_file(tokenizer, args.data, report=report, **settings)
    return records, tokenized, None, (report.reasons(), report.skipped[:3])
  from jaxsft.data.store import open_or_build

  result = open_or_build(args.data, tokenizer, cache_dir=args.cache_dir, **settings)
  m = result.store.manifest
  return result.store.records(), result.store.tokenized(), result, (m["skip_reasons"], m["first_skipped"])


def _cost(run_dir: str | None):
  """The cost a run measured (summary.json's collation.cost), else the default."""
  from jaxsft.collation.cost import DEFAULT_COST, StepCost

  if run_dir is None:
    return DEFAULT_COST
  from jaxsft.run_files import RunFiles

  path = RunFiles(run_dir, writer=False).summary
  try:
    fields = json.loads(path.read_text())["collation"]["cost"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ValueError(f"--cost-from: {path} holds no collation cost ({type(e).__name__}: {e})") from None
  return StepCost(**{**fields, "source": f"{fields.get('source', 'measured')} in {run_dir}"})


def _stats(args, tokenizer, records, tokenized, skipped: tuple[dict[str, int], list]) -> int:
  # The command, not the data library, reaches up to the collation package for the plans and their seconds.
  from jaxsft.collation.compare import compare_batching, format_comparison, predict_seconds
  from jaxsft.data.records import skip_lines
  from jaxsft.data.stats import length_summary, text_histogram

  summary = length_summary(tokenized)
  reasons, first = skipped
  template = f", chat template {args.chat_template}" if args.chat_template else ""
  print(f"{args.data}: {len(records)} records ({sum(reasons.values())} skipped), tokenizer {args.model}{template}")
  for line in skip_lines(reasons, first):  # what --on-error raise would stop at
    print(line)
  print(f"tokens per example (before truncation): min {summary['min']}, p50 {summary['p50']:.0f}, "
        f"p90 {summary['p90']:.0f}, p99 {summary['p99']:.0f}, max {summary['max']}, mean {summary['mean']:.1f}")
  print(f"max_length {args.max_length}: {summary['truncated']} truncated, {summary['dropped']} dropped "
        "(no trained token left)\n")
  print(text_histogram(summary["lengths"], max_length=args.max_length))
  tokenized.require_trained("the records", path=args.data)  # the lengths above say by how much
  print(f"\nbatch size {args.batch_size}, one epoch, pad to a multiple of {args.pad_to_multiple_of}; "
        f"predicted seconds for {args.epochs:g} epoch(s), cost {args.cost.source}:")
  result = compare_batching(records, tokenizer, max_length=args.max_length, num_buckets=args.buckets,
                            batch_size=args.batch_size, pad_to_multiple_of=args.pad_to_multiple_of,
                            train_on=args.train_on, tokenized=tokenized)
  print(format_comparison(result, predict_seconds(result, args.cost, epochs=args.epochs)))
  from jaxsft.collation.plans import choose_collation
  from jaxsft.data.collate import round_up

  longest = min(args.max_length, round_up(int(tokenized.lengths.max()), args.pad_to_multiple_of))  # as the trainer
  candidates = choose_collation(tokenized.lengths, cost=args.cost, max_length=longest,
                                batch_size_for=lambda width: args.batch_size, pad_to_multiple_of=args.pad_to_multiple_of,
                                epochs=args.epochs, trained_tokens=result["static"]["trained"])
  best = candidates[0]
  print(f"batching: auto would choose {best.name} {best.batching.get('bucket_lengths') or ''}: predicted "
        f"{best.predicted.total:.1f}s ({best.predicted.steps:.1f}s steps + {best.predicted.compiles:.1f}s compiles); "
        f"next: " + ", ".join(f"{c.name} {c.predicted.total:.1f}s" for c in candidates[1:4]))
  return 0


if __name__ == "__main__":
  sys.exit(main())
