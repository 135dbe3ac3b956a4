"""A `--resume` of a run that has already finished: the run folder's summary says it completed
(or stopped early) at its newest checkpoint, with the settings asked for now. Nothing is loaded,
compiled or written again; the closing summary is shown as the run wrote it. A job script that
always passes `--resume` can then be rerun after the run ended, and a `--resume` with other
settings (a higher `max_steps`, more `epochs`) goes on training as before."""

from __future__ import annotations

import json
import logging

import jax

from jaxsft import config as config_lib
from jaxsft.run_files import RunFiles
from jaxsft.train.state import RunResult

log = logging.getLogger("jaxsft.train")

RERUN_MAY_CHANGE = ("resume", "output_dir", "progress", "logging.quiet", "logging.json")
"""Config keys a rerun may give otherwise without changing what the run trains: how the process
reports, and how it spells the folder whose config.json is read."""

FINISHED = ("completed", "early_stopping")
"""summary.json's `stopped` of a run with nothing left to train (a signal's stop is resumed)."""


class AlreadyFinished(Exception):
  """`setup` found a finished run (`finished_summary`); `report` shows it."""

  def __init__(self, files: RunFiles, summary: dict):
    super().__init__(f"{files.dir}: finished at step {summary['steps']}")
    self.files, self.summary = files, summary


def _settings(tree: dict) -> dict:
  """The config tree (as config.json holds it) without `RERUN_MAY_CHANGE`."""
  tree = json.loads(json.dumps(tree, default=str))  # tuples as lists, as the file has them
  for key in RERUN_MAY_CHANGE:
    *parents, leaf = key.split(".")
    node = tree
    for part in parents:
      node = node.get(part, {})
    node.pop(leaf, None)
  return tree


def finished_summary(cfg: config_lib.TrainConfig, files: RunFiles) -> dict | None:
  """summary.json of the run in `files.dir` when `cfg.resume` asks to go on with a run that has
  nothing left to train: it finished (`FINISHED`) at its newest checkpoint, its tuned weights are
  there, and config.json holds `cfg`'s settings. None otherwise, and with several processes (they
  decide together, in `setup`)."""
  if not cfg.resume or jax.process_count() > 1:
    return None
  try:
    summary = json.loads(files.summary.read_text())
    stored = json.loads(files.config.read_text())
  except (OSError, ValueError):
    return None
  if not isinstance(summary, dict) or not isinstance(stored, dict) or summary.get("stopped") not in FINISHED:
    return None
  tuned = files.tuned(stored.get("mode") == "full")
  if summary.get("steps") != max(files.checkpoint_steps(), default=None) or not tuned.is_dir():
    return None
  return summary if _settings(stored) == _settings(config_lib.to_dict(cfg)) else None


def report(cfg: config_lib.TrainConfig, done: AlreadyFinished) -> RunResult:
  """Logs that nothing is left to train, prints the run's closing summary as its finish did (the
  doctor's verdict read again from metrics.jsonl) and returns the run's result."""
  from jaxsft import doctor
  from jaxsft.train.report import summary_text

  files, summary = done.files, done.summary
  log.info("%s finished at step %d (%s); nothing left to train: a higher max_steps or more epochs "
           "with --resume goes on", files.dir, summary["steps"], summary["stopped"])
  evaluation = json.loads(files.evaluation.read_text()) if files.evaluation.is_file() else None
  result = RunResult(str(files.dir), summary["steps"], summary.get("final_loss"), summary.get("val_loss"),
                     summary.get("first_val_loss"), summary.get("warmup_compiles", 0), summary.get("recompiles", 0),
                     summary["stopped"] == "early_stopping", diagnosis=doctor.diagnose_run(files.dir),
                     evaluation=evaluation, stopped=summary["stopped"])
  if cfg.logging.json:
    print(json.dumps(summary, default=str), flush=True)
  elif not cfg.logging.quiet:
    print(summary_text(files, summary, result), flush=True)
  return result
