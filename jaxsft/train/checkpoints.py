"""Orbax checkpoints of a `RunState` with the Grain iterator's position: `Checkpoints` saves them
and restores the newest one that restores whole, setting damaged ones aside;
`SavedIteratorState` carries the data position through grain's orbax handler, and
`drain_orbax_loops` keeps a failed restore or save from leaving reads or writes behind."""

from __future__ import annotations

import json
import logging
import os
import shutil

from jaxsft import io
from jaxsft import sharding as sharding_lib
from jaxsft.run_files import RunFiles
from jaxsft.train.state import RunState, TrainingError

log = logging.getLogger("jaxsft.train")


class SavedIteratorState:
  """What grain's orbax handler saves and restores: a Grain iterator state, as JSON."""

  def __init__(self, state=None):
    self.state = state

  def get_state(self) -> bytes:
    return json.dumps(self.state).encode()

  def set_state(self, raw: bytes):
    self.state = json.loads(raw)

  def start_prefetch(self):  # part of the iterator interface grain's handler may call
    pass


def drain_orbax_loops() -> None:
  """Lets a failed orbax restore or save finish its other reads or writes before orbax closes
  its event loop (installed once per process; a run that fails nothing behaves as before).

  Orbax runs a restore, and the array writes of a save (in its background thread), as one
  `asyncio.gather` on a fresh event loop, closed as soon as the gather returns. When one read or
  write fails (a damaged checkpoint, a full disk) the gather raises at once while the others are
  still running in tensorstore; each of those, on completion, schedules its callback on the
  closed loop and prints a "RuntimeError: Event loop is closed" traceback (one per array), and
  their coroutines print "Exception ignored" tracebacks when the interpreter exits. Here the loop
  first runs its remaining tasks to the end, then closes: same result, same exception, nothing
  left running.
  """
  import asyncio

  from orbax.checkpoint._src import asyncio_utils

  if getattr(asyncio_utils._run_sync_via_new_loop, "drains_pending_tasks", False):
    return

  def run_then_drain(coro):
    loop = asyncio.new_event_loop()
    try:
      asyncio.set_event_loop(loop)
      return loop.run_until_complete(coro)
    finally:
      pending = asyncio.all_tasks(loop)
      if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
      asyncio.set_event_loop(None)
      loop.close()

  run_then_drain.drains_pending_tasks = True
  asyncio_utils._run_sync_via_new_loop = run_then_drain


class _OrbaxFailureTracebacks(logging.Filter):
  """Drops orbax's ERROR records that carry a traceback: orbax logs a failed background save
  from each of its threads (four tracebacks for one full disk) and then raises the same error in
  the trainer, which reports it once (an `error:` line, or a traceback when it is a bug)."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not (record.exc_info and record.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname)


def quiet_orbax_failure_logs() -> None:
  """For the command line (a library user keeps orbax's logging as it is): installed once."""
  absl_logger = logging.getLogger("absl")
  if not any(isinstance(f, _OrbaxFailureTracebacks) for f in absl_logger.filters):
    absl_logger.addFilter(_OrbaxFailureTracebacks())


class Checkpoints:
  """Orbax checkpoints of a `RunState` under RUN_DIR/checkpoints/<step>.

  `restore_newest` falls back past damaged checkpoints: each one that does not restore whole
  (arrays, data position, scalars) is named in one line and moved to RUN_DIR/damaged_checkpoints/.
  """

  def __init__(self, files: RunFiles, keep: int):
    self.files, self.keep = files, keep
    drain_orbax_loops()
    self.manager = self._open()

  def _open(self):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(self.files.checkpoints.resolve(),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=self.keep, create=True))

  def save(self, state: RunState) -> None:
    import grain
    import orbax.checkpoint as ocp

    self.manager.save(state.step, args=ocp.args.Composite(
        state=ocp.args.StandardSave({"trainable": state.trainable, "opt_state": state.opt_state}),
        data_iter=grain.checkpoint.CheckpointSave(SavedIteratorState(state.data_state)),
        meta=ocp.args.JsonSave(state.scalars())))

  def _restore(self, step: int, template: RunState, restore_data_position) -> RunState:
    import grain
    import orbax.checkpoint as ocp

    holder = SavedIteratorState()
    key = self._trainable_key(step)
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore({key: template.trainable, "opt_state": template.opt_state}),
        data_iter=grain.checkpoint.CheckpointRestore(holder), meta=ocp.args.JsonRestore()))
    restore_data_position(holder.state)
    scalars = {k: v for k, v in restored["meta"].items() if k in RunState.SCALARS}
    return RunState(trainable=restored["state"][key], opt_state=restored["state"]["opt_state"], step=step,
                    data_state=holder.state, **scalars)

  def _trainable_key(self, step: int) -> str:
    """The name the trainable params were saved under: "trainable", or "lora" in a checkpoint
    written before full fine-tuning shared the name (a run started by an older jaxsft resumes)."""
    import orbax.checkpoint as ocp

    saved = ocp.StandardCheckpointHandler().metadata(self.files.checkpoints.resolve() / str(step) / "state")
    return "lora" if "lora" in saved.keys() else "trainable"

  def restore_newest(self, template: RunState, restore_data_position) -> RunState | None:
    """The newest checkpoint that restores whole; None when there is none at all."""
    steps = sorted(self.manager.all_steps(), reverse=True)
    damaged = []
    for step in steps:
      try:
        state = self._restore(step, template, restore_data_position)
      except Exception as e:  # orbax, tensorstore, JSON and Grain each raise their own
        reason = (str(e).strip().splitlines() or [""])[0][:200]
        log.warning("checkpoint %s is damaged (%s: %s); trying an older one",
                    self.files.checkpoints / str(step), type(e).__name__, reason)
        damaged.append(step)
        continue
      self._set_aside(damaged)
      return state
    if steps:
      raise TrainingError(f"--resume: none of the checkpoints in {self.files.checkpoints} (steps "
                          f"{sorted(steps)}) restores whole; start a fresh run in another --output-dir")
    return None

  def _set_aside(self, steps: list[int]) -> None:
    """Moves damaged checkpoints out of the manager's folder (kept for inspection)."""
    if steps and self.files.writer:
      aside = self.files.damaged_checkpoints
      aside.mkdir(exist_ok=True)
      for step in steps:
        target = aside / str(step)
        shutil.rmtree(target, ignore_errors=True)
        io.rename_over(self.files.checkpoints / str(step), target)
        log.warning("moved damaged checkpoint %d to %s", step, target)
    if steps:
      sharding_lib.barrier("jaxsft: damaged checkpoints set aside")
      self.manager.close()
      self.manager = self._open()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
