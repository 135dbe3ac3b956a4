"""What a run writes and reads back, each file written atomically (`jaxsft.io`).

- `RunLock`: one writer per run directory.
- `RunFiles`: the layout of a run directory (every file and folder a run writes is named there
  and nowhere else), the `metrics.jsonl` writer and the save of the adapter or full model.
- `resolve_run`: what loads a finished run's tuned model (chat, export).
- `read_metrics`: the one `metrics.jsonl` reader (the doctor, the plot and the tests use it).

metrics.jsonl holds one JSON object per line:
  {"event": "config", "steps_per_epoch": ..., "vocab_size": ..., "collation": ..., ...}
                                                        once, at the start of a fresh run (its
                                                        collation is what a resumed run keeps)
  {"step": s, "loss": ..., "lr": ..., ...}              every optimizer step (+ "val_loss")
  {"step": 0, "val_loss": ...}                          the base model's held-out loss
  {"step": s, "epoch": e, "epoch_loss": ...}            when epoch e ended (logged with step s)
A resumed run appends; for a step logged twice the later line wins.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import pathlib
import shutil
import socket
import time
from typing import Callable, Iterator

from jaxsft import io
from jaxsft.errors import JaxsftError

log = logging.getLogger("jaxsft.run_files")


# ---------------------------------------------------------------------------------------------
# One writer per run directory.


class RunLocked(JaxsftError, RuntimeError):
  """Another live process holds the run directory's lock."""


class RunLock:
  """RUN_DIR/run.lock: held (an exclusive `flock`) for the life of the process that writes the run.

  The file names its holder (pid, host, start time), for the refusal of a second writer. The
  kernel drops a `flock` when its process dies, however it dies, so a lock file whose lock is
  free is a stale one: it is taken over with a log line naming the dead holder.
  """

  NAME = "run.lock"

  def __init__(self, folder: str | os.PathLike):
    self.folder = pathlib.Path(folder)
    self.path = self.folder / self.NAME
    self._fd: int | None = None
    self._created_folder = False

  def acquire(self) -> "RunLock":
    import fcntl

    self._created_folder = not self.folder.exists()
    self.folder.mkdir(parents=True, exist_ok=True)
    while True:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        holder = _read_holder(fd)
        os.close(fd)
        raise RunLocked(f"{self.folder} is in use by another training process ({holder}); wait for it to end, "
                        f"or choose another --output-dir") from None
      try:
        same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
      except FileNotFoundError:
        same = False
      if same:
        break
      os.close(fd)  # the holder released (and unlinked) it between our open and flock: retry
    stale = _read_holder(fd)
    if stale != "no holder recorded":
      log.warning("%s: taking over the stale lock of a process that ended without releasing it (%s)", self.path, stale)
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    os.fsync(fd)
    self._fd = fd
    return self

  def release(self) -> None:
    """Unlinks the file, then unlocks (a process waiting on the old file retries on the new one);
    a folder created only to hold the lock is removed again when nothing else was written."""
    if self._fd is None:
      return
    self.path.unlink(missing_ok=True)
    os.close(self._fd)
    self._fd = None
    if self._created_folder:
      with contextlib.suppress(OSError):
        self.folder.rmdir()  # only when empty

  def __enter__(self):
    return self.acquire()

  def __exit__(self, *exc):
    self.release()


def _read_holder(fd: int) -> str:
  try:
    holder = json.loads(os.pread(fd, 4096, 0) or b"null")
    return f"pid {holder['pid']} on {holder['host']}, started {holder['started']}"
  except (ValueError, TypeError, KeyError):
    return "no holder recorded"


# ---------------------------------------------------------------------------------------------
# The run directory.


ORBAX_TEMP = ".orbax-checkpoint-tmp"  # orbax's name for a step folder before its commit


