"""`jaxsft doctor RUN_DIR`: the diagnosis of a run directory's metrics.jsonl."""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
from typing import Sequence

from jaxsft import errors, run_files
from jaxsft.doctor.rules import Diagnosis, diagnose


def diagnose_run(run_dir: str | pathlib.Path) -> Diagnosis:
  """The diagnosis of RUN_DIR/metrics.jsonl (or of that file)."""
  m = run_files.read_metrics(run_dir)
  return diagnose(m.train_steps, m.train_loss, val_steps=m.val_steps or None,
                  val_loss=m.val_loss or None, steps_per_epoch=m.steps_per_epoch,
                  grad_norm=m.train_grad_norm if len(m.train_grad_norm) == len(m.train_steps) else None,
                  vocab_size=m.vocab_size, learning_rate=m.train_lr or None)


def build_parser() -> argparse.ArgumentParser:
  from jaxsft.cli import HelpFormatter, add_run_dir

  parser = argparse.ArgumentParser(
      prog="jaxsft doctor", formatter_class=HelpFormatter,
      description="Classify a run's loss curve (RUN_DIR/metrics.jsonl) and print the likely "
                  "cause and the fix.")
  add_run_dir(parser, help="a run folder written by jaxsft train (its metrics.jsonl is read), or a metrics.jsonl")
  parser.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
  return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  return build_parser().parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  def body():
    try:
      diagnosis = diagnose_run(args.run_dir)
    except FileNotFoundError as e:  # read_metrics names the run folder
      raise run_files.MetricsError(str(e)) from None
    print(json.dumps(dataclasses.asdict(diagnosis), indent=2) if args.json else diagnosis.report())

  return errors.run_cli(body)
