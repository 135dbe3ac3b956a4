"""The `--help` layout every command's parser shares. A leaf: the commands import it, and the
`jaxsft` dispatcher (`jaxsft.cli`) stays above the commands it runs."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
  """Every command's `--help`: descriptions as written, and each option's default after its help
  (left out where there is none to show: None, a flag that is off, or a help that states it)."""

  def _get_help_string(self, action):
    text = action.help or ""
    if (not action.option_strings or "%(default)" in text or "default" in text
        or any(action.default is nothing for nothing in (None, False, argparse.SUPPRESS))):  # `is`: 0 == False
      return text
    return f"{text} (default: %(default)s)".lstrip()
