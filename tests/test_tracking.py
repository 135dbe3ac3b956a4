"""What a user watches a run with: TensorBoard event files (read back with TensorBoard's own
reader), a W&B offline run, and the closing summary on stdout."""

import glob
import json
import logging
import os
import pathlib
import re
import signal
import struct
import subprocess
import sys
import time

import pytest

from hide_torch import PRELUDE
from test_train import DETERMINISTIC, ROOT, base_args, read_metrics, run_cli

from jaxsft import tracking

ALWAYS = ("loss", "lr", "grad_norm", "tokens", "real_tokens", "valid_tokens", "padding_fraction", "tokens_per_s",
          "valid_tokens_per_s", "data_wait_s", "seconds", "flops_per_s")
"""Scalars every step logs (a CPU has no known peak, so no `mfu` unless --peak-flops is given)."""


def metric_lines(run):
  return [json.loads(line) for line in (pathlib.Path(run) / "metrics.jsonl").read_text().splitlines()]


def event_scalars(run) -> tuple[dict[str, list[tuple[int, float]]], list[str]]:
  """{tag: [(step, value), ...]} and the text tags, as TensorBoard's reader shows the run."""
  from tensorboard.backend.event_processing import event_accumulator

  acc = event_accumulator.EventAccumulator(str(pathlib.Path(run) / "tensorboard"),
                                           size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0})
  acc.Reload()
  scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
  return scalars, acc.Tags()["tensors"]


def assert_events_equal_metrics(run, steps: int, extra=()):
  """Every step's scalars once, in step order, equal to metrics.jsonl's values (float32)."""
  scalars, texts = event_scalars(run)
  lines = metric_lines(run)
  train = {l["step"]: l for l in lines if "loss" in l}
  assert sorted(train) == list(range(1, steps + 1))
  for key in ALWAYS + tuple(extra):
    series = scalars[tracking.tag(key)]
    assert [s for s, _ in series] == list(range(1, steps + 1)), key  # each step once, monotone
    for step, value in series:
      assert value == pytest.approx(train[step][key], rel=1e-6, abs=1e-9), (key, step)
  val = [(l["step"], l["val_loss"]) for l in lines if "val_loss" in l]
  assert [s for s, _ in scalars["eval/val_loss"]] == [s for s, _ in val]
  assert [v for _, v in scalars["eval/val_loss"]] == pytest.approx([v for _, v in val], rel=1e-6)
  assert any(t.startswith("config") for t in texts)
  return scalars, texts


@pytest.mark.slow  # the killed run and its resume in fresh interpreters, as a user meets them
def test_killed_run_resumes_to_the_same_metrics_and_event_files(tiny_dir, small_data, tmp_path, train_main):
  steps = ["max_steps=12", "save_every=3", "eval.eval_every=4", "eval.num_prompts=2", "eval.max_new_tokens=2",
           "--peak-flops", "1e12"]
  ref = tmp_path / "uninterrupted"  # the reference: nothing about it needs a fresh interpreter
  r = train_main(base_args(tiny_dir, small_data, ref, *steps))
  assert r.returncode == 0, r.stderr[-3000:]
  run = tmp_path / "killed"
  proc = run_cli(base_args(tiny_dir, small_data, run, *steps), wait=False)
  deadline = time.time() + 300
  # Kill once step 7 is logged (a step's events are flushed before the next step's line):
  # checkpoints at steps 3 and 6, metrics and events past the last one.
  while time.time() < deadline:
    if (run / "metrics.jsonl").exists() and any(l.get("step", 0) >= 7 for l in metric_lines(run)):
      break
    assert proc.poll() is None, proc.stdout.read()
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert not (run / "summary.json").exists()
  before, _ = event_scalars(run)
  resumed = run_cli(base_args(tiny_dir, small_data, run, *steps, "--resume"))
  assert resumed.returncode == 0, resumed.stderr
  restored = int(re.search(r"resumed from step (\d+)", resumed.stderr).group(1))
  assert max(s for s, _ in before["train/loss"]) > restored  # the killed run logged steps the resume redid

  # The metrics of the uninterrupted run, step for step.
  (ref_train, ref_val, _), (res_train, res_val, _) = read_metrics(ref), read_metrics(run)
  assert [l["step"] for l in res_train] == list(range(1, 13))
  for a, b in zip(ref_train, res_train):
    for key in DETERMINISTIC:
      assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["step"], key)
  assert [(l["step"], round(l["val_loss"], 6)) for l in ref_val] == [(l["step"], round(l["val_loss"], 6)) for l in res_val]
  # The epoch average covers the steps before the kill too (its sums travel in the checkpoint).
  epochs = lambda run: [(l["step"], l["epoch"], round(l["epoch_loss"], 6)) for l in read_metrics(run)[2] if "epoch_loss" in l]
  assert epochs(ref) and epochs(ref) == epochs(run)

  # The event files: each step once (the redone steps hidden), equal to metrics.jsonl.
  assert len(glob.glob(str(run / "tensorboard" / "events.out.tfevents.*"))) == 2  # one file per process
  scalars, texts = assert_events_equal_metrics(run, 12, extra=("mfu",))
  for step, mfu in scalars["train/mfu"]:  # MFU against the given peak: FLOP/s over 1e12 (4 digits each)
    assert mfu == pytest.approx(dict(scalars["train/flops_per_s"])[step] / 1e12, rel=2e-3)
  assert {"doctor/text_summary", "samples/text_summary"} <= set(texts)
  summary = json.loads((run / "summary.json").read_text())
  assert summary["flops_per_s"] > 0 and 0 < summary["mfu"] and summary["model_flops_per_step"] > 0


