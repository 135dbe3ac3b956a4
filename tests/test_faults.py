"""Faults and bad inputs: every refusal is one `error:` line and exit 2 (a bug keeps its
traceback); nothing a writer leaves after a crash at any point is half an artifact; a run
directory has one writer; export never deletes its own source; a diverging run keeps its last
good checkpoint."""

import errno
import json
import os
import pathlib
import subprocess
import sys

import pytest

from jaxsft import errors

ROOT = pathlib.Path(__file__).resolve().parents[1]


def error_line(capsys) -> str:
  """The refusal's `error:` line: the only one, the last on stderr (log lines may come before),
  no traceback."""
  err = capsys.readouterr().err
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


def test_refusal_classes_keep_their_builtin_bases():
  from jaxsft import chat, config, export, generate, run_files, sharding, train
  from jaxsft.data import DataError
  from jaxsft.data.store import StoreError

  for cls, base in ((config.ConfigError, ValueError), (DataError, ValueError), (run_files.MetricsError, ValueError),
                    (sharding.MeshError, ValueError), (train.TrainingError, RuntimeError), (StoreError, ValueError),
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


def test_unsupported_architecture_is_one_error_line_in_every_command(bert_dir, tmp_path, capsys, shared_data):
  from jaxsft import chat, export, train
  from jaxsft.data import __main__ as data_main

  data = next(p for p in sorted(shared_data.iterdir()) if p.suffix in (".jsonl", ".json"))
  out = tmp_path / "out"
  commands = {
      "train": lambda: train.main(["--model", str(bert_dir), "--output-dir", str(out), "--max-steps", "1"]),
      "chat": lambda: chat.main(["--model", str(bert_dir), "--prompt", "hi"]),
      "export": lambda: export.main(["--model", str(bert_dir), "--out", str(out)]),
      "data build": lambda: data_main.main(["build", "--data", str(data), "--model", str(bert_dir),
                                            "--cache-dir", str(tmp_path / "tokens")]),
  }
  for name, command in commands.items():
    assert command() == 2, name
    line = error_line(capsys)
    assert "'bert'" in line and "llama" in line and "qwen2" in line, (name, line)  # the supported list
    assert not out.exists(), name


def test_unsupported_architecture_prints_no_traceback_from_the_shell(bert_dir, tmp_path):
  r = subprocess.run([sys.executable, "-m", "jaxsft.export", "--model", str(bert_dir), "--out", str(tmp_path / "o")],
                     capture_output=True, text=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
  assert r.stderr.strip().splitlines()[-1].startswith("error: ") and "bert" in r.stderr
