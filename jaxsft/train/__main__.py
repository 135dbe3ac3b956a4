"""`python -m jaxsft.train`: the training command line (`jaxsft.train.recipe.main`)."""

from __future__ import annotations

import os
import sys

from jaxsft.train import main

code = main()
if code:
  # A failed run has reported why and closed what it writes; what may be left are the failed
  # writer threads of orbax and tensorstore (a full disk), and tearing the interpreter down
  # beneath them can abort after the error line ("terminate called without an active exception").
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)
sys.exit(code)
