"""A run's numbers in the tools people watch runs with: TensorBoard and Weights & Biases.

Every record the loop writes to metrics.jsonl goes, unchanged, to `Trackers.log` (a sink of
`RunFiles.log`), which turns its numbers into scalars at the record's `step`: TensorBoard and
W&B show the values metrics.jsonl holds, by construction.

    record key                              scalar tag
    loss lr grad_norm real_tokens ...       train/<key>      (`SCALARS`, when present)
    val_loss                                eval/val_loss
    epoch_loss                              train/epoch_loss

A tracker is three calls, `scalars(step, values)`, `text(tag, text, step)` and `close()`:

- `TensorBoard`: tensorboardX event files in RUN_DIR/tensorboard, on disk after every record
  (a live view, and nothing a checkpoint covers is lost to a kill). A resumed run opens its
  writer with `purge_step` = the first step it redoes: the SessionLog.START event it writes
  makes TensorBoard's reader drop every older event at or after that step, so the steps a
  killed run logged past its last checkpoint are not shown twice.
- `WandB`: `wandb.init` (online or offline, files under RUN_DIR/wandb; the run id is kept in
  RUN_DIR/wandb_run_id so a resumed run continues the same W&B run), `wandb.log(..., step=)`,
  the config, and the adapter folder as a model artifact when online. W&B has no purge: it
  drops a step below the run's current one, so after a kill the steps the resumed run redoes
  keep the killed run's values there until the run passes them (TensorBoard and metrics.jsonl
  hold the redone ones).

A tracker that cannot start (a missing package, no network) is one warning line and the run
goes on without it; one that fails later is dropped with one warning.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pathlib
import secrets
import sys
import time
from typing import Protocol

from jaxsft.run_files import RunFiles

log = logging.getLogger("jaxsft.tracking")

SCALARS = ("loss", "lr", "grad_norm", "tokens", "real_tokens", "valid_tokens", "padding_fraction", "tokens_per_s",
           "valid_tokens_per_s", "data_wait_s", "seconds", "flops_per_s", "mfu", "epoch_loss", "val_loss")
"""The record keys logged as scalars."""


def tag(key: str) -> str:
  return f"eval/{key}" if key == "val_loss" else f"train/{key}"


def scalars_of(record: dict) -> dict[str, float]:
  """The record's numbers by tag (a skipped step's null loss stays out)."""
  out = {}
  for key in SCALARS:
    value = record.get(key)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
      out[tag(key)] = value
  return out


class Tracker(Protocol):
  def scalars(self, step: int, values: dict[str, float]) -> None: ...

  def text(self, tag: str, text: str, step: int) -> None: ...

  def close(self) -> None: ...


class _HideTorch:
  """An import finder under which `import torch` fails (see `import_tensorboardx`)."""

  def find_spec(self, name, path=None, target=None):
    if name == "torch" or name.startswith("torch."):
      raise ModuleNotFoundError(f"{name} is not imported for tensorboardX")
    return None


def import_tensorboardx():
  """tensorboardX's `summary`, `event_file_writer` and `event_pb2` modules, imported without torch.

  tensorboardX imports torch whenever it is installed, only to accept torch tensors (jaxsft
  hands it Python floats); that import costs seconds and hundreds of MB of a JAX run.
  """
  finder = None
  if "tensorboardX" not in sys.modules and "torch" not in sys.modules:
    finder = _HideTorch()
    sys.meta_path.insert(0, finder)
  try:
    from tensorboardX import event_file_writer, summary
    from tensorboardX.proto import event_pb2
  finally:
    if finder is not None:
      sys.meta_path.remove(finder)
  return summary, event_file_writer, event_pb2


class TensorBoard:
  """tensorboardX event files under `logdir`, written by the calling thread.

  tensorboardX's `SummaryWriter` hands events to a background thread, and its `flush()` flushes
  the file but not the events still queued for that thread: a run killed right after a record
  could lose steps its checkpoint covers. `EventsWriter` writes in the caller, so `flush()`
  after each record puts that record on disk.
  """

  def __init__(self, logdir: pathlib.Path, purge_step: int | None):
    self._summary, event_file_writer, self._event_pb2 = import_tensorboardx()
    logdir.mkdir(parents=True, exist_ok=True)
    # Event files are named by the second they were opened in; the first step and the process id
    # keep two writers of one second (a kill and a quick resume) from writing the same file.
    suffix = f".step{purge_step or 0:09d}.{os.getpid()}"
    self.writer = event_file_writer.EventsWriter(str(logdir / "events"), suffix)
    if purge_step is not None:  # what SummaryWriter(purge_step=) writes: the reader's restart mark
      self._write(self._event_pb2.Event(step=purge_step, file_version="brain.Event:2"))
      self._write(self._event_pb2.Event(step=purge_step,
                                        session_log=self._event_pb2.SessionLog(status=self._event_pb2.SessionLog.START)))

  def _write(self, event) -> None:
    event.wall_time = time.time()
    self.writer.write_event(event)
    self.writer.flush()

  def scalars(self, step: int, values: dict[str, float]) -> None:
    event = self._event_pb2.Event(step=step)
    for name, value in values.items():
      event.summary.value.extend(self._summary.scalar(name, value).value)
    self._write(event)

  def text(self, tag: str, text: str, step: int) -> None:
    self._write(self._event_pb2.Event(step=step, summary=self._summary.text(tag, text)))

  def close(self) -> None:
    self.writer.close()


class WandB:
  """A W&B run (online or offline) of the config, resumed by the id kept in the run directory."""

  def __init__(self, files: RunFiles, project: str, mode: str, config: dict):
    os.environ.setdefault("WANDB_SILENT", "true")  # W&B's own terminal lines off
    import wandb

    self.wandb, self.mode = wandb, mode
    run_dir, id_file = files.dir, files.wandb_run_id
    run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)  # W&B ids: [a-z0-9]
    # console="off": W&B must not wrap stdout/stderr (stdout holds only the closing summary).
    # dir=RUN_DIR: W&B keeps its local run in RUN_DIR/wandb (`RunFiles.wandb`).
    self.run = wandb.init(project=project, name=run_dir.name, id=run_id, resume="allow", mode=mode,
                          dir=str(run_dir), config=config,
                          settings=wandb.Settings(console="off", silent=True, x_disable_stats=True))
    id_file.write_text(run_id + "\n")

  def scalars(self, step: int, values: dict[str, float]) -> None:
    self.run.log(values, step=step)

  def text(self, tag: str, text: str, step: int) -> None:
    self.run.summary[tag] = text

  def log_adapter(self, folder: pathlib.Path, name: str) -> None:
    if self.mode != "online" or not folder.is_dir():
      return
    artifact = self.wandb.Artifact(name, type="model")
    artifact.add_dir(str(folder))
    self.run.log_artifact(artifact)

  def close(self) -> None:
    self.run.finish()


class Trackers:
  """The run's trackers behind one `log(record)`; each failure is one warning, never the run's end."""

  def __init__(self, trackers: dict[str, Tracker]):
    self.trackers = trackers

  def _each(self, call: str, *args) -> None:
    for name, tracker in list(self.trackers.items()):
      try:
        getattr(tracker, call)(*args)
      except Exception as e:  # a tracker's failure must never cost the run
        log.warning("%s: %s failed (%s: %s); logging to it stops", name, call, type(e).__name__, e)
        self.trackers.pop(name, None)

  def log(self, record: dict) -> None:
    if "step" in record and "event" not in record:
      values = scalars_of(record)
      if values:
        self._each("scalars", int(record["step"]), values)

  def text(self, tag: str, text: str, step: int) -> None:
    self._each("text", tag, text, step)

  def log_adapter(self, folder: pathlib.Path, name: str) -> None:
    for key, tracker in list(self.trackers.items()):
      if hasattr(tracker, "log_adapter"):
        try:
          tracker.log_adapter(folder, name)
        except Exception as e:
          log.warning("%s: the adapter artifact was not logged (%s: %s)", key, type(e).__name__, e)

  def close(self) -> None:
    self._each("close")
    self.trackers = {}


def open_trackers(logging_cfg, run_dir: pathlib.Path, *, resumed_at: int | None, config: dict) -> Trackers:
  """The trackers `logging_cfg` asks for. `resumed_at`: the restored step of a resumed run (its
  later events are purged), None for a fresh run."""
  trackers: dict[str, Tracker] = {}
  files = RunFiles(run_dir, writer=False)
  if logging_cfg.tensorboard:
    try:
      trackers["tensorboard"] = TensorBoard(files.tensorboard, None if resumed_at is None else resumed_at + 1)
    except ImportError:
      log.warning("logging.tensorboard: the tensorboardX package is not installed (pip install tensorboardX); "
                  "no event files")
  if logging_cfg.wandb:
    try:
      trackers["wandb"] = WandB(files, logging_cfg.wandb_project, logging_cfg.wandb_mode, config)
    except ImportError:
      log.warning("logging.wandb: the wandb package is not installed (pip install 'jaxsft[wandb]'); "
                  "training goes on without W&B")
    except Exception as e:  # no network, no login, a bad project name: the run goes on
      reason = (str(e).strip().splitlines() or [""])[0][:200]
      log.warning("logging.wandb: W&B did not start (%s: %s); training goes on without it "
                  "(logging.wandb_mode=offline needs no network)", type(e).__name__, reason)
  return Trackers(trackers)


def config_markdown(config: dict) -> str:
  """The config as a fenced JSON block (TensorBoard renders text as markdown)."""
  return "```\n" + json.dumps(config, indent=2, default=str) + "\n```"


def run_report_markdown(diagnosis_report: str, evaluation: dict | None) -> dict[str, str]:
  """The texts of a finished run: the doctor's verdict and tuned-vs-base sample replies."""
  texts = {"doctor": "```\n" + diagnosis_report + "\n```"}
  if evaluation and evaluation.get("samples"):
    rows = ["| prompt | reference | base | tuned |", "|---|---|---|---|"]
    cell = lambda s: str(s).replace("|", "\\|").replace("\n", " ")[:200]  # noqa: E731
    for s in evaluation["samples"]:
      rows.append(f"| {cell(s['prompt'])} | {cell(s['reference'])} | {cell(s['base'])} | {cell(s['tuned'])} |")
    score = f"task score: base {evaluation['base']['score']:.3f}, tuned {evaluation['tuned']['score']:.3f}\n\n"
    texts["samples"] = score + "\n".join(rows)
  return texts
