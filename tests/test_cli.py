"""The `jaxsft` command line (`jaxsft.cli`): each command forwarded to its module's `main`."""

import os
import pathlib
import subprocess
import sys

import jaxsft
from jaxsft import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_jaxsft_help_lists_every_command(run_cli):
  r = run_cli(cli.main, ["--help"])
  assert r.returncode == 0, r.stderr
  for name in ("train", "chat", "export", "data", "doctor", "evaluate"):
    assert f"\n  {name} " in r.stdout, (name, r.stdout)


def test_a_command_forwards_its_arguments_to_the_module_main(run_cli):
  r = run_cli(cli.main, ["doctor", "--help"])
  assert r.returncode == 0, r.stderr
  assert r.stdout.startswith("usage: jaxsft doctor") and "--json" in r.stdout


def test_every_command_names_itself_jaxsft_command_and_takes_the_run_folder_as_run_dir(run_cli):
  for name in cli.COMMANDS:
    r = run_cli(cli.main, [name, "--help"])
    assert r.returncode == 0, (name, r.stderr)
    assert r.stdout.startswith(f"usage: jaxsft {name} "), (name, r.stdout[:200])
    # data's RUN_DIR is where stats reads a measured cost (--cost-from), its subject a data file
    usage = run_cli(cli.main, [name, "stats", "--help"]).stdout if name == "data" else r.stdout
    assert "RUN_DIR" in usage, (name, usage[:400])
    assert "python -m" not in r.stdout, name


_LOADED_AFTER = """
import sys
from jaxsft import cli
try:
  status = cli.main(sys.argv[1:])
except SystemExit as e:  # argparse's help and usage errors
  status = e.code
print(status, sorted(m for m in ("jax", "flax", "grain", "torch") if m in sys.modules))
"""


def test_help_and_a_refused_config_answer_before_jax_is_loaded():
  """Every command reads its arguments before it imports what it runs: `--help`, a value the
  config refuses or two keys it refuses together (one error line, status 2) load none of JAX,
  Flax, Grain or torch."""
  refused = {"optim.lr: 'abc' is not a valid float": ["train", "--lr", "abc"],
             "data.mix and data.path are both set": ["train", "--data", "a.jsonl", "--data.mix", "b.jsonl=1"]}
  cases = [([name, "--help"], "0", "") for name in cli.COMMANDS] + [(argv, "2", m) for m, argv in refused.items()]
  for argv, status, message in cases:
    r = subprocess.run([sys.executable, "-c", _LOADED_AFTER, *argv], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert r.stdout.splitlines()[-1] == f"{status} []", (argv, r.stdout[-500:], r.stderr[-2000:])
    assert message in r.stderr, (argv, r.stderr[-2000:])


def test_chat_and_export_share_one_set_of_model_flags():
  from jaxsft import chat, export

  def model_flags(parser):
    (group,) = [g for g in parser._action_groups if g.title.startswith("the model")]
    return [(a.dest, a.option_strings, a.choices, a.default, a.help) for a in group._group_actions]

  flags = model_flags(export.build_parser())
  assert [dest for dest, *_ in flags] == ["run_dir", "model", "adapter", "quantize", "quant_block_size",
                                          "quantize_embeddings", "chat_template"]
  assert model_flags(chat.build_parser())[:len(flags)] == flags  # chat adds its compute --dtype after them


def test_a_command_module_ends_its_process_through_its_own_exit_only_where_it_has_one():
  import importlib

  ends = {name: hasattr(importlib.import_module(module), "exit_after_run") for name, (module, _) in cli.COMMANDS.items()}
  assert ends == {name: name == "train" for name in cli.COMMANDS}


def test_python_dash_m_runs_the_same_command_as_jaxsft():
  for module in ("jaxsft.train", "jaxsft.doctor", "jaxsft.chat"):
    r = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert r.returncode == 0, (module, r.stderr[-2000:])
    assert r.stdout.startswith(f"usage: jaxsft {module.split('.')[1]} "), (module, r.stdout[:200])


def test_an_unknown_command_is_one_error_line_and_exit_2(run_cli):
  r = run_cli(cli.main, ["tarin", "--data", "x.jsonl"])
  assert r.returncode == 2 and r.stdout == ""
  errors = [line for line in r.stderr.splitlines() if "error:" in line]
  assert len(errors) == 1 and "'tarin'" in errors[0] and "train" in errors[0], r.stderr


def test_every_command_names_a_module_of_the_package():
  root = pathlib.Path(jaxsft.__file__).parent
  for module, _ in cli.COMMANDS.values():
    path = root.joinpath(*module.split(".")[1:])
    assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), module


# A command run through `errors.run_cli`, its stdout a pipe whose reader is or is not gone.
_COMMAND = ("import sys; from jaxsft import errors\n"
            "def body():\n  {}\n"
            "sys.exit(errors.run_cli(body))")


def _run_with_stdout_closed(body: str, *, stdout_closed: bool) -> subprocess.CompletedProcess:
  read_end, write_end = os.pipe()
  if stdout_closed:
    os.close(read_end)  # the reader is gone before the command writes
  try:
    return subprocess.run([sys.executable, "-c", _COMMAND.format(body)], cwd=ROOT, stdout=write_end,
                          stderr=subprocess.PIPE, text=True, timeout=60)
  finally:
    os.close(write_end)
    if not stdout_closed:
      os.close(read_end)


def test_stdouts_reader_gone_ends_a_command_quietly():
  """`python -m jaxsft.doctor RUN | head -2`: no traceback, the shell's status for SIGPIPE."""
  r = _run_with_stdout_closed("print('loss curve: healthy\\n' * 10000)", stdout_closed=True)
  assert r.returncode == 141 and r.stderr == "", r.stderr


def test_a_broken_pipe_that_is_not_stdouts_keeps_its_traceback():
  r = _run_with_stdout_closed("raise BrokenPipeError(32, 'a worker went away')", stdout_closed=False)
  assert r.returncode == 1 and "Traceback" in r.stderr and "a worker went away" in r.stderr, r.stderr
