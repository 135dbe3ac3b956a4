"""Faults and bad inputs: every refusal is one `error:` line and exit 2 (a bug keeps its
traceback); nothing a writer leaves after a crash at any point is half an artifact; a run
directory has one writer; export never deletes its own source; a diverging run keeps its last
good checkpoint."""

import contextlib
import dataclasses
import errno
import json
import logging
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from jaxsft import errors

ROOT = pathlib.Path(__file__).resolve().parents[1]


def error_line(capsys) -> str:
  """The refusal's `error:` line: the only one, the last on stderr (log lines may come before),
  no traceback."""
  return only_error_line(capsys.readouterr().err)


def only_error_line(err: str) -> str:
  """`error_line` of a command's captured stderr."""
  lines = [line for line in err.splitlines() if line.strip()]
  assert "Traceback" not in err, err[-3000:]
  assert lines and lines[-1].startswith("error: ") and sum(line.startswith("error:") for line in lines) == 1, err[-3000:]
  return lines[-1]


# ---------------------------------------------------------------------------------------------
# One wrapper: refusal → `error:` line and exit 2; a bug → traceback.


def test_run_cli_turns_refusals_and_environment_failures_into_one_line(capsys):
  def refuse():
    raise errors.JaxsftError("data.jsonl:3: field 'output' is missing")

  assert errors.run_cli(refuse) == errors.EXIT_USAGE == 2
  assert error_line(capsys) == "error: data.jsonl:3: field 'output' is missing"

  def disk_full():  # as orbax or tensorstore wrap it: the OSError is the cause of another error
    try:
      raise OSError(errno.ENOSPC, "No space left on device", "/runs/x/checkpoints/4")
    except OSError as e:
      raise RuntimeError("async save failed") from e

  assert errors.run_cli(disk_full) == 2
  line = error_line(capsys)
  assert "No space left on device" in line and "/runs/x/checkpoints/4" in line

  def deep():
    json.loads("[" * 100_000 + "]" * 100_000)

  assert errors.run_cli(deep) == 2
  assert "nested too deeply" in error_line(capsys)

  def bug():
    raise ZeroDivisionError("a bug")

  with pytest.raises(ZeroDivisionError):
    errors.run_cli(bug)
  assert errors.run_cli(lambda: None) == 0 and errors.run_cli(lambda: 3) == 3


def test_library_errors_that_name_an_os_error_in_their_text_are_environment_failures(capsys):
  """tensorstore (orbax's checkpoint writes) and Rust's io::Error (safetensors) raise their own
  types on a full disk; the OS error is only in the text. Other errors of those types stay bugs."""

  class SafetensorError(Exception):
    pass

  def checkpoint_write():
    raise ValueError('RESOURCE_EXHAUSTED: Error writing "opt_state.mu/0.0.0" in OCDBT database at local file '
                     '"/runs/x/checkpoints/3.orbax-checkpoint-tmp/state/": Failed writing: "/runs/x/checkpoints/'
                     '3.orbax-checkpoint-tmp/state/d/67e1": Failed to write 21961 bytes to file 6: No space left on '
                     "device [os_error_code='28']")

  def adapter_write():
    raise SafetensorError("Error while serializing: I/O error: File too large (os error 27)")

  assert errors.run_cli(checkpoint_write) == 2
  assert error_line(capsys) == ("error: No space left on device: /runs/x/checkpoints/3.orbax-checkpoint-tmp/state/d/67e1 "
                                "(ValueError)")
  assert errors.run_cli(adapter_write) == 2
  assert error_line(capsys) == "error: File too large (SafetensorError)"

  def not_the_environment():
    raise SafetensorError("Error while deserializing header: invalid argument (os error 22)")

  with pytest.raises(SafetensorError):
    errors.run_cli(not_the_environment)


def test_refusal_classes_keep_their_builtin_bases():
  from jaxsft import chat, config, export, generate, run_files, sharding
  from jaxsft.data import DataError
  from jaxsft.data.store import StoreError
  from jaxsft.train.state import TrainingError

  for cls, base in ((config.ConfigError, ValueError), (DataError, ValueError), (run_files.MetricsError, ValueError),
                    (sharding.MeshError, ValueError), (TrainingError, RuntimeError), (StoreError, ValueError),
                    (generate.PromptTooLong, ValueError), (chat.ChatError, Exception), (export.ExportError, Exception),
                    (errors.ModelError, ValueError)):
    assert issubclass(cls, errors.JaxsftError) and issubclass(cls, base), cls
  assert chat.EXIT_USAGE is errors.EXIT_USAGE and export.EXIT_USAGE is errors.EXIT_USAGE


# ---------------------------------------------------------------------------------------------
# An unsupported architecture, in every command that takes --model.


@pytest.fixture
def bert_dir(tmp_path):
  folder = tmp_path / "bert"
  folder.mkdir()
  (folder / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"],
                                                  "hidden_size": 64, "num_hidden_layers": 2}))
  return folder


