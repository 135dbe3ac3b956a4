"""The recipe, read top to bottom: `train` sets the run up (`setup`, `start_or_resume`), runs the
loop (`run_loop`, `end_of_run`) and finishes (`finish`), returning a `RunResult`; `run_command` is
the command line's run of a config `jaxsft.train.command` has parsed."""

from __future__ import annotations

import logging
import signal

import jax
from flax import nnx

from jaxsft import config as config_lib
from jaxsft import errors
from jaxsft import sharding as sharding_lib
from jaxsft.models.decoder import with_layers_unpacked
from jaxsft.train import finished
from jaxsft.train.checkpoints import quiet_orbax_failure_logs
from jaxsft.train.loop import STOPPED_BY_SIGNAL, STOPPED_EARLY, end_of_run, run_loop, save_on_signal
from jaxsft.train.prefetch import DevicePrefetch
from jaxsft.train.preemption import NoStopSignals, StopSignals, exit_status
from jaxsft.train.report import finish, finish_stopped, log_to_stderr
from jaxsft.train.startup import Run, setup, start_or_resume
from jaxsft.train.state import RunResult, RunState


def train(cfg: config_lib.TrainConfig, *, stop_on_signals: bool = False) -> RunResult:
  """Trains as `cfg` says and returns how the run ended.

  `stop_on_signals`: SIGTERM and SIGINT during the steps finish the step in flight, save a
  checkpoint and end the run with `RunResult.stopped == "signal"` (a second signal ends the
  process at once); see `jaxsft.train.preemption`. Off by default, so a program that calls
  `train` keeps its own handlers (Ctrl-C then raises KeyboardInterrupt as usual); the command
  line turns it on. It needs the main thread.
  """
  config_lib.validate(cfg)  # a config built in code is checked as the command line's is
  try:
    run, state = setup(cfg)
  except finished.AlreadyFinished as done:  # --resume of a run with nothing left to train
    return finished.report(cfg, done)
  try:
    return _train(run, state, StopSignals() if stop_on_signals else NoStopSignals())
  finally:
    run.files.unlock()


def _train(run: Run, state: RunState, stop: StopSignals) -> RunResult:
  run, state, iterator = start_or_resume(run, state)
  try:
    return train_and_finish(run, state, iterator, stop)
  finally:
    run.trackers.close()


def train_and_finish(run: Run, state: RunState, iterator, stop: StopSignals | None = None) -> RunResult:
  stop = stop or NoStopSignals()
  batches = DevicePrefetch(iterator, run.mesh.put_batch, stats=run.data.stats)
  try:
    # The handlers are in place from step 1 to the last checkpoint: before, nothing is lost by
    # stopping at once; after, a signal ends the finishing work (plot, evaluation) as usual.
    with stop:
      stopped = run_loop(run, state, batches, stop)
      if stopped != STOPPED_BY_SIGNAL:
        end_of_run(run, state)
        if stop.requested():  # the signal came during the last validation or checkpoint: both are done
          stopped = STOPPED_BY_SIGNAL
      else:
        save_on_signal(run, state)
      run.checkpoints.manager.wait_until_finished()  # the run stops only once its checkpoint is whole
      # Asked of every process alike: with several, orbax answers with a collective.
      newest_checkpoint = run.checkpoints.manager.latest_step()
  finally:
    batches.close()
    run.checkpoints.close()
  result = RunResult(str(run.files.dir), state.step, state.last_loss, state.val_loss, state.first_val_loss,
                     run.compiles_warmup, run.steps.recompiles, stopped == STOPPED_EARLY, stopped=stopped,
                     stop_signal=stop.signal_name() if stopped == STOPPED_BY_SIGNAL else None)
  if stopped == STOPPED_BY_SIGNAL:
    # A preempted machine has seconds left: no plot, doctor or evaluation, only the summary.
    finish_stopped(run, state, result, newest_checkpoint)
    # The command line then exits at once (no interpreter teardown): no process may leave while
    # another is still in a collective of the save, or that one aborts on the missing peer.
    sharding_lib.barrier("jaxsft: stopped on a signal")
    return result
  trainable, frozen = state.trainable, run.frozen
  if jax.process_count() > 1:
    # Process 0 finishes alone (plot, doctor, generation) on a local copy of the gathered weights.
    trainable, frozen = sharding_lib.to_host((trainable, frozen))
    if not run.files.writer:
      return result
  finish(run, state, result, nnx.merge(run.graphdef, trainable, with_layers_unpacked(frozen)))
  return result


def run_command(cfg: config_lib.TrainConfig) -> int:
  """The training command line's run of a parsed `cfg` (`jaxsft.train.command.main`): logs to
  stderr, stops cleanly on SIGTERM and SIGINT, returns the exit status (a refusal: one `error:`
  line and 2)."""
  quiet_orbax_failure_logs()
  log_to_stderr()

  def run() -> int:
    if cfg.logging.quiet:  # errors only
      cfg.progress = False
      logging.getLogger("jaxsft").setLevel(logging.ERROR)
    result = train(cfg, stop_on_signals=True)
    if result.stopped == STOPPED_BY_SIGNAL:  # what the shell reports for a process the signal ended
      return exit_status(signal.Signals[result.stop_signal])
    return 0

  return errors.run_cli(run)
