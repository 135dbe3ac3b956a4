"""`jaxsft train` and `python -m jaxsft.train`: the training command line.

The arguments are read and the config checked (`jaxsft.config.validate`: choices, ranges, the
rules between keys) before the trainer is imported, so `--help`, a mistyped key or a refused
value answers at once, without loading JAX, Flax or Grain; a run then imports the trainer
(`jaxsft.train.recipe.run_command`) once, in the process that trains.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

from jaxsft import config as config_lib
from jaxsft import config_args, errors, quiet


def main(argv: list[str] | None = None) -> int:
  """The command line in this process: parses and checks `argv` (argparse's help and usage
  errors exit here; a refused config is one `error:` line and status 2), trains, returns the
  exit status."""
  parsed = []

  def parse() -> None:
    cfg = config_args.parse_args(argv)
    config_lib.validate(cfg)
    parsed.append(cfg)

  status = errors.run_cli(parse)
  if not parsed:
    return status
  quiet.silence_library_noise()  # before the trainer's imports bring transformers in
  from jaxsft.train import recipe

  return recipe.run_command(parsed[0])


def exit_after_run(code: int) -> NoReturn:
  """Ends the process of a training command line with `code`."""
  if code:
    # A failed run has reported why and closed what it writes; what may be left are the failed
    # writer threads of orbax and tensorstore (a full disk), and tearing the interpreter down
    # beneath them can abort after the error line ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  sys.exit(code)
