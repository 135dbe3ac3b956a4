"""Startup noise the user of a jaxsft command cannot act on, switched off before it prints.

- transformers logs "PyTorch was not found. Models won't be available ..." when it is imported
  without torch. jaxsft never uses transformers' models (only its tokenizers), so the line is
  noise; transformers skips its advisory warnings when TRANSFORMERS_NO_ADVISORY_WARNINGS is set.
- transformers' own log level drops to errors (its warnings are about its models and hub
  downloads, which jaxsft does not use), unless TRANSFORMERS_VERBOSITY says otherwise.

Only the command-line entry points call this; importing jaxsft as a library changes nothing.
"""

from __future__ import annotations

import os


def silence_library_noise() -> None:
  """Set before transformers is first imported (the check runs at its import)."""
  os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
  os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