def run_with_model(command: str, model, tmp_path, run_cli, shared_data):
  """`command` (train, chat, export, data build) run on `--model model` as a user types it: (its
  result, the folder it writes to, which a refused command must not create)."""
  import importlib

  data = next(p for p in sorted(shared_data.iterdir()) if p.suffix in (".jsonl", ".json"))
  out = tmp_path / "out"
  module, argv = {
      "train": ("jaxsft.train", ["--model", model, "--data", data, "--output-dir", out, "--max-steps", 1]),
      "chat": ("jaxsft.chat", ["--model", model, "--prompt", "hi"]),
      "export": ("jaxsft.export", ["--model", model, "--out", out]),
      "data build": ("jaxsft.data.__main__", ["build", "--data", data, "--model", model,
                                              "--cache-dir", tmp_path / "tokens"]),
  }[command]
  return run_cli(importlib.import_module(module).main, argv), out


@pytest.mark.parametrize("command", ["train", "chat", "export", "data build"])
def test_unsupported_architecture_is_one_error_line_in_every_command(command, bert_dir, tmp_path, run_cli,
                                                                     shared_data):
  """Refused before any weight or tokenizer is read: one `error:` line naming the architecture and
  the supported ones, exit 2, nothing written."""
  r, out = run_with_model(command, bert_dir, tmp_path, run_cli, shared_data)
  assert r.returncode == 2, r.stderr[-3000:]
  line = only_error_line(r.stderr)
  assert "'bert'" in line and "llama" in line and "qwen2" in line, line  # the supported list
  assert not out.exists()


@pytest.mark.parametrize("command", ["train", "chat", "export", "data build"])
@pytest.mark.parametrize("model", ["missing folder", "hub id offline"])
def test_a_model_that_cannot_be_found_is_one_error_line_in_every_command(command, model, tmp_path, run_cli,
                                                                         shared_data, monkeypatch):
  """A mistyped folder, or a hub id neither cached nor reachable (HF_HUB_OFFLINE), is one `error:`
  line naming the model, exit 2, nothing written; not transformers' or the resolver's traceback."""
  from huggingface_hub import constants

  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
  monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty Hugging Face cache
  name = {"missing folder": str(tmp_path / "no-such-model"), "hub id offline": "jaxsft-tests/no-such-model"}[model]
  r, out = run_with_model(command, name, tmp_path, run_cli, shared_data)
  assert r.returncode == 2, r.stderr[-3000:]
  line = only_error_line(r.stderr)
  assert line.startswith(f"error: model {name!r}: "), line
  assert ("HF_HUB_OFFLINE is set" if model == "hub id offline" else "no such directory") in line, line
  assert not out.exists()


@pytest.mark.parametrize("command", ["train", "chat", "export"])
@pytest.mark.parametrize("missing", ["tokenizer", "safetensors"])
def test_a_model_folder_without_its_tokenizer_or_weights_is_one_error_line(command, missing, tiny_run, tmp_path,
                                                                          run_cli, shared_data):
  folder = tmp_path / "incomplete"
  folder.mkdir()
  for path in tiny_run["model"].iterdir():
    if not (path.name.startswith("tokenizer") if missing == "tokenizer" else path.suffix == ".safetensors"):
      (folder / path.name).symlink_to(path)
  if missing == "safetensors":
    (folder / "pytorch_model.bin").write_bytes(b"")
  r, out = run_with_model(command, folder, tmp_path, run_cli, shared_data)
  assert r.returncode == 2, r.stderr[-3000:]
  line = only_error_line(r.stderr)
  if missing == "tokenizer":
    assert f"model '{folder}': its tokenizer does not load from" in line and "needs tokenizer.json" in line, line
  else:
    assert f"{folder}: no *.safetensors weights (found ['pytorch_model.bin']: convert them" in line, line
  assert not out.exists()


