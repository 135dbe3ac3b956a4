"""The recipe, read top to bottom: `train` sets the run up (`setup`, `start_or_resume`), runs the
loop (`run_loop`, `end_of_run`) and finishes (`finish`), returning a `RunResult`; `main` is the
command line, `python -m jaxsft.train`."""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

import jax
from flax import nnx

from jaxsft import config as config_lib
from jaxsft import errors
from jaxsft import sharding as sharding_lib
from jaxsft.train.checkpoints import quiet_orbax_failure_logs
from jaxsft.train.loop import end_of_run, run_loop
from jaxsft.train.prefetch import DevicePrefetch
from jaxsft.train.report import finish, log_to_stderr
from jaxsft.train.startup import Run, setup, start_or_resume
from jaxsft.train.state import RunResult, RunState


def train(cfg: config_lib.TrainConfig) -> RunResult:
  run, state = setup(cfg)
  try:
    return _train(run, state)
  finally:
    run.files.unlock()


def _train(run: Run, state: RunState) -> RunResult:
  state, iterator = start_or_resume(run, state)
  try:
    return train_and_finish(run, state, iterator)
  finally:
    run.trackers.close()


def train_and_finish(run: Run, state: RunState, iterator) -> RunResult:
  batches = DevicePrefetch(iterator, run.mesh.put_batch, stats=run.data.stats)
  try:
    stopped_early = run_loop(run, state, batches)
    end_of_run(run, state)
  finally:
    batches.close()
    run.checkpoints.close()
  result = RunResult(str(run.files.dir), state.step, state.last_loss, state.val_loss, state.first_val_loss,
                     run.compiles_warmup, run.steps.recompiles, stopped_early)
  trainable, frozen = state.trainable, run.frozen
  if jax.process_count() > 1:
    # Process 0 finishes alone (plot, doctor, generation) on a local copy of the gathered weights.
    trainable, frozen = sharding_lib.to_host((trainable, frozen))
    if not run.files.writer:
      return result
  finish(run, result, nnx.merge(run.graphdef, trainable, frozen))
  return result


def main(argv: list[str] | None = None) -> int:
  from jaxsft import quiet

  quiet.silence_library_noise()
  quiet_orbax_failure_logs()
  log_to_stderr()

  def run() -> None:
    cfg = config_lib.parse_args(argv)
    if cfg.logging.quiet:  # errors only
      cfg.progress = False
      logging.getLogger("jaxsft").setLevel(logging.ERROR)
    train(cfg)

  return errors.run_cli(run)


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
