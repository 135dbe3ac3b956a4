"""`jaxsft COMMAND ...`: one command line for the CLIs, each `python -m jaxsft.COMMAND` too.

    jaxsft train runs/mine --data my.jsonl   # = python -m jaxsft.train runs/mine --data my.jsonl
    jaxsft chat runs/mine                    # = python -m jaxsft.chat runs/mine
    jaxsft COMMAND --help                    # the command's own options

Each command is forwarded, with the arguments after it, to its module's `main(argv)`; a module
is imported only when its command runs, so `jaxsft --help` starts at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from types import ModuleType
from typing import TYPE_CHECKING, NoReturn, Sequence

if TYPE_CHECKING:
  from jaxsft.run_files import RunSource

# command -> (its module, one line for `jaxsft --help`). Every command module is alike: its parser's
# `prog` is `jaxsft COMMAND`; the run folder it writes or reads is its positional RUN_DIR
# (`add_run_dir`; train's stands among its key=value overrides, data's is `--cost-from RUN_DIR`, its
# subject being a data file); and it exposes `main(argv) -> int`, the exit status. A module whose
# process must end otherwise than by `sys.exit` after `main` returns also exposes
# `exit_after_run(code)` (train: see `jaxsft.train.command`).
COMMANDS = {
    "train": ("jaxsft.train.command", "fine-tune a model (LoRA, QLoRA or full): writes a run directory"),
    "chat": ("jaxsft.chat", "talk to a run's tuned model, or answer a file of prompts"),
    "export": ("jaxsft.export", "the tuned model as one standalone model (HF folder or GGUF)"),
    "data": ("jaxsft.data.__main__", "data statistics and collation costs; build the token store"),
    "doctor": ("jaxsft.doctor", "diagnose a run's loss curve"),
    "evaluate": ("jaxsft.evaluate", "tuned vs base on a run's held-out prompts"),
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
  """Every command's `--help`: descriptions as written, and each option's default after its help
  (left out where there is none to show: None, a flag that is off, or a help that states it)."""

  def _get_help_string(self, action):
    text = action.help or ""
    if (not action.option_strings or "%(default)" in text or "default" in text
        or any(action.default is nothing for nothing in (None, False, argparse.SUPPRESS))):  # `is`: 0 == False
      return text
    return f"{text} (default: %(default)s)".lstrip()


def parser() -> argparse.ArgumentParser:
  commands = "\n".join(f"  {name:<10}{summary}" for name, (_, summary) in COMMANDS.items())
  out = argparse.ArgumentParser(prog="jaxsft", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=f"commands:\n{commands}\n\n{__doc__.split(chr(10) * 2)[1]}")
  out.add_argument("command", metavar="COMMAND", choices=list(COMMANDS), help=f"one of: {', '.join(COMMANDS)}")
  out.add_argument("args", metavar="ARGS", nargs="*", default=[], help="the command's arguments (jaxsft COMMAND --help)")
  return out


def command_module(name: str) -> ModuleType:
  return importlib.import_module(COMMANDS[name][0])


def main(argv: Sequence[str] | None = None) -> int:
  """Runs `jaxsft COMMAND ARGS...`; returns the command's exit status. `--help`, no command or
  an unknown one: argparse's help, or its usage and one error line with exit 2."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv and argv[0] in COMMANDS:
    return command_module(argv[0]).main(argv[1:])
  parser().parse_args(argv[:1])  # exits: the help (0), or the usage and the error (2)
  raise AssertionError("unreachable: argparse exits on a missing or unknown command")


def console(command: str | None = None) -> NoReturn:
  """The `jaxsft` console script (pyproject.toml's [project.scripts]); with `command`, that
  command's own (`python -m jaxsft.train`): runs it and ends the process as the command ends it."""
  from jaxsft import host_memory

  host_memory.reexec_with_huge_pages()  # a step's scratch memory in 2 MiB pages, from the start
  argv = sys.argv[1:] if command is None else [command, *sys.argv[1:]]
  code = main(argv)
  module = command_module(argv[0])  # main returned: argv[0] is a command
  getattr(module, "exit_after_run", sys.exit)(code)
  raise AssertionError("unreachable: the command's exit returned")


# ---------------------------------------------------------------------------------------------
# What the commands share: the run folder argument, and the flags that name the model to load.


def add_run_dir(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *, optional: bool = False,
                help: str = "a run folder written by jaxsft train") -> None:
  """The positional RUN_DIR every command that reads or writes a run takes."""
  parser.add_argument("run_dir", metavar="RUN_DIR", nargs="?" if optional else None, help=help)


def add_model_source(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
  """RUN_DIR (optional), or --model with --adapter, and the quantization of the base: the flags
  of every command that loads a tuned model (chat, export). Returns their group."""
  from jaxsft.config_checks import QUANTIZE_CHOICES

  group = parser.add_argument_group("the model (a run directory, or a model and an adapter)")
  add_run_dir(group, optional=True, help="a run folder written by jaxsft train (its model and adapter, or its full "
              "fine-tuned model)")
  group.add_argument("--model", help="a model jaxsft loads (short name, HF folder, hub id, .gguf); instead of RUN_DIR")
  group.add_argument("--adapter", help="a PEFT LoRA adapter folder to apply to --model")
  group.add_argument("--quantize", choices=QUANTIZE_CHOICES, default=None,
                     help="the base's projection kernels block-quantized, as a QLoRA run with this model.quantize "
                          "trained on them (default: RUN_DIR's, else none)")
  group.add_argument("--quant-block-size", type=int, default=None,
                     help="with --quantize int8/nf4/int4: inputs per quantization block, the run's "
                          "model.quant_block_size (default: RUN_DIR's, else 32)")
  group.add_argument("--quantize-embeddings", action="store_true", default=None,
                     help="with --quantize: the embeddings and LM head quantized too, as model.quantize_embeddings "
                          "(default: RUN_DIR's, else off)")
  group.add_argument("--chat-template", default=None, metavar="PATH",
                     help="a Jinja chat template file, or a tokenizer folder whose template to use, as "
                          "model.chat_template (default: RUN_DIR's, else the tokenizer's own)")
  return group


def check_model_source(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """argparse's error (exit 2) unless the flags name one model: RUN_DIR or --model."""
  if (args.run_dir is None) == (args.model is None):
    parser.error("give RUN_DIR or --model (one of them)")
  if args.adapter and args.run_dir:
    parser.error("--adapter goes with --model; a RUN_DIR brings its own adapter")


def model_source(args: argparse.Namespace) -> RunSource:
  """What `add_model_source`'s flags name: RUN_DIR's model (`run_files.resolve_run`), or --model
  with --adapter in float32; a quantization flag given replaces the run's setting."""
  from jaxsft.run_files import RunSource, resolve_run

  source = resolve_run(args.run_dir) if args.run_dir else RunSource(args.model, args.adapter, "float32")
  return dataclasses.replace(source, quantize=args.quantize or source.quantize,
                             quant_block_size=args.quant_block_size or source.quant_block_size,
                             quantize_embeddings=bool(args.quantize_embeddings or source.quantize_embeddings),
                             chat_template=args.chat_template or source.chat_template)


if __name__ == "__main__":
  console()
