"""SIGTERM and SIGINT during `jaxsft train` (a preempted machine, a scheduler's time limit,
Ctrl-C): the step in flight is finished, a checkpoint saved with the data position, the summary
says `stopped: "signal"` and the exit status is the shell's for the signal (143, 130); a second
signal during that save ends the process at once with the last whole checkpoint kept. `--resume`
afterwards gives the losses of an uninterrupted run, bit for bit.

The signalled runs are real processes receiving real signals (tests/signal_runner.py places
them at chosen points); the reference and the resumed runs call `main` in this process."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from test_faults import tiny_model_dir, tiny_train_args  # noqa: F401 (a fixture)

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUNNER = ROOT / "tests" / "signal_runner.py"
COMMON = ("data.val_fraction=0", "--lr", "1e-3")
REFERENCE_STEPS = 8
EXACT = ("loss", "grad_norm", "lr", "tokens", "real_tokens", "valid_tokens", "epoch")
"""Per-step metrics a resumed run reproduces exactly (timings are not among them)."""


def step_records(run: pathlib.Path) -> list[dict]:
  lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  return [line for line in lines if "loss" in line]


def whole_checkpoints(run: pathlib.Path) -> list[int]:
  return sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())


def start_runner(args, **env) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, str(RUNNER), *map(str, args)], cwd=ROOT,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **env},
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):  # noqa: F811
  """An uninterrupted run of REFERENCE_STEPS steps (a constant rate: its first k steps are a k-step run's)."""
  from jaxsft import train

  out = tmp_path_factory.mktemp("preemption") / "reference"
  assert train.main(tiny_train_args(tiny_model_dir, out, *COMMON, f"max_steps={REFERENCE_STEPS}")) == 0
  return step_records(out)


def assert_resume_matches_reference(model_dir, run, reference, train_main, resumed_from: int) -> None:
  r = train_main(tiny_train_args(model_dir, run, *COMMON, f"max_steps={REFERENCE_STEPS}", "--resume"))
  assert r.returncode == 0, r.stderr[-3000:]
  assert f"resumed from step {resumed_from}" in r.stderr, r.stderr[-3000:]
  records = step_records(run)
  assert [x["step"] for x in records] == list(range(1, REFERENCE_STEPS + 1))
  for got, want in zip(records, reference):
    assert {k: got[k] for k in EXACT} == {k: want[k] for k in EXACT}, got["step"]  # bit for bit
  assert json.loads((run / "summary.json").read_text())["stopped"] == "completed"


@pytest.mark.slow  # one run in a fresh interpreter, a resume and the reference in this one
def test_sigterm_from_outside_saves_the_step_reached_and_resume_is_exact(tiny_model_dir, reference, tmp_path,  # noqa: F811
                                                                           train_main):
  run = tmp_path / "run"
  # Steps slowed to 0.3 s, so the signal (sent once step 2 is logged) lands mid-run; save_every=0:
  # the only checkpoint is the signal's.
  proc = start_runner(tiny_train_args(tiny_model_dir, run, *COMMON, "max_steps=1000", "save_every=0"), STEP_SLEEP="0.3")
  deadline = time.time() + 300
  while not ((run / "metrics.jsonl").exists() and any(r["step"] >= 2 for r in step_records(run))):
    assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 143, err[-3000:]
  assert "Traceback" not in err, err[-3000:]
  summary = json.loads((run / "summary.json").read_text())
  reached = summary["steps"]
  assert summary["stopped"] == "signal" and summary["signal"] == "SIGTERM", summary
  assert 2 <= reached < REFERENCE_STEPS, summary  # the step in flight finished, then no other
  assert summary["checkpoint_step"] == reached and whole_checkpoints(run) == [reached]
  assert [r["step"] for r in step_records(run)] == list(range(1, reached + 1))  # every step reached is logged
  assert "stopped by SIGTERM" in out
  assert_resume_matches_reference(tiny_model_dir, run, reference, train_main, resumed_from=reached)


@pytest.mark.slow  # one run in a fresh interpreter, and its resume
def test_a_second_sigint_during_the_save_stops_at_once_keeping_the_last_whole_checkpoint(
    tiny_model_dir, reference, tmp_path, train_main):  # noqa: F811
  run = tmp_path / "run"
  proc = start_runner(tiny_train_args(tiny_model_dir, run, *COMMON, "max_steps=1000", "save_every=3"),
                      SIGNAL_AT_STEP="4", SIGNAL="SIGINT", SECOND_SIGNAL_IN_SAVE="1")
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 130, err[-3000:]
  assert "SIGINT again: stopping at once" in err and "still running" not in err, err[-3000:]
  assert "Traceback" not in err, err[-3000:]
  assert not (run / "summary.json").exists()  # it stopped at once
  # Step 4's checkpoint was being written (its temporary folder is left): only step 3's is whole,
  # and the resume starts there.
  assert whole_checkpoints(run) == [3], list((run / "checkpoints").iterdir())
  assert any(p.name.startswith("4.orbax-checkpoint-tmp") for p in (run / "checkpoints").iterdir())
  assert_resume_matches_reference(tiny_model_dir, run, reference, train_main, resumed_from=3)


@pytest.mark.slow  # a short run in this process
def test_a_signal_right_after_a_scheduled_checkpoint_saves_nothing_twice(tiny_model_dir, reference, tmp_path,  # noqa: F811
                                                                         train_main, monkeypatch):
  """SIGTERM at step 3 of a run that checkpoints every 3 steps: that checkpoint is the one kept
  (no second save of the same step), and the run stops there; SIGTERM's own handler is back after."""
  from jaxsft.train import loop

  real = loop.train_step

  def signalled_at_3(run, state, batches):
    record = real(run, state, batches)
    if state.step == 3:
      os.kill(os.getpid(), signal.SIGTERM)
    return record

  monkeypatch.setattr(loop, "train_step", signalled_at_3)
  before = signal.getsignal(signal.SIGTERM)
  run = tmp_path / "run"
  r = train_main(tiny_train_args(tiny_model_dir, run, *COMMON, "max_steps=1000", "save_every=3"))
  assert r.returncode == 143, r.stderr[-3000:]
  assert signal.getsignal(signal.SIGTERM) is before
  summary = json.loads((run / "summary.json").read_text())
  assert (summary["stopped"], summary["steps"], summary["checkpoint_step"]) == ("signal", 3, 3)
  assert whole_checkpoints(run) == [3]
  assert [r["step"] for r in step_records(run)] == [1, 2, 3]
  monkeypatch.setattr(loop, "train_step", real)
  assert_resume_matches_reference(tiny_model_dir, run, reference, train_main, resumed_from=3)


def test_the_library_installs_no_handlers_unless_asked():
  """`train(cfg)` from Python keeps the caller's handlers; `StopSignals` puts them back on leaving."""
  import inspect

  from jaxsft.train import recipe
  from jaxsft.train.preemption import NoStopSignals, StopSignals

  assert inspect.signature(recipe.train).parameters["stop_on_signals"].default is False
  mine = lambda signum, frame: None  # noqa: E731
  previous = signal.signal(signal.SIGTERM, mine)
  try:
    with NoStopSignals() as stop:
      assert signal.getsignal(signal.SIGTERM) is mine
      assert not stop.requested()
    with StopSignals() as stop:
      assert signal.getsignal(signal.SIGTERM) is not mine
      os.kill(os.getpid(), signal.SIGTERM)
      assert stop.requested() and stop.signal_name() == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is mine
  finally:
    signal.signal(signal.SIGTERM, previous)


@pytest.mark.slow  # two trainer processes
def test_a_signal_to_one_of_two_processes_stops_both_at_the_same_step(tiny_model_dir, tmp_path):  # noqa: F811
  """Process 1 alone is signalled, after step 3: both processes stop after the same step, both
  save their part of that step's checkpoint (their data positions), both exit 143."""
  import socket

  import worker_threads

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  run = tmp_path / "run"
  args = tiny_train_args(tiny_model_dir, run, *COMMON, "max_steps=1000", "save_every=0")
  procs = []
  for pid in range(2):
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": worker_threads.xla_flags("--xla_force_host_platform_device_count=1"),
           "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(pid)}
    if pid == 1:
      env.update(SIGNAL_AT_STEP="3", SIGNAL="SIGTERM")
    procs.append(start_runner(args, **env))
  try:
    outputs = [p.communicate(timeout=400) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  assert [p.returncode for p in procs] == [143, 143], "\n=====\n".join(err[-4000:] for _, err in outputs)
  assert "stopping at step 3 on SIGTERM (another process's)" in outputs[0][1]
  assert "stopping at step 3 on SIGTERM" in outputs[1][1]
  summary = json.loads((run / "summary.json").read_text())  # process 0's
  assert (summary["stopped"], summary["signal"], summary["steps"], summary["checkpoint_step"]) == ("signal", "SIGTERM", 3, 3)
  assert whole_checkpoints(run) == [3]
  saved = sorted(p.name for p in (run / "checkpoints" / "3" / "data_iter").iterdir() if p.suffix == ".json")
  assert saved == ["process_0-of-2.json", "process_1-of-2.json"]