class RunFiles:
  """A run directory: every file and folder a run writes is named here, and only here.

  metrics.jsonl is appended (one line per record), the JSON and text files are written whole.
  The tuned weights are `adapter/` (a PEFT LoRA adapter) or, for a full fine-tuning run,
  `model/` (the whole model as a Hugging Face folder): `tuned` names the folder of a mode and
  `holds_full_model` tells a reader which one a run holds. With several processes only process 0
  writes (`writer`); orbax checkpoints are every process's.
  """

  def __init__(self, output_dir: str | os.PathLike, writer: bool = True):
    self.dir = pathlib.Path(output_dir)
    self.writer = writer
    # What every run writes.
    self.config = self.dir / "config.json"  # the run's whole config tree (chat, export, evaluate read it)
    self.heldout = self.dir / "heldout.json"  # the held-out records (evaluate prompts with them)
    self.metrics = self.dir / "metrics.jsonl"
    self.checkpoints = self.dir / "checkpoints"  # orbax's step folders
    self.adapter = self.dir / "adapter"
    self.full_model = self.dir / "model"
    self.lock_file = self.dir / RunLock.NAME  # only while a process writes the run
    # What a run that finishes writes.
    self.loss_curve = self.dir / "loss_curve.png"
    self.doctor_report = self.dir / "doctor.txt"
    self.evaluation = self.dir / "evaluation.json"  # with eval.generate; `jaxsft evaluate` rewrites it
    self.summary = self.dir / "summary.json"  # a run a signal stopped writes it too
    # What some runs write: a resume that found damaged checkpoints, the trackers.
    self.damaged_checkpoints = self.dir / "damaged_checkpoints"
    self.tensorboard = self.dir / "tensorboard"  # event files, with logging.tensorboard
    self.wandb_run_id = self.dir / "wandb_run_id"  # the W&B run a resumed run goes on with
    self.wandb = self.dir / "wandb"  # W&B's own folder (wandb.init(dir=RUN_DIR) makes it)
    self.sinks: list[Callable[[dict], None]] = []  # also fed every logged record (`jaxsft.tracking`)

  FOLDERS = ("checkpoints", "adapter", "full_model", "damaged_checkpoints", "tensorboard", "wandb")
  FILES = ("config", "heldout", "metrics", "lock_file", "loss_curve", "doctor_report", "evaluation", "summary", "wandb_run_id")

  def layout(self) -> dict[str, pathlib.Path]:
    """Every file and folder of the run by attribute name (`FILES`, then `FOLDERS`)."""
    return {name: getattr(self, name) for name in self.FILES + self.FOLDERS}

  def holds_a_run(self) -> bool:
    return self.checkpoints.exists() or self.metrics.exists()

  def checkpoint_steps(self) -> list[int]:
    """The steps of the checkpoints orbax committed (its step folders), oldest first."""
    if not self.checkpoints.is_dir():
      return []
    return sorted(int(p.name) for p in self.checkpoints.iterdir() if p.name.isdigit())

  def tuned(self, full: bool) -> pathlib.Path:
    """The folder of the tuned weights: `model/` for full fine-tuning, else `adapter/`."""
    return self.full_model if full else self.adapter

  def holds_full_model(self) -> bool:
    """Whether the run left a full fine-tuned model (`model/config.json`) rather than an adapter."""
    return (self.full_model / "config.json").is_file()

  def lock(self) -> RunLock | None:
    """Takes the run directory's lock (the writer only) and removes what writers that died
    mid-write left in it; `unlock` (or the process's end) releases it."""
    if not self.writer:
      return None
    self._lock = RunLock(self.dir).acquire()
    for path in sorted(self.dir.iterdir()):
      match = io.TEMP_NAME.match(path.name)
      if match:
        for removed in io.remove_leftovers(self.dir / match["name"]):
          log.info("removed %s, left by a writer that stopped mid-write", removed)
    # A checkpoint save killed before orbax's commit (the rename of its temp folder) leaves the
    # temp: never restored (orbax lists committed steps only), removed here.
    for path in sorted(self.checkpoints.glob(f"*{ORBAX_TEMP}*")) if self.checkpoints.is_dir() else ():
      shutil.rmtree(path, ignore_errors=True)
      log.info("removed %s, an unfinished checkpoint save", path)
    return self._lock

  def unlock(self) -> None:
    lock, self._lock = getattr(self, "_lock", None), None
    if lock is not None:
      lock.release()

  def write_json(self, path: pathlib.Path, obj) -> None:
    """Writes one of the run's files (`path`: one of `layout()`'s, e.g. `files.summary`)."""
    if self.writer:
      io.write_json(self._own_file(path), obj)

  def write_text(self, path: pathlib.Path, text: str) -> None:
    if self.writer:
      io.write_text(self._own_file(path), text)

  def _own_file(self, path: pathlib.Path) -> pathlib.Path:
    # A bare name ("summary.json") would be written relative to the working directory.
    if path not in (self.layout()[name] for name in self.FILES):
      raise ValueError(f"{path} is not a file of the run layout (RunFiles.FILES)")
    return path

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
    for _, record in _metric_lines(self.metrics):  # a line cut by a crash is dropped here
      if record.get("event") == "config" or (record.get("step", 0) <= last_step and not record.get("end_of_run")):
        kept.append(json.dumps(record))
    io.write_text(self.metrics, "".join(line + "\n" for line in kept))

  def save_adapter(self, model, base_model_name_or_path: str, tokenizer=None) -> None:
    """The PEFT adapter folder, replaced whole (a reader never sees a mix of two steps), with
    `tokenizer` beside it when given, as TRL saves one: `AutoTokenizer.from_pretrained` of the
    folder then gives the chat template the adapter was trained with."""
    if not self.writer:
      return
    from jaxsft import lora

    def fill(tmp: pathlib.Path) -> None:
      lora.save_adapter(model, tmp, base_model_name_or_path=base_model_name_or_path)
      if tokenizer is not None:
        from jaxsft.data.template import as_trained

        as_trained(tokenizer).save_pretrained(str(tmp))

    io.replace_directory(self.adapter, fill)

  def save_full_model(self, fill: Callable[[pathlib.Path], None]) -> None:
    """The full fine-tuned model folder, filled by `fill(tmp)` and replaced whole."""
    if self.writer:
      io.replace_directory(self.full_model, fill)

  def remove_tuned(self) -> None:
    """Removes the adapter and the full model folder (the writer only)."""
    if self.writer:
      for folder in (self.adapter, self.full_model):
        io.remove_directory(folder)


