"""The train command line: `--help` documents every key of the config tree (dotted, with its
alias, type, default and meaning, read from `jaxsft.config`'s dataclasses), and `parse_args`
reads the defaults ← --config YAML ← --flags ← key=value into a validated `TrainConfig`."""

from __future__ import annotations

import argparse
import sys

from jaxsft.config import (ALIASES, CHOICES, DEFAULT_CONFIG, ConfigError, TrainConfig, apply_overrides, fields, load_yaml,
                           type_name, validate)


def build_parser() -> argparse.ArgumentParser:
  """`--help` documents every key (dotted, with its alias, type, default and meaning)."""
  parser = argparse.ArgumentParser(
      prog="python -m jaxsft.train",
      description="LoRA supervised fine-tuning in JAX. With no arguments it runs the embedded default "
      f"({DEFAULT_CONFIG.name}: SmolLM2-135M-Instruct on jaxsft's built-in synthetic task set); --config FILE "
      "replaces that base. Defaults shown below are the dataclass defaults. "
      "Overrides: --key value, --key=value or key=value.",
      formatter_class=argparse.RawDescriptionHelpFormatter,
      allow_abbrev=False,
      epilog="Example: python -m jaxsft.train --config configs/alpaca.yaml --lr 1e-4 max_steps=100",
  )
  parser.add_argument("--config", help="YAML file mirroring the config tree (configs/*.yaml)")
  defaults = TrainConfig()
  reverse_alias = {v: k for k, v in ALIASES.items()}
  # One help section per part of the config tree, in the tree's order: `--help` reads as the YAML does.
  groups = {"": parser.add_argument_group("the run")}
  for key in fields():
    section = key.rsplit(".", 1)[0] if "." in key else ""
    if section not in groups:
      groups[section] = parser.add_argument_group(f"{section}.* ({section} section of the YAML)")
  for key, (tp, doc) in fields().items():
    group = groups[key.rsplit(".", 1)[0] if "." in key else ""]
    obj = defaults
    for part in key.split("."):
      obj = getattr(obj, part)
    names = [f"--{key}"] + ([f"--{reverse_alias[key]}"] if key in reverse_alias else [])
    choices = f" {{{'|'.join(CHOICES[key])}}}" if key in CHOICES else ""
    help_text = f"{doc} [{type_name(tp)}{choices}; default {obj!r}]".strip()
    if tp is bool:
      group.add_argument(*names, dest=key, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
    else:
      group.add_argument(*names, dest=key, default=argparse.SUPPRESS, metavar=key.rsplit(".", 1)[-1].upper(), help=help_text)
  parser.add_argument("overrides", nargs="*", help="key=value overrides (dotted keys or aliases)")
  return parser


def parse_args(argv: list[str] | None = None) -> TrainConfig:
  """Defaults ← --config YAML ← --flags ← key=value; every step checked, then the whole config."""
  parser = build_parser()
  ns, unknown = parser.parse_known_intermixed_args(sys.argv[1:] if argv is None else argv)
  if unknown:
    valid = sorted(fields()) + sorted(ALIASES)
    raise ConfigError(f"unknown option(s) {' '.join(unknown)}. Valid keys: {', '.join(valid)}")
  args = vars(ns)
  config = load_yaml(args.pop("config", None) or DEFAULT_CONFIG)
  positional = args.pop("overrides", [])
  config = apply_overrides(config, args)
  pairs = {}
  for item in positional:
    if "=" not in item:
      raise ConfigError(f"override {item!r} is not key=value")
    k, v = item.split("=", 1)
    pairs[k.strip()] = v
  config = apply_overrides(config, pairs)
  validate(config)
  return config
