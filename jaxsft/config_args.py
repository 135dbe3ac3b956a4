"""The train command line: `--help` documents every key of the config tree (dotted, with its
alias, type, default and meaning, read from `jaxsft.config`'s dataclasses), and `parse_args`
reads the defaults ← --config YAML ← --flags ← RUN_DIR and key=value into a validated
`TrainConfig`."""

from __future__ import annotations

import argparse
import sys

from jaxsft.config import (ALIASES, CHOICES, DEFAULT_CONFIG, ConfigError, TrainConfig, apply_overrides, fields, load_yaml,
                           type_name, validate)

# Keys whose flag takes several values; argparse gives such a flag every word up to the next option.
MANY_VALUES = ("data.mix",)


def build_parser() -> argparse.ArgumentParser:
  """`--help` documents every key (dotted, with its alias, type, default and meaning)."""
  parser = argparse.ArgumentParser(
      prog="jaxsft train",
      description="LoRA supervised fine-tuning in JAX. With no arguments it runs the embedded default "
      f"({DEFAULT_CONFIG.name}: SmolLM2-135M-Instruct on jaxsft's built-in synthetic task set); --config FILE "
      "replaces that base. Each key shows its dataclass default, and where that base sets it otherwise, "
      "the value a run without --config starts from. "
      "Overrides: --key value, --key=value or key=value. The run folder: RUN_DIR, as every jaxsft command "
      "takes it, or --output-dir.",
      formatter_class=argparse.RawDescriptionHelpFormatter,
      allow_abbrev=False,
      epilog="Example: jaxsft train runs/alpaca --config configs/alpaca.yaml --lr 1e-4 max_steps=100",
  )
  parser.add_argument("--config", help="YAML file mirroring the config tree (configs/*.yaml)")
  defaults, embedded = TrainConfig(), load_yaml(DEFAULT_CONFIG)
  reverse_alias = {v: k for k, v in ALIASES.items()}
  # One help section per part of the config tree, in the tree's order: `--help` reads as the YAML does.
  groups = {"": parser.add_argument_group("the run")}
  for key in fields():
    section = key.rsplit(".", 1)[0] if "." in key else ""
    if section not in groups:
      groups[section] = parser.add_argument_group(f"{section}.* ({section} section of the YAML)")
  for key, (tp, doc) in fields().items():
    group = groups[key.rsplit(".", 1)[0] if "." in key else ""]
    obj, base = defaults, embedded
    for part in key.split("."):
      obj, base = getattr(obj, part), getattr(base, part)
    default = f"default {obj!r}" + (f"; without --config {base!r} ({DEFAULT_CONFIG.name})" if base != obj else "")
    names = [f"--{key}"] + ([f"--{reverse_alias[key]}"] if key in reverse_alias else [])
    choices = f" {{{'|'.join(CHOICES[key])}}}" if key in CHOICES else ""
    help_text = f"{doc} [{type_name(tp)}{choices}; {default}]".strip()
    if tp is bool:
      group.add_argument(*names, dest=key, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
    elif key in MANY_VALUES:  # --data.mix a.json=0.7 b.jsonl=0.3
      group.add_argument(*names, dest=key, nargs="+", default=argparse.SUPPRESS, metavar="PATH=WEIGHT", help=help_text)
    else:
      group.add_argument(*names, dest=key, default=argparse.SUPPRESS, metavar=key.rsplit(".", 1)[-1].upper(), help=help_text)
  parser.add_argument("overrides", nargs="*", metavar="RUN_DIR|key=value",
                      help="the run folder (output_dir; a name without '='), then key=value overrides (dotted keys "
                           "or aliases)")
  return parser


def _split_trailing_overrides(values: list[str]) -> tuple[list[str], list[str]]:
  """(the flag's own values, the key=value overrides argparse also gave it): `--data.mix a.json=0.7
  max_steps=5` ends the sources at the first word whose left side is a config key or alias."""
  keys = set(fields()) | set(ALIASES)
  for i, value in enumerate(values):
    left = value.split("=", 1)[0].strip()
    if "=" in value and (left in keys or left.replace("-", "_") in keys):
      return values[:i], values[i:]
  return values, []


def parse_args(argv: list[str] | None = None) -> TrainConfig:
  """Defaults ← --config YAML ← --flags ← key=value; every step checked, then the whole config."""
  parser = build_parser()
  argv = sys.argv[1:] if argv is None else argv
  _refuse_switch_values(parser, argv)
  ns, unknown = parser.parse_known_intermixed_args(argv)
  if unknown:
    valid = sorted(fields()) + sorted(ALIASES)
    raise ConfigError(f"unknown option(s) {' '.join(unknown)}. Valid keys: {', '.join(valid)}")
  args = vars(ns)
  config_file = args.pop("config", None)
  config = load_yaml(config_file or DEFAULT_CONFIG)
  positional = args.pop("overrides", [])
  for key in MANY_VALUES:
    if key in args:
      args[key], trailing = _split_trailing_overrides(args[key])
      positional = trailing + positional
  run_dir = _run_dir(positional, args.get("output_dir"))
  if run_dir is not None:
    args["output_dir"] = run_dir
  config = apply_overrides(config, args)
  pairs = {}
  for item in positional:
    if item != run_dir:
      k, v = item.split("=", 1)
      pairs[k.strip()] = v
  config = apply_overrides(config, pairs)
  if config_file is None:
    given = {ALIASES.get(k, k).replace("-", "_") for k in [*args, *pairs]}
    config = _embedded_defaults_yield(config, given)
  validate(config)
  return config


BOOLEAN_WORDS = ("true", "false", "yes", "no", "on", "off", "1", "0")


def _refuse_switch_values(parser: argparse.ArgumentParser, argv: list[str]) -> None:
  """`--progress false` would leave 'false' as RUN_DIR, a run folder of that name, with the switch
  on: a boolean key's flag takes no value, so a yes/no word right after one is refused by name."""
  switches = {option: action for action in parser._actions if isinstance(action, argparse.BooleanOptionalAction)
              for option in action.option_strings}
  for flag, word in zip(argv, argv[1:]):
    if flag in switches and word.lower() in BOOLEAN_WORDS:
      on = "--" + flag.removeprefix("--").removeprefix("no-")
      raise ConfigError(f"{flag} is a switch and takes no value ({word!r}): write {on} or "
                        f"--no-{on[2:]}, or {switches[flag].dest}={word}")


def _embedded_defaults_yield(config: TrainConfig, given: set[str]) -> TrainConfig:
  """Settings of the embedded default that a command line's own choice makes wrong, where the
  command line did not set them itself, fall back to the library's:

  - its token budget (`data.tokens_per_batch`) sizes fixed-width batches: with dynamic padding a
    batch is `data.batch_size` rows, not a refusal over a key the user never set;
  - its learning rate (`optim.lr` 2e-3) is a LoRA rate for its short runs: `mode: full` trains
    every weight at the library's `optim.lr` (2e-4).
  """
  if config.data.batching == "dynamic" and "data.tokens_per_batch" not in given:
    config.data.tokens_per_batch = None
  if config.mode == "full" and "optim.lr" not in given:
    config.optim.lr = TrainConfig().optim.lr
  return config


def _run_dir(positional: list[str], flag: str | None) -> str | None:
  """RUN_DIR: the one positional word without '=' (the others are key=value), the run folder
  `--output-dir` names too; None without one."""
  words = [item for item in positional if "=" not in item]
  if len(words) > 1:
    raise ConfigError(f"override {words[1]!r} is not key=value (the run folder is {words[0]!r})")
  if words and flag is not None:
    raise ConfigError(f"the run folder is given twice: RUN_DIR {words[0]!r} and --output-dir {flag!r}; give one")
  return words[0] if words else None