class RunDirError(JaxsftError):
  """A folder that is not a finished jaxsft run (no config.json, no adapter or model yet)."""


@dataclasses.dataclass
class RunSource:
  """What loads a finished run's tuned model: the base `model` with its `adapter` folder (LoRA),
  or the run's `model/` folder and no adapter (full fine-tuning); the run's dtype, quantization
  of the base and chat template (`model.chat_template`: None, the tokenizer's own)."""

  model: str
  adapter: str | None
  dtype: str
  quantize: str = "none"
  quant_block_size: int = 32  # model.quant_block_size's default
  quantize_embeddings: bool = False
  chat_template: str | None = None


def resolve_run(run_dir: str | os.PathLike) -> RunSource:
  """The `RunSource` of a finished run; `RunDirError` when `run_dir` is not one."""
  files = RunFiles(run_dir, writer=False)
  if not files.config.is_file():
    raise RunDirError(f"{files.config} is missing: {files.dir} is not a jaxsft run directory")
  try:
    cfg = json.loads(files.config.read_text())
  except json.JSONDecodeError as e:
    raise RunDirError(f"{files.config}: line {e.lineno}: invalid JSON ({e.msg})") from None
  model_cfg = cfg.get("model", {})
  if files.holds_full_model():
    return RunSource(str(files.full_model), None, model_cfg.get("dtype", "float32"),
                     chat_template=model_cfg.get("chat_template"))
  if not (files.adapter / "adapter_config.json").is_file():
    raise RunDirError(f"{files.adapter / 'adapter_config.json'} is missing: {files.dir} has no adapter yet "
                      f"(the run has not saved one; it writes it at checkpoints and at the end)")
  name = model_cfg.get("name")
  if not name:
    raise RunDirError(f"{files.config}: field model.name is missing")
  return RunSource(name, str(files.adapter), model_cfg.get("dtype", "float32"), model_cfg.get("quantize", "none"),
                   model_cfg.get("quant_block_size", RunSource.quant_block_size), bool(model_cfg.get("quantize_embeddings", False)),
                   model_cfg.get("chat_template"))


