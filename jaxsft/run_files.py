"""What a run writes and reads back, written so that a reader (or a crash) never sees half of it.

- `atomic_path` / `atomic_write` / `write_json` / `replace_directory`: the one way jaxsft writes a
  file or a folder (temp beside the target, fsync, rename).
- `RunFiles`: the layout of a run directory, the `metrics.jsonl` writer and the adapter save.
- `read_metrics`: the one `metrics.jsonl` reader (the doctor, the plot and the tests use it).

metrics.jsonl holds one JSON object per line:
  {"event": "config", "steps_per_epoch": ..., ...}     once, at the start of a fresh run
  {"step": s, "loss": ..., "lr": ..., ...}              every optimizer step (+ "val_loss")
  {"step": 0, "val_loss": ...}                          the base model's held-out loss
  {"step": s, "epoch": e, "epoch_loss": ...}            when epoch e ended (logged with step s)
A resumed run appends; for a step logged twice the later line wins.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pathlib
import shutil
import tempfile
from typing import IO, Callable, Iterator


# ---------------------------------------------------------------------------------------------
# Atomic writes.


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[pathlib.Path]:
  """A temp path beside `path` to write; on success it is fsynced and renamed over `path`.

  The rename is atomic on POSIX: `path` holds either the old content or all of the new. On an
  exception the temp file is removed and `path` is untouched.
  """
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
  os.close(fd)
  tmp = pathlib.Path(tmp)
  try:
    yield tmp
    with open(tmp, "rb") as f:
      os.fsync(f.fileno())
    os.replace(tmp, path)
  finally:
    tmp.unlink(missing_ok=True)


def atomic_write(path: str | os.PathLike, write: Callable[[IO], None], *, binary: bool = False) -> pathlib.Path:
  """`write(f)` to an open file that replaces `path` atomically once `write` returns."""
  with atomic_path(path) as tmp:
    with open(tmp, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
      write(f)
  return pathlib.Path(path)


def write_text(path: str | os.PathLike, text: str) -> pathlib.Path:
  return atomic_write(path, lambda f: f.write(text))


def write_json(path: str | os.PathLike, obj) -> pathlib.Path:
  return write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def replace_directory(target: str | os.PathLike, fill: Callable[[pathlib.Path], None]) -> pathlib.Path:
  """`fill(tmp_dir)` into a fresh folder beside `target`, then swap it in for `target`.

  The swap is two renames (old out of the way, new in), so a reader sees the old folder or the
  new one, each whole; a failed `fill` leaves `target` as it was.
  """
  target = pathlib.Path(target)
  target.parent.mkdir(parents=True, exist_ok=True)
  tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
  old = tmp.with_suffix(".old")
  try:
    fill(tmp)
    if target.exists():
      os.replace(target, old)
    os.replace(tmp, target)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
  return target


# ---------------------------------------------------------------------------------------------
# The run directory.


class RunFiles:
  """A run directory: metrics.jsonl (appended, one line per record), JSON files, the adapter.

  With several processes only process 0 writes (`writer`); orbax checkpoints are every process's.
  """

  def __init__(self, output_dir: str | os.PathLike, writer: bool = True):
    self.dir = pathlib.Path(output_dir)
    self.writer = writer
    self.metrics = self.dir / "metrics.jsonl"
    self.checkpoints = self.dir / "checkpoints"
    self.adapter = self.dir / "adapter"
    self.sinks: list[Callable[[dict], None]] = []  # also fed every logged record (`jaxsft.tracking`)

  def holds_a_run(self) -> bool:
    return self.checkpoints.exists() or self.metrics.exists()

  def write_json(self, name: str, obj) -> None:
    if self.writer:
      write_json(self.dir / name, obj)

  def write_text(self, name: str, text: str) -> None:
    if self.writer:
      write_text(self.dir / name, text)

  def log(self, record: dict) -> None:
    """Appends one metrics line (a line is written whole or, on a crash, is the last and cut),
    then hands the record to each sink."""
    if self.writer:
      with open(self.metrics, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
      for sink in self.sinks:
        sink(record)

  def truncate_metrics(self, last_step: int) -> None:
    """On resume: drop metric lines from steps after the checkpoint (they will be redone) and
    the previous run's end-of-run epoch line (the resumed run reports that epoch again)."""
    if not self.writer or not self.metrics.exists():
      return
    kept = []
    for line in self.metrics.read_text(encoding="utf-8").splitlines():
      record = json.loads(line)
      if record.get("event") == "config" or (record.get("step", 0) <= last_step and not record.get("end_of_run")):
        kept.append(line)
    write_text(self.metrics, "".join(line + "\n" for line in kept))

  def save_adapter(self, model, base_model_name_or_path: str) -> None:
    """The PEFT adapter folder, replaced whole (a reader never sees a mix of two steps)."""
    if not self.writer:
      return
    from jaxsft import lora

    replace_directory(self.adapter, lambda tmp: lora.save_adapter(model, tmp, base_model_name_or_path=base_model_name_or_path))