def test_unsupported_architecture_prints_no_traceback_from_the_shell(bert_dir, tmp_path):
  r = subprocess.run([sys.executable, "-m", "jaxsft.export", "--model", str(bert_dir), "--out", str(tmp_path / "o")],
                     capture_output=True, text=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
  assert r.stderr.strip().splitlines()[-1].startswith("error: ") and "bert" in r.stderr


# ---------------------------------------------------------------------------------------------
# export never deletes what it exports from.


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tokenizer):
  from tuned_tiny import make_adapter, make_model_dir, make_run_dir

  root = tmp_path_factory.mktemp("faults-export")
  model = make_model_dir(root / "base", tokenizer)
  run = make_run_dir(root / "runs" / "run", model, make_adapter(model, root / "adapter"))
  (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
  (run / "checkpoints" / "1").mkdir(parents=True)
  return {"root": root, "model": model, "run": run}


def tree(folder: pathlib.Path) -> dict[str, int]:
  return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def test_export_refuses_an_out_that_is_contains_or_lies_inside_its_source(tiny_run, tmp_path, capsys):
  from jaxsft import export

  run, model = tiny_run["run"], tiny_run["model"]
  (tmp_path / "notes").mkdir()
  (tmp_path / "notes" / "todo.txt").write_text("mine")
  before = {p: tree(p) for p in (tiny_run["root"], tmp_path)}
  cases = {
      "the run": ([str(run)], run, "overlaps the run"),
      "the run's parent": ([str(run)], run.parent, "overlaps the run"),
      "inside the run": ([str(run)], run / "exported", "overlaps the run"),
      "the adapter": (["--model", str(model), "--adapter", str(run / "adapter")], run / "adapter", "overlaps the adapter"),
      "the base model": (["--model", str(model), "--adapter", str(run / "adapter")], model, "overlaps the model"),
      "no earlier export": ([str(run)], tmp_path / "notes", "not one"),
  }
  for name, (source, out, message) in cases.items():
    assert export.main([*source, "--out", str(out), "--overwrite"]) == 2, name
    line = error_line(capsys)
    assert message in line, (name, line)
  assert {p: tree(p) for p in before} == before  # nothing deleted, nothing written


# ---------------------------------------------------------------------------------------------
# One writer per run directory.

_HOLD_LOCK = """
import sys, time
from jaxsft.run_files import RunLock
RunLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(600)
"""


class LogLines(logging.Handler):
  """The messages of one jaxsft logger (jaxsft's loggers do not propagate to caplog's root)."""

  def __init__(self, name: str):
    super().__init__()
    self.logger, self.messages = logging.getLogger(name), []

  def emit(self, record):
    self.messages.append(record.getMessage())

  def __enter__(self):
    self.logger.addHandler(self)
    return self.messages

  def __exit__(self, *exc):
    self.logger.removeHandler(self)


def test_a_run_directory_has_one_writer_and_a_dead_writers_lock_is_taken_over(tmp_path, capsys):
  from jaxsft import run_files, train

  run = tmp_path / "run"
  holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(run)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
  try:
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(run_files.RunLocked, match=f"pid {holder.pid} on "):
      run_files.RunLock(run).acquire()
    # The command refuses before loading anything (the second of two runs started together).
    assert train.main(["--output-dir", str(run), "--max-steps", "1"]) == 2
    line = error_line(capsys)
    assert f"pid {holder.pid}" in line and "--output-dir" in line
    assert sorted(p.name for p in run.iterdir()) == ["run.lock"]
  finally:
    holder.kill()  # as kill -9: the lock file stays, its flock goes with the process
    holder.wait()
  assert (run / "run.lock").exists()
  with LogLines("jaxsft.run_files") as messages:
    lock = run_files.RunLock(run).acquire()
  assert len(messages) == 1 and f"pid {holder.pid}" in messages[0] and "stale" in messages[0]
  assert json.loads((run / "run.lock").read_text())["pid"] == os.getpid()
  lock.release()
  assert not (run / "run.lock").exists()


def test_a_refused_run_leaves_no_folder_behind(tmp_path, capsys):
  from jaxsft import train

  out = tmp_path / "new-run"
  assert train.main(["--output-dir", str(out), "--data.max_length", "0"]) == 2
  assert "data.max_length" in error_line(capsys)
  assert not out.exists()


# ---------------------------------------------------------------------------------------------
# metrics.jsonl after a crash.


def test_a_cut_last_metrics_line_is_ignored_and_dropped_on_resume(tmp_path):
  from jaxsft import run_files

  files = run_files.RunFiles(tmp_path)
  lines = ['{"event": "config", "steps_per_epoch": 4}', '{"step": 1, "loss": 2.5}', '{"step": 2, "loss": 2.25}']
  files.metrics.write_text("\n".join(lines) + '\n{"step": 3, "lo')  # the crash cut the last write
  log = run_files.read_metrics(tmp_path)
  assert log.train_steps == [1, 2] and log.train_loss == [2.5, 2.25]
  files.truncate_metrics(last_step=2)
  assert files.metrics.read_text().splitlines() == lines
  files.log({"step": 3, "loss": 2.0})
  assert run_files.read_metrics(tmp_path).train_steps == [1, 2, 3]
  # A damaged line anywhere else is still named.
  files.metrics.write_text(lines[0] + '\n{"step": 1, "lo\n' + lines[2] + "\n")
  with pytest.raises(run_files.MetricsError, match=r"metrics.jsonl:2: not valid JSON"):
    run_files.read_metrics(tmp_path)


# ---------------------------------------------------------------------------------------------
# Values checked where they are read: the config at parse time, an adapter's config on load.


@pytest.mark.slow
def test_config_ranges_are_checked_at_parse_time_naming_the_key():
  from jaxsft import config, config_args

  for args, key in ((["--lr=-1e-3"], "optim.lr"), (["--lr", "-0.001"], "optim.lr"), (["--lr", "nan"], "optim.lr"),
                    (["data.tokens_per_batch=0"], "data.tokens_per_batch"),
                    (["data.tokens_per_batch=-8"], "data.tokens_per_batch"),
                    (["--data.max_length", "0"], "data.max_length"), (["--data.num_buckets", "0"], "data.num_buckets"),
                    (["data.bucket_lengths=[64,0]"], "data.bucket_lengths"), (["optim.grad_accum=0"], "optim.grad_accum"),
                    (["data.val_fraction=1"], "data.val_fraction"), (["keep_checkpoints=0"], "keep_checkpoints"),
                    (["lora.r=0"], "lora.r"), (["lora.alpha=inf"], "lora.alpha")):
    with pytest.raises(config.ConfigError, match=key.replace(".", r"\.")):
      config_args.parse_args(args)
  cfg = config_args.parse_args(["--lr", "1e-3", "data.tokens_per_batch=4096", "mesh.data=-1", "data.val_fraction=0"])
  assert cfg.optim.lr == 1e-3 and cfg.data.tokens_per_batch == 4096


@pytest.mark.parametrize("field, value, message", [
    ("r", 0, "r must be a whole number >= 1"), ("r", 16.7, "r must be a whole number >= 1"),
    ("lora_alpha", float("nan"), "lora_alpha must be a finite number > 0"),
    ("lora_dropout", 1.5, "lora_dropout must be in [0, 1)"), ("r", True, "field r is missing or not a number")])
def test_adapter_config_values_are_checked_like_the_config(tiny_run, tmp_path, field, value, message):
  import shutil

  from jaxsft import lora

  adapter = shutil.copytree(tiny_run["run"] / "adapter", tmp_path / "adapter")
  config = json.loads((adapter / "adapter_config.json").read_text())
  (adapter / "adapter_config.json").write_text(json.dumps({**config, field: value}))
  with pytest.raises(lora.AdapterError, match=re.escape(message)):
    lora._read_adapter_config(adapter / "adapter_config.json")


def test_bad_adapters_in_chat_are_one_error_line(tiny_run, tmp_path, capsys):
  import shutil

  from jaxsft import chat

  zero = shutil.copytree(tiny_run["run"] / "adapter", tmp_path / "r0")
  config = json.loads((zero / "adapter_config.json").read_text())
  (zero / "adapter_config.json").write_text(json.dumps({**config, "r": 0}))
  huge = shutil.copytree(tiny_run["run"] / "adapter", tmp_path / "huge-header")
  (huge / "adapter_model.safetensors").write_bytes((2**40).to_bytes(8, "little") + b"{}")
  deep = shutil.copytree(tiny_run["run"] / "adapter", tmp_path / "deep")
  (deep / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
  for adapter, message in ((zero, "field r must be a whole number"), (huge, "not a readable safetensors file"),
                           (deep, "nested too deeply")):
    assert chat.main(["--model", str(tiny_run["model"]), "--adapter", str(adapter), "--prompt", "hi"]) == 2
    assert message in error_line(capsys), adapter


# ---------------------------------------------------------------------------------------------
# A diverging run keeps its last good checkpoint.


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, tokenizer):
  from tiny_model import make_tiny_model_dir

  return make_tiny_model_dir(tmp_path_factory.mktemp("faults-tiny") / "model", tokenizer)


def tiny_train_args(model_dir, out, *extra):
  return ["--model", str(model_dir), "--output-dir", str(out), "data.synthetic_size=48", "data.batch_size=8",
          "data.num_buckets=1", "data.tokens_per_batch=none", "eval.eval_every=0", "eval.generate=false", "data.time_shapes=false",
          # A constant rate: runs of different max_steps share one compiled step (see test_train.base_args).
          "optim.schedule=constant", "optim.warmup_steps=0", "--no-progress", "--model.dtype", "float32", *extra]


@pytest.mark.slow
def test_a_diverging_run_saves_no_poisoned_checkpoint_and_keeps_the_last_good_one(tiny_model_dir, tmp_path, capsys):
  """lr 1e38 after a linear warm-up from 0: step 1's update is zero (good weights), step 2's
  throws the weights to ~1e38 (finite, but every later loss is NaN), steps 3-4 are skipped."""
  import numpy as np

  from jaxsft import io as jaxsft_io
  from jaxsft import lora, models, train

  out = tmp_path / "run"
  code = train.main(tiny_train_args(tiny_model_dir, out, "--lr", "1e38", "optim.schedule=constant",
                                    "optim.warmup_steps=4", "save_every=1", "max_steps=8", "max_nonfinite_steps=2",
                                    "data.val_fraction=0"))
  assert code == 2
  line = error_line(capsys)
  assert "non-finite" in line and "newest good checkpoint (step 1)" in line, line
  assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["1"]  # 2 was deleted, 3 and 4 never saved
  records = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
  assert [r.get("skipped", False) for r in records] == [False, False, True, True]
  model, _ = models.load_model(str(tiny_model_dir))
  lora.load_adapter(model, out / "adapter")  # rewritten from checkpoint 1: finite, as the weights of step 1
  assert all(np.isfinite(np.asarray(x)).all() for x in lora.adapter_tensors(model).values())
  assert not any(jaxsft_io.TEMP_NAME.match(p.name) for p in out.iterdir())


# ---------------------------------------------------------------------------------------------
# A real full disk: the run folder on a small file system that fills up mid-run.


@contextlib.contextmanager
def small_file_system(folder: pathlib.Path, size: str):
  """A tmpfs of `size` mounted at `folder`; yields a function that resizes it. Mounting needs the
  privilege to (root in a container that allows it); without it the test is skipped, saying why."""
  folder.mkdir(parents=True)
  mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True,
                           text=True)
  if mounted.returncode:
    pytest.skip(f"cannot mount a small file system here: {mounted.stderr.strip()}")
  try:
    yield lambda new_size: subprocess.run(["mount", "-o", f"remount,size={new_size}", str(folder)], check=True)
  finally:
    subprocess.run(["umount", "--lazy", str(folder)], check=False)


