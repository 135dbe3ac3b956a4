"""Stopping on SIGTERM and SIGINT (a preempted spot VM, a scheduler's time limit, Ctrl-C) without
losing the steps since the last `save_every`: `StopSignals` only notes the first signal; the loop
asks `requested()` at each step boundary, finishes the step it is on, saves a checkpoint (the data
position included) and ends with `stopped: "signal"`. A second signal, while that save runs,
ends the process at once: orbax publishes a checkpoint only when it is whole, so the newest whole
one is what `--resume` finds.

The handlers are the command line's (`jaxsft train` installs them); `jaxsft.train.train` called
from Python installs none unless asked (`stop_on_signals=True`): a program that embeds the trainer
keeps its own signal handling."""

from __future__ import annotations

import logging
import os
import signal
import threading

import jax
import numpy as np

log = logging.getLogger("jaxsft.train")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_status(signum: int) -> int:
  """What a shell reports for a process ended by `signum`: 128 + its number (SIGTERM 143, SIGINT 130)."""
  return 128 + signum


class StopSignals:
  """While installed (a context manager), SIGTERM and SIGINT ask the run to stop at the next step
  boundary (`received` holds the first one's number); the second ends the process at once with
  `exit_status` of it, saving nothing more. On leaving, the handlers that were there come back.

  Handlers can only be installed from the main thread: elsewhere this logs why and catches nothing.
  """

  def __init__(self):
    self.received: int | None = None  # the first signal this process caught
    self.stopping_on: int | None = None  # the signal the run stops on: this process's or another's
    self._previous: dict[int, object] = {}

  def __enter__(self) -> "StopSignals":
    if threading.current_thread() is not threading.main_thread():
      log.warning("not in the main thread: SIGTERM and SIGINT keep their handlers (no checkpoint on a signal)")
      return self
    for signum in STOP_SIGNALS:
      self._previous[signum] = signal.signal(signum, self._on_signal)
    return self

  def __exit__(self, *exc) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous.clear()

  def _on_signal(self, signum: int, frame) -> None:
    if self.received is None:
      self.received = signum
      log.warning("%s: finishing this step, then saving a checkpoint and stopping (send it again to stop at once; "
                  "--resume then starts from the newest whole checkpoint)", signal.Signals(signum).name)
      return
    # The second signal: the user (or the scheduler) wants the process gone now. No cleanup runs;
    # a checkpoint being written stays an unpublished temporary folder, which orbax never reads as a step.
    os.write(2, f"{signal.Signals(signum).name} again: stopping at once without finishing the checkpoint\n".encode())
    os._exit(exit_status(signum))

  def requested(self) -> bool:
    """Whether to stop at this step boundary. With several processes a collective: every process
    calls it at the same boundary and all get the same answer (one signalled process stops all of
    them at the same step, so every process saves the same checkpoint)."""
    if jax.process_count() == 1:
      self.stopping_on = self.received
    else:
      from jax.experimental import multihost_utils

      caught = np.asarray(multihost_utils.process_allgather(np.int32(self.received or 0))).ravel()
      caught = caught[caught > 0]
      self.stopping_on = int(caught[0]) if caught.size else None
    return self.stopping_on is not None

  def signal_name(self) -> str | None:
    """The name of the signal the run stops on (another process's, with several)."""
    return None if self.stopping_on is None else signal.Signals(self.stopping_on).name


class NoStopSignals(StopSignals):
  """A run that catches no signal (the library default): never asked to stop. Every process of a
  run calls `train` alike, so none of them waits in `requested`'s collective for another."""

  def __enter__(self) -> "NoStopSignals":
    return self

  def requested(self) -> bool:
    return False
