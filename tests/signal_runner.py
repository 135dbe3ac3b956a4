"""`python -m jaxsft.train` with hooks that place real signals at chosen points (run as a script).

    python tests/signal_runner.py [TRAIN ARGS...]

The signals are real (`os.kill` of this process, or the test's from outside); only where they
land is arranged, through the environment:

  SIGNAL_AT_STEP=N, SIGNAL=SIGTERM|SIGINT  the process signals itself once step N is dispatched
  SECOND_SIGNAL_IN_SAVE=1                  and again from inside the save of step N's checkpoint,
                                           once orbax is writing it (its temporary folder exists)
  STEP_SLEEP=S                             each step takes S seconds more, so that a signal sent
                                           from outside lands mid-run
"""

import os
import signal
import sys
import time

from jaxsft.train import checkpoints, loop
from jaxsft.train.command import exit_after_run, main


def signal_at_step(step: int, signum: int) -> None:
  real = loop.train_step

  def train_step(run, state, batches):
    record = real(run, state, batches)
    if state.step == step:
      os.kill(os.getpid(), signum)
    return record

  loop.train_step = train_step


def second_signal_mid_save(step: int, signum: int) -> None:
  """Grain's handler reads the data position while orbax writes the checkpoint into its
  temporary folder: the signal comes then, the arrays possibly half written."""
  real = checkpoints.SavedIteratorState.get_state

  def get_state(self):
    if self.state is not None and current_save_step[0] == step:
      os.kill(os.getpid(), signum)
      time.sleep(5)  # the handler ends the process; never reached when it works
      sys.stderr.write("signal_runner: still running 5 s after the second signal\n")
    return real(self)

  real_save = checkpoints.Checkpoints.save
  current_save_step = [None]

  def save(self, state):
    current_save_step[0] = state.step
    return real_save(self, state)

  checkpoints.SavedIteratorState.get_state = get_state
  checkpoints.Checkpoints.save = save


def slow_steps(seconds: float) -> None:
  real = loop.train_step

  def train_step(run, state, batches):
    time.sleep(seconds)
    return real(run, state, batches)

  loop.train_step = train_step


if __name__ == "__main__":
  env = os.environ
  if env.get("STEP_SLEEP"):
    slow_steps(float(env["STEP_SLEEP"]))
  if env.get("SIGNAL_AT_STEP"):
    signum = signal.Signals[env.get("SIGNAL", "SIGTERM")]
    signal_at_step(int(env["SIGNAL_AT_STEP"]), signum)
    if env.get("SECOND_SIGNAL_IN_SAVE"):
      second_signal_mid_save(int(env["SIGNAL_AT_STEP"]), signum)
  exit_after_run(main(sys.argv[1:]))