@pytest.mark.slow  # two runs in fresh interpreters
def test_a_full_disk_mid_run_is_one_error_line_and_resume_finishes_the_run(tiny_model_dir, tmp_path):
  """1.2 MB holds two checkpoints of the tiny model's LoRA state (~0.45 MB each with AdamW's
  moments) and the adapter, so the third save finds the disk full. The run must stop with one
  `error:` line naming the full disk (no traceback from orbax's writer threads, no asyncio noise),
  leave the checkpoints it completed whole, and, given room, resume from the newest to the end."""
  disk = tmp_path / "disk"
  out = disk / "run"
  args = tiny_train_args(tiny_model_dir, out, "save_every=1", "max_steps=8", "data.val_fraction=0", "--lr", "1e-3")
  env = {**os.environ, "HF_HUB_OFFLINE": "1"}

  def train(*extra):
    return subprocess.run([sys.executable, "-m", "jaxsft.train", *args, *extra], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)

  with small_file_system(disk, "1200k") as resize:
    full = train()
    assert full.returncode == 2, full.stderr[-3000:]
    assert "Traceback" not in full.stderr and "Exception ignored" not in full.stderr, full.stderr[-3000:]
    lines = [line for line in full.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: No space left on device") and str(out) in lines[-1], lines[-1]
    noise = [line for line in lines[:-1] if not re.match(r"\d\d:\d\d:\d\d jaxsft\.", line)]
    assert noise == [], noise[:10]  # only the run's own log lines before it
    saved = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    assert saved and max(saved) < 8, saved
    resize("64m")
    resumed = train("--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from step {max(saved)}" in resumed.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 9))  # every step once, none lost
    assert json.loads((out / "summary.json").read_text())["steps"] == 8


