"""Orbax checkpoints of a `RunState` with the Grain iterator's position: `Checkpoints` saves them
and restores the newest one that restores whole, setting damaged ones aside;
`SavedIteratorState` carries the data position through grain's orbax handler, and
`_drain_orbax_loop_on_failure` keeps a failed restore from leaving reads behind."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil

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


@contextlib.contextmanager
def _drain_orbax_loop_on_failure():
  """Lets a failed orbax restore finish its other reads before orbax closes its event loop.

  Orbax runs a restore as one `asyncio.gather` of every array read on a fresh event loop, closed
  as soon as the gather returns. When one read fails (a damaged checkpoint) the gather raises at
  once while the other reads are still running in tensorstore; each of those, on completion,
  schedules its callback on the closed loop and prints a "RuntimeError: Event loop is closed"
  traceback (one per array). Here the loop first runs its remaining tasks to the end, then closes:
  same result, same exception, no orphaned reads.
  """
  import asyncio

  from orbax.checkpoint._src import asyncio_utils

  original = asyncio_utils._run_sync_via_new_loop

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

  asyncio_utils._run_sync_via_new_loop = run_then_drain
  try:
    yield
  finally:
    asyncio_utils._run_sync_via_new_loop = original


class Checkpoints:
  """Orbax checkpoints of a `RunState` under RUN_DIR/checkpoints/<step>.

  `restore_newest` falls back past damaged checkpoints: each one that does not restore whole
  (arrays, data position, scalars) is named in one line and moved to RUN_DIR/damaged_checkpoints/.
  """

  def __init__(self, files: RunFiles, keep: int):
    self.files, self.keep = files, keep
    self.manager = self._open()

  def _open(self):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(self.files.checkpoints.resolve(),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=self.keep, create=True))

  def save(self, state: RunState) -> None:
    import grain
    import orbax.checkpoint as ocp

    self.manager.save(state.step, args=ocp.args.Composite(
        state=ocp.args.StandardSave({"lora": state.lora, "opt_state": state.opt_state}),
        data_iter=grain.checkpoint.CheckpointSave(SavedIteratorState(state.data_state)),
        meta=ocp.args.JsonSave(state.scalars())))

  def _restore(self, step: int, template: RunState, restore_data_position) -> RunState:
    import grain
    import orbax.checkpoint as ocp

    holder = SavedIteratorState()
    with _drain_orbax_loop_on_failure():
      restored = self.manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore({"lora": template.lora, "opt_state": template.opt_state}),
          data_iter=grain.checkpoint.CheckpointRestore(holder), meta=ocp.args.JsonRestore()))
    restore_data_position(holder.state)
    scalars = {k: v for k, v in restored["meta"].items() if k in RunState.SCALARS}
    return RunState(lora=restored["state"]["lora"], opt_state=restored["state"]["opt_state"], step=step,
                    data_state=holder.state, **scalars)

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
      aside = self.files.dir / "damaged_checkpoints"
      aside.mkdir(exist_ok=True)
      for step in steps:
        target = aside / str(step)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(self.files.checkpoints / str(step), target)
        log.warning("moved damaged checkpoint %d to %s", step, target)
    if steps:
      sharding_lib.barrier("jaxsft: damaged checkpoints set aside")
      self.manager.close()
      self.manager = self._open()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
