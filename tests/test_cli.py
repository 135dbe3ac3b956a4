"""The `jaxsft` command line (`jaxsft.cli`): each command forwarded to its module's `main`."""

import pathlib

import jaxsft
from jaxsft import cli


def test_jaxsft_help_lists_every_command(run_cli):
  r = run_cli(cli.main, ["--help"])
  assert r.returncode == 0, r.stderr
  for name in ("train", "chat", "export", "data", "doctor", "evaluate"):
    assert f"\n  {name} " in r.stdout, (name, r.stdout)


def test_a_command_forwards_its_arguments_to_the_module_main(run_cli):
  r = run_cli(cli.main, ["doctor", "--help"])
  assert r.returncode == 0, r.stderr
  assert r.stdout.startswith("usage: python -m jaxsft.doctor") and "--json" in r.stdout


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