# ---------------------------------------------------------------------------------------------
# Fault injection: the writer dies at each point of the adapter swap, the checkpoint save and
# the export (tests/crash_writer.py); every reader afterwards finds a whole old or whole new
# artifact, and the next start of the writer removes what the dead one left.

CRASH_WRITER = ROOT / "tests" / "crash_writer.py"


def crash_runs(kind: str, folders: list[pathlib.Path], *args: str, env=None) -> tuple[int, list]:
  """Runs the writer to completion in folders[0] (to count its points), then once per point in
  folders[1:] in parallel, each dying at its point. Returns (points, results of the crash runs)."""
  env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}

  def start(folder, n):
    return subprocess.Popen([sys.executable, str(CRASH_WRITER), kind, str(folder), str(n), *map(str, args)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

  whole = start(folders[0], 10**6)
  out, err = whole.communicate(timeout=600)
  assert whole.returncode == 0, err[-3000:]
  points = int(err.split("completed after ")[1].split()[0])
  assert points >= 2, err
  runs = [start(folders[n], n) for n in range(1, points + 1)]
  results = []
  for n, run in enumerate(runs, 1):
    out, err = run.communicate(timeout=600)
    assert run.returncode == 86, (n, err[-3000:])  # died where it was told to
    results.append(err)
  return points, results


def hidden(folder: pathlib.Path) -> list[str]:
  return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_killed_adapter_swap_leaves_a_whole_adapter(tmp_path, exchange):
  from jaxsft import io as jaxsft_io
  from jaxsft import run_files

  def version_of(adapter: pathlib.Path) -> str:
    config = json.loads((adapter / "adapter_config.json").read_text())
    weights = (adapter / "adapter_model.safetensors").read_bytes()
    assert weights == config["version"].encode() * 1000, "a mix of two adapters"
    return config["version"]

  env = {} if exchange else {"CRASH_WRITER_NO_EXCHANGE": "1"}
  runs = [tmp_path / f"run{n}" for n in range(12)]
  for run in runs:
    jaxsft_io.replace_directory(run / "adapter", lambda tmp: (
        jaxsft_io.write_json(tmp / "adapter_config.json", {"peft_type": "LORA", "version": "old"}),
        jaxsft_io.atomic_write(tmp / "adapter_model.safetensors", lambda f: f.write(b"old" * 1000), binary=True)))
  points, _ = crash_runs("adapter", runs, "new", env=env)
  assert points < len(runs)
  assert version_of(runs[0] / "adapter") == "new"
  seen = set()
  for run in runs[1:points + 1]:
    if exchange:  # the reader right after the crash, before any writer starts again
      seen.add(version_of(run / "adapter"))
    files = run_files.RunFiles(run)
    files.lock()  # the next start of the writer: the dead writer's temps go (its .old copy comes back)
    files.unlock()
    seen.add(version_of(run / "adapter"))
    assert hidden(run) == [], hidden(run)
  assert seen == {"old", "new"}


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_a_folder_another_writer_publishes_first_is_replaced_whole(tmp_path, monkeypatch, exchange):
  """Two processes caching the same model's tokenizer: both find no folder and fill one; the other
  publishes its folder just before this one renames its own into place. A plain rename onto a
  folder with files fails, so this writer swaps its folder in as over any old one."""
  from jaxsft import io as jaxsft_io

  if not exchange:
    monkeypatch.setattr(jaxsft_io, "_exchange", lambda a, b: False)
  target = tmp_path / "tokenizer"
  other = tmp_path / "other-writers-folder"
  other.mkdir()
  (other / "tokenizer.json").write_text("first")

  def other_writer_first(rename):
    def call(src, dst):
      if pathlib.Path(dst) == target and other.exists():
        real_rename(other, target)
      return rename(src, dst)
    return call

  real_rename = os.rename
  monkeypatch.setattr(os, "rename", other_writer_first(os.rename))
  monkeypatch.setattr(os, "replace", other_writer_first(os.replace))
  jaxsft_io.replace_directory(target, lambda tmp: [(tmp / n).write_text("second") for n in ("tokenizer.json", "vocab.json")])
  assert not other.exists()  # it was published, then swapped out
  assert {p.name: p.read_text() for p in target.iterdir()} == {"tokenizer.json": "second", "vocab.json": "second"}
  assert hidden(tmp_path) == []


@pytest.mark.slow
def test_killed_checkpoint_save_leaves_the_old_or_the_new_checkpoint_whole(tmp_path):
  import jax.numpy as jnp

  from jaxsft import run_files
  from jaxsft.train.checkpoints import Checkpoints
  from jaxsft.train.state import RunState

  runs = [tmp_path / f"run{n}" for n in range(8)]
  points, _ = crash_runs("checkpoint", runs)
  restored = set()
  for run in runs[:points + 1]:
    files = run_files.RunFiles(run)
    files.lock()  # the next start of the trainer
    files.unlock()
    template = RunState(trainable={"a": jnp.zeros((4, 3))}, opt_state={"m": jnp.zeros((3,))})
    checkpoints = Checkpoints(files, keep=2)
    try:
      state = checkpoints.restore_newest(template, lambda data_state: None)
    finally:
      checkpoints.close()
    step = state.step
    assert step in (1, 2)
    assert float(state.trainable["a"].min()) == float(state.trainable["a"].max()) == step  # whole, of one step
    assert float(state.opt_state["m"][0]) == -step and state.data_state == {"position": step}
    assert state.epoch_nll == step
    restored.add(step)
    assert not [p.name for p in (run / "checkpoints").iterdir() if "tmp" in p.name]  # the restart cleaned up
  assert restored == {1, 2}


def test_a_checkpoint_that_names_its_params_lora_still_resumes(tmp_path):
  """Checkpoints written before the trainable params were named `trainable` (full fine-tuning
  included) saved them under "lora"; a resume reads either."""
  import grain
  import jax.numpy as jnp
  import orbax.checkpoint as ocp

  from jaxsft import run_files
  from jaxsft.train.checkpoints import Checkpoints, SavedIteratorState
  from jaxsft.train.state import RunState

  files = run_files.RunFiles(tmp_path / "run")
  checkpoints = Checkpoints(files, keep=2)
  try:
    checkpoints.manager.save(3, args=ocp.args.Composite(
        state=ocp.args.StandardSave({"lora": {"a": jnp.full((4, 3), 3.0)}, "opt_state": {"m": jnp.full((3,), -3.0)}}),
        data_iter=grain.checkpoint.CheckpointSave(SavedIteratorState({"position": 3})),
        meta=ocp.args.JsonSave({"epoch_nll": 3.0})))
    checkpoints.manager.wait_until_finished()
    template = RunState(trainable={"a": jnp.zeros((4, 3))}, opt_state={"m": jnp.zeros((3,))})
    state = checkpoints.restore_newest(template, lambda data_state: None)
    assert state.step == 3 and float(state.trainable["a"].min()) == 3.0 and float(state.opt_state["m"][0]) == -3.0
    assert state.data_state == {"position": 3} and state.epoch_nll == 3.0
    checkpoints.save(dataclasses.replace(state, step=4))  # a new save uses the new name
    checkpoints.manager.wait_until_finished()
    assert checkpoints._trainable_key(4) == "trainable" and checkpoints._trainable_key(3) == "lora"
    assert checkpoints.restore_newest(template, lambda data_state: None).step == 4
  finally:
    checkpoints.close()


@pytest.mark.slow
def test_killed_export_leaves_the_old_or_the_new_export_whole(tiny_run, tmp_path):
  from jaxsft import export
  from jaxsft import io as jaxsft_io

  old = export.export(str(tiny_run["model"]), None, tmp_path / "first")
  old_tree = tree(old)
  outs = [tmp_path / f"out{n}" for n in range(8)]
  for out in outs:
    shutil.copytree(old, out)
  # Each run re-exports over an earlier export with --overwrite, as GGUF (a different tree).
  points, _ = crash_runs("export", outs, "--model", str(tiny_run["model"]), "--format", "gguf", "--overwrite",
                         "--out")  # crash_writer puts the folder after --out
  new_tree = tree(outs[0])
  assert new_tree != old_tree and "model.gguf" in new_tree
  found = set()
  for out in outs[1:points + 1]:
    found.add("new" if tree(out) == new_tree else "old" if tree(out) == old_tree else f"broken {tree(out)}")
    jaxsft_io.remove_leftovers(out)  # as the next export to `out` does first
    assert [name for name in hidden(out.parent) if name.startswith(f".{out.name}.")] == []
  assert found <= {"old", "new"} and "old" in found, found


def test_doctor_calls_a_collapse_to_the_uniform_loss_diverging_not_flat(tmp_path):
  """lr 1e4: one update throws the weights where the output is flat; the loss sits at
  ln(vocab) and the gradients are 0 from then on."""
  import math

  from jaxsft import doctor

  uniform = math.log(49152)
  losses = [2.3] + [uniform] * 19
  grads = [3.1] + [0.0] * 19
  lines = [{"event": "config", "steps_per_epoch": 20}]
  lines += [{"step": i + 1, "loss": loss, "grad_norm": g} for i, (loss, g) in enumerate(zip(losses, grads))]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
  diagnosis = doctor.diagnose_run(tmp_path)
  assert diagnosis.pattern == "diverging", diagnosis.report()
  assert "gradients vanished" in diagnosis.summary and "raise the learning rate" not in diagnosis.report()
  # The same curve with its gradients alive is not called a collapse (the rule needs both signs).
  alive = doctor.diagnose(list(range(1, 21)), losses, grad_norm=[3.1] * 20)
  assert "gradients vanished" not in alive.summary


_RESTORE = """
import sys
import jax.numpy as jnp
from jaxsft import run_files
from jaxsft.train.checkpoints import Checkpoints
from jaxsft.train.state import RunState
checkpoints = Checkpoints(run_files.RunFiles(sys.argv[1]), keep=2)
template = RunState(trainable={"a": jnp.zeros((4, 3))}, opt_state={"m": jnp.zeros((3,))})
print("restored", checkpoints.restore_newest(template, lambda data_state: None).step, file=sys.stderr)
checkpoints.close()
"""


@pytest.mark.slow
def test_skipping_a_damaged_checkpoint_prints_no_event_loop_tracebacks(tmp_path):
  run = tmp_path / "run"
  writer = subprocess.run([sys.executable, str(CRASH_WRITER), "checkpoint", str(run), str(10**6)], cwd=ROOT,
                                    capture_output=True, text=True, timeout=600)
  assert writer.returncode == 0, writer.stderr[-3000:]
  chunks = sorted((run / "checkpoints" / "2" / "state" / "d").iterdir())
  assert chunks
  for chunk in chunks:  # every array chunk of step 2 cut short
    chunk.write_bytes(chunk.read_bytes()[:20])
  r = subprocess.run([sys.executable, "-c", _RESTORE, str(run)], cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "checkpoint" in r.stderr and "is damaged" in r.stderr and "restored 1" in r.stderr
  assert "Traceback" not in r.stderr and "Event loop is closed" not in r.stderr, r.stderr[-3000:]


def test_json_nested_100000_deep_is_a_data_error_naming_the_file(tmp_path, capsys):
  from jaxsft import data as data_lib
  from jaxsft.data import __main__ as data_main

  array = tmp_path / "deep.json"
  array.write_text("[" * 100_000 + "]" * 100_000)
  lines = tmp_path / "deep.jsonl"
  lines.write_text('{"instruction": "a", "output": "b"}\n' + '{"a": ' * 100_000 + "1" + "}" * 100_000 + "\n")
  for path, where in ((array, "line 1"), (lines, "line 2")):
    with pytest.raises(data_lib.DataError, match=rf"{re.escape(str(path))}: {where}: .*nested deeper"):
      data_lib.load_records(str(path))
  assert data_main.main(["build", "--data", str(array), "--cache-dir", str(tmp_path / "tokens")]) == 2
  assert "nested deeper" in error_line(capsys)


@pytest.mark.slow
def test_summary_data_counts_after_resume_cover_the_whole_run(tiny_model_dir, tmp_path, capsys):
  from jaxsft import train

  common = ["data.val_fraction=0", "save_every=2", "--lr", "1e-3"]
  assert train.main(tiny_train_args(tiny_model_dir, tmp_path / "straight", *common, "max_steps=4")) == 0
  assert train.main(tiny_train_args(tiny_model_dir, tmp_path / "resumed", *common, "max_steps=2")) == 0
  assert train.main(tiny_train_args(tiny_model_dir, tmp_path / "resumed", *common, "max_steps=4", "--resume")) == 0
  capsys.readouterr()
  straight, resumed = (json.loads((tmp_path / name / "summary.json").read_text()) for name in ("straight", "resumed"))
  assert resumed["steps"] == straight["steps"] == 4
  assert resumed["data"] == straight["data"], (resumed["data"], straight["data"])


def test_hostile_model_headers_are_one_error_line(tmp_path, capsys):
  import struct

  from jaxsft import export

  gguf = tmp_path / "huge.gguf"  # magic, version 3, 2**62 tensors, no metadata
  gguf.write_bytes(b"GGUF" + struct.pack("<I", 3) + struct.pack("<Q", 2**62) + struct.pack("<Q", 0))
  folder = tmp_path / "st"
  folder.mkdir()
  from jaxsft import models
  from tiny_model import TINY

  (folder / "config.json").write_text(json.dumps(models.to_hf_config(TINY)))
  (folder / "model.safetensors").write_bytes((2**40).to_bytes(8, "little") + b"{}")
  for model, message in ((gguf, "not a readable GGUF file"), (folder, "not a readable safetensors file")):
    assert export.main(["--model", str(model), "--out", str(tmp_path / "out")]) == 2
    assert message in error_line(capsys)
  assert not (tmp_path / "out").exists()


def test_a_chat_template_the_sandbox_rejects_is_one_error_line_in_chat(tiny_run, tmp_path, capsys):
  from jaxsft import chat

  model = shutil.copytree(tiny_run["model"], tmp_path / "model")
  hostile = "{{ ''.__class__.__mro__[1].__subclasses__() }}{% for m in messages %}{{ m.content }}{% endfor %}"
  if (model / "chat_template.jinja").exists():
    (model / "chat_template.jinja").write_text(hostile)
  config = json.loads((model / "tokenizer_config.json").read_text())
  if "chat_template" in config or not (model / "chat_template.jinja").exists():
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": hostile}))
  assert chat.main(["--model", str(model), "--prompt", "hi"]) == 2
  line = error_line(capsys)
  assert "chat template rejects" in line and "unsafe" in line, line


def test_a_dead_builders_half_built_token_store_is_removed_by_the_next_build(tokenizer, tmp_path):
  from jaxsft.data import store, synthetic

  data = synthetic.write_jsonl(synthetic.make_dataset(8, seed=3), tmp_path / "tasks.jsonl")
  cache = tmp_path / "tokens"
  key, _ = store.store_key(str(data), tokenizer, max_length=64, train_on="all_assistant", fmt="auto", field_map=None,
                           on_error="raise")
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
  host = __import__("socket").gethostname().replace(".", "_")
  left = cache / f".{key}.{host}-{int(dead.stdout)}.abcd1234.tmp"  # as a builder killed mid-build leaves it
  (left / "part").mkdir(parents=True)
  result = store.open_or_build(str(data), tokenizer, max_length=64, cache_dir=cache)
  assert result.built and not left.exists()
  assert sorted(p.name for p in cache.iterdir()) == [key]


def test_written_files_and_folders_get_the_mode_a_plain_write_would(tiny_run, tokenizer, tmp_path):
  """Files published from a temp (the adapter, an export, a token store, a JSON file) are as readable
  as the umask lets a plain `open(..., "w")` make them: tempfile and safetensors make theirs private."""
  from tuned_tiny import make_adapter

  from jaxsft import export
  from jaxsft import io as jaxsft_io
  from jaxsft.data import store, synthetic

  data = synthetic.write_jsonl(synthetic.make_dataset(8, seed=3), tmp_path / "tasks.jsonl")
  before = os.umask(0o027)
  try:
    written = [make_adapter(tiny_run["model"], tmp_path / "adapter"),
               export.export(str(tiny_run["model"]), None, tmp_path / "exported"),
               store.open_or_build(str(data), tokenizer, max_length=64, cache_dir=tmp_path / "tokens").store.folder,
               jaxsft_io.write_json(tmp_path / "notes" / "summary.json", {"a": 1}).parent]
  finally:
    os.umask(before)
  modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777)
           for folder in written for p in [folder, *folder.rglob("*")]}
  assert any(name.endswith(".safetensors") for name in modes), modes
  wrong = {name: mode for name, mode in modes.items()
           if mode != oct(0o750 if (tmp_path / name).is_dir() else 0o640)}
  assert wrong == {}, wrong