# ---------------------------------------------------------------------------------------------
# Reading metrics.jsonl.


class MetricsError(JaxsftError, ValueError):
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
  train_grad_norm: list[float] = dataclasses.field(default_factory=list)  # per train step, when every line has it
  vocab_size: int | None = None  # the model's, from the config line (older runs did not log it)
  train_lr: list[float] = dataclasses.field(default_factory=list)  # per train step, when every line has it


def metrics_path(run_dir_or_file: str | os.PathLike) -> pathlib.Path:
  path = pathlib.Path(run_dir_or_file)
  return RunFiles(path, writer=False).metrics if path.is_dir() else path


def _number(obj: dict, key: str, where: str, *, integer: bool = False):
  value = obj[key]
  if value is None and not integer:
    return math.nan  # a skipped (non-finite) step may be logged as null
  if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
    kind = "an integer" if integer else "a number"
    raise MetricsError(f"{where}: field {key!r} must be {kind}, got {value!r}")
  return int(value) if integer else float(value)


def _metric_lines(path: pathlib.Path) -> Iterator[tuple[str, dict]]:
  """(where, object) for each non-blank line; a line that is no JSON object is a MetricsError,
  except a last line without its newline that does not parse: the line a crash cut, ignored."""
  with open(path, encoding="utf-8", errors="replace") as f:
    for lineno, line in enumerate(f, 1):
      where = f"{path}:{lineno}"
      if not line.strip():
        continue
      try:
        obj = json.loads(line)
      except (json.JSONDecodeError, RecursionError) as e:
        if not line.endswith("\n"):  # only the file's last line can lack it
          log.warning("%s: ignoring the last line, cut short (a crash while it was written)", where)
          return
        raise MetricsError(f"{where}: not valid JSON ({getattr(e, 'msg', e)}"
                           f"{f' at column {e.colno}' if hasattr(e, 'colno') else ''})") from None
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
  grad_norm: dict[int, float] = {}
  lr: dict[int, float] = {}
  val: dict[int, float] = {}
  epoch_ends: dict[int, int] = {}
  steps_per_epoch = vocab_size = None
  for where, obj in _metric_lines(path):
    if "event" in obj:
      if obj["event"] == "config" and obj.get("steps_per_epoch") is not None:
        steps_per_epoch = _number(obj, "steps_per_epoch", where, integer=True)
      if obj["event"] == "config" and obj.get("vocab_size") is not None:
        vocab_size = _number(obj, "vocab_size", where, integer=True)
      continue
    if not any(key in obj for key in ("loss", "val_loss", "epoch")):
      continue  # some other record
    if "step" not in obj:
      raise MetricsError(f"{where}: a loss line needs a 'step' field")
    step = _number(obj, "step", where, integer=True)
    if "loss" in obj:
      train[step] = _number(obj, "loss", where)
      if "grad_norm" in obj:
        grad_norm[step] = _number(obj, "grad_norm", where)
      if "lr" in obj:
        lr[step] = _number(obj, "lr", where)
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
  grads = [grad_norm[s] for s in train_steps] if all(s in grad_norm for s in train_steps) else []
  lrs = [lr[s] for s in train_steps] if all(s in lr for s in train_steps) else []
  return MetricsLog(path, train_steps, [train[s] for s in train_steps], val_steps,
                    [val[s] for s in val_steps], steps_per_epoch, ends, grads, vocab_size, lrs)