@pytest.mark.slow
def test_stdout_holds_the_summary_alone_and_a_missing_wandb_is_one_warning(tiny_dir, small_data, tmp_path):
  """`python -m jaxsft.train ... > out.txt`: the summary in out.txt, logs on stderr. W&B asked for
  but not installed: one warning line and a normal run."""
  run = tmp_path / "run"
  # wandb neither found (transformers asks importlib) nor importable, as when it is not installed
  hide_wandb = PRELUDE.replace('"torch"', '"wandb"').replace('"torch."', '"wandb."') + (
      "import runpy\nrunpy.run_module('jaxsft.train', run_name='__main__')\n")
  out, err = tmp_path / "out.txt", tmp_path / "err.txt"
  with open(out, "w") as stdout, open(err, "w") as stderr:
    r = subprocess.run([sys.executable, "-c", hide_wandb,
                        *base_args(tiny_dir, small_data, run, "max_steps=4", "eval.eval_every=0", "eval.generate=false",
                                   "logging.wandb=true", "logging.wandb_mode=offline")],
                       cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"), stdout=stdout, stderr=stderr, timeout=600)
  text, log = out.read_text(), err.read_text()
  assert r.returncode == 0, log
  lines = text.strip().splitlines()
  assert lines[0] == f"== jaxsft run finished: {run} =="
  assert any(l.startswith("throughput: ") for l in lines) and lines[-1].startswith("export it:")
  # Losses to 4 decimals, as the step lines print them; summary.json keeps every digit.
  summary = json.loads((run / "summary.json").read_text())
  shown = lambda v: "none" if v is None else f"{v:.4f}"  # noqa: E731
  assert lines[1] == (f"steps 4, final train loss {shown(summary['final_loss'])}, "
                      f"val loss {shown(summary['first_val_loss'])} → {shown(summary['val_loss'])}"), lines[1]
  assert re.fullmatch(r"steps 4, final train loss \d+\.\d{4}, val loss .*", lines[1])
  # The doctor's verdict, cause and fix; its evidence is in doctor.txt, which the summary names.
  assert "loss curve: " in text and "likely cause: " in text and "fix: " in text
  assert "evidence:" not in text and "n_points" not in text and f"doctor: {run / 'doctor.txt'}" in text
  assert "evidence:\n  n_points: 4" in (run / "doctor.txt").read_text()
  assert not re.search(r"\d\d:\d\d:\d\d jaxsft", text)  # no log line on stdout
  assert "loading model" in log and "== jaxsft run finished" not in log
  warnings = [l for l in log.splitlines() if "wandb" in l.lower()]
  assert len(warnings) == 1 and "not installed" in warnings[0], warnings
  assert summary["steps"] == 4
  assert not (run / "wandb").exists()


def wandb_history(run_dir) -> dict[int, dict]:
  """The history rows of a W&B offline run, read from its run-*.wandb file: a LevelDB-style log
  (32 KiB blocks of records, each a 7-byte header — checksum, length, type — then the bytes)
  after W&B's 7-byte header, each record a `wandb_internal_pb2.Record`."""
  from wandb.proto import wandb_internal_pb2

  (path,) = glob.glob(str(pathlib.Path(run_dir) / "wandb" / "offline-run-*" / "run-*.wandb"))
  data = pathlib.Path(path).read_bytes()
  assert data[:4] == b":W&B"
  rows: dict[int, dict] = {}
  pos, block, pending = 7, 32768, b""
  while pos + 7 <= len(data):
    if block - pos % block < 7:  # a block's tail too short for a header is padding
      pos += block - pos % block
      continue
    length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
    chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
    if kind not in (1, 2, 3, 4):  # FULL, FIRST, MIDDLE, LAST
      break
    pending = chunk if kind in (1, 2) else pending + chunk
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(pending)
      if record.WhichOneof("record_type") == "history":
        # a key with a "/" may come as its parts (`nested_key`)
        items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        rows.setdefault(record.history.step.num, {}).update(items)
  return rows


@pytest.mark.slow
def test_wandb_offline_run_holds_the_losses_and_json_quiet_prints_one_object(tiny_dir, small_data, tmp_path, capfd):
  from jaxsft.train import main

  run = tmp_path / "run"
  level = logging.getLogger("jaxsft").level
  try:
    code = main([str(a) for a in base_args(tiny_dir, small_data, run, "max_steps=4", "eval.eval_every=2",
                                           "eval.generate=false", "logging.wandb=true", "logging.wandb_mode=offline",
                                           "--json", "--quiet")])
  finally:
    logging.getLogger("jaxsft").setLevel(level)
  out, err = capfd.readouterr()
  assert code == 0, err
  assert json.loads(out) == json.loads((run / "summary.json").read_text())  # one JSON object, nothing else
  assert "jaxsft" not in err  # --quiet: no log lines
  rows = wandb_history(run)
  lines = metric_lines(run)
  losses = {l["step"]: l["loss"] for l in lines if "loss" in l}
  assert {s: rows[s]["train/loss"] for s in losses} == pytest.approx(losses, rel=1e-12)
  vals = {l["step"]: l["val_loss"] for l in lines if "val_loss" in l}
  assert {s: rows[s]["eval/val_loss"] for s in vals} == pytest.approx(vals, rel=1e-12)
  assert (run / "wandb_run_id").is_file()


def test_a_resumed_writer_hides_the_steps_it_redoes(tmp_path):
  """TensorBoard's reader shows one series: the killed writer's steps after the restored one are
  replaced by the resumed writer's, text and scalars alike."""
  from jaxsft import config as config_lib

  first = tracking.open_trackers(config_lib.LoggingConfig(), tmp_path, resumed_at=None, config={"lr": 1})
  first.text("config", tracking.config_markdown({"lr": 1}), 0)
  for step in range(1, 8):
    first.log({"step": step, "loss": float(step), "lr": 0.5, "skipped_key": "x"})
  first.log({"event": "config", "step": 3, "loss": 99.0})  # not a step record: not a scalar
  # killed here (never closed); the resumed run restored step 4
  second = tracking.open_trackers(config_lib.LoggingConfig(), tmp_path, resumed_at=4, config={"lr": 1})
  for step in range(5, 10):
    second.log({"step": step, "loss": 10.0 + step, "lr": 0.5, "val_loss": None})
  second.close()
  scalars, texts = event_scalars(tmp_path)
  assert scalars["train/loss"] == [(s, float(s)) for s in range(1, 5)] + [(s, 10.0 + s) for s in range(5, 10)]
  assert [s for s, _ in scalars["train/lr"]] == list(range(1, 10))
  assert "eval/val_loss" not in scalars and "config/text_summary" in texts
