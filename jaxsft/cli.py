"""`jaxsft COMMAND ...`: one command line for the CLIs, each `python -m jaxsft.COMMAND` too.

    jaxsft train --data my.jsonl             # = python -m jaxsft.train --data my.jsonl
    jaxsft chat runs/default                 # = python -m jaxsft.chat runs/default
    jaxsft COMMAND --help                    # the command's own options

Each command is forwarded, with the arguments after it, to its module's `main(argv)`; a module
is imported only when its command runs, so `jaxsft --help` starts at once.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable, NoReturn, Sequence

# command -> (module with `main(argv)`, one line for `jaxsft --help`)
COMMANDS = {
    "train": ("jaxsft.train", "fine-tune a model (LoRA, QLoRA or full): writes a run directory"),
    "chat": ("jaxsft.chat", "talk to a run's tuned model, or answer a file of prompts"),
    "export": ("jaxsft.export", "the tuned model as one standalone model (HF folder or GGUF)"),
    "data": ("jaxsft.data.__main__", "data statistics and collation costs; build the token store"),
    "doctor": ("jaxsft.doctor", "diagnose a run's loss curve"),
    "evaluate": ("jaxsft.evaluate", "tuned vs base on a run's held-out prompts"),
}


def parser() -> argparse.ArgumentParser:
  commands = "\n".join(f"  {name:<10}{summary}" for name, (_, summary) in COMMANDS.items())
  out = argparse.ArgumentParser(prog="jaxsft", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=f"commands:\n{commands}\n\n{__doc__.split(chr(10) * 2)[1]}")
  out.add_argument("command", metavar="COMMAND", choices=list(COMMANDS), help=f"one of: {', '.join(COMMANDS)}")
  out.add_argument("args", metavar="ARGS", nargs="*", default=[], help="the command's arguments (jaxsft COMMAND --help)")
  return out


def command_main(name: str) -> Callable[[list[str]], int]:
  return importlib.import_module(COMMANDS[name][0]).main


def main(argv: Sequence[str] | None = None) -> int:
  """Runs `jaxsft COMMAND ARGS...`; returns the command's exit status. `--help`, no command or
  an unknown one: argparse's help, or its usage and one error line with exit 2."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv and argv[0] in COMMANDS:
    return command_main(argv[0])(argv[1:])
  parser().parse_args(argv[:1])  # exits: the help (0), or the usage and the error (2)
  raise AssertionError("unreachable: argparse exits on a missing or unknown command")


def console() -> NoReturn:
  """The `jaxsft` console script (pyproject.toml's [project.scripts])."""
  argv = sys.argv[1:]
  code = main(argv)
  if argv[:1] == ["train"]:
    from jaxsft.train.recipe import exit_after_run

    exit_after_run(code)
  sys.exit(code)


if __name__ == "__main__":
  console()