# ---------------------------------------------------------------------------------------------
# Reading metrics.jsonl.


class MetricsError(ValueError):
  """A malformed metrics.jsonl (the message names the file and the line)."""


@dataclasses.dataclass
class MetricsLog:
  """The losses of a run, by step. `path` is None for metrics built in memory."""

  path: pathlib.Path | None
  train_steps: list[int]
  train_loss: list[float]
  val_steps: list[int]
  val_loss: list[float]
  steps_per_epoch: int | None
  epoch_end_steps: list[int] = dataclasses.field(default_factory=list)


def metrics_path(run_dir_or_file: str | os.PathLike) -> pathlib.Path:
  path = pathlib.Path(run_dir_or_file)
  return path / "metrics.jsonl" if path.is_dir() else path


def _number(obj: dict, key: str, where: str, *, integer: bool = False):
  value = obj[key]
  if value is None and not integer:
    return math.nan  # a skipped (non-finite) step may be logged as null
  if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
    kind = "an integer" if integer else "a number"
    raise MetricsError(f"{where}: field {key!r} must be {kind}, got {value!r}")
  return int(value) if integer else float(value)


def _metric_lines(path: pathlib.Path) -> Iterator[tuple[str, dict]]:
  """(where, object) for each non-blank line; a line that is no JSON object is a MetricsError."""
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, 1):
      where = f"{path}:{lineno}"
      if not line.strip():
        continue
      try:
        obj = json.loads(line)
      except json.JSONDecodeError as e:
        raise MetricsError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
      if not isinstance(obj, dict):
        raise MetricsError(f"{where}: expected a JSON object, got {type(obj).__name__}")
      yield where, obj


def read_records(run_dir_or_file: str | os.PathLike) -> list[dict]:
  """Every line of RUN_DIR/metrics.jsonl (or the file itself) as a dict, in order."""
  return [obj for _, obj in _metric_lines(metrics_path(run_dir_or_file))]


def read_metrics(run_dir_or_file: str | os.PathLike) -> MetricsLog:
  """Parse RUN_DIR/metrics.jsonl (or the file itself). A later line for a step wins (resume)."""
  path = metrics_path(run_dir_or_file)
  if not path.is_file():
    raise FileNotFoundError(f"no metrics file at {path}" + (
        "" if path.parent.is_dir() else f" ({path.parent} does not exist)"))
  train: dict[int, float] = {}
  val: dict[int, float] = {}
  epoch_ends: dict[int, int] = {}
  steps_per_epoch = None
  for where, obj in _metric_lines(path):
    if "event" in obj:
      if obj["event"] == "config" and obj.get("steps_per_epoch") is not None:
        steps_per_epoch = _number(obj, "steps_per_epoch", where, integer=True)
      continue
    if not any(key in obj for key in ("loss", "val_loss", "epoch")):
      continue  # some other record
    if "step" not in obj:
      raise MetricsError(f"{where}: a loss line needs a 'step' field")
    step = _number(obj, "step", where, integer=True)
    if "loss" in obj:
      train[step] = _number(obj, "loss", where)
    if "val_loss" in obj:
      val[step] = _number(obj, "val_loss", where)
    if "epoch" in obj:
      epoch_ends[_number(obj, "epoch", where, integer=True)] = step
  if not train:
    raise MetricsError(f"{path}: no training loss lines (objects with 'step' and 'loss')")
  train_steps, val_steps = sorted(train), sorted(val)
  ends = [epoch_ends[e] for e in sorted(epoch_ends)]
  if steps_per_epoch is None and ends:
    steps_per_epoch = ends[0] - train_steps[0] + 1  # the first epoch's steps
  return MetricsLog(path, train_steps, [train[s] for s in train_steps], val_steps,
                    [val[s] for s in val_steps], steps_per_epoch, ends)
