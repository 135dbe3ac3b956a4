"""`python -m jaxsft.train`: the training command line (`jaxsft.train.recipe.main`)."""

from __future__ import annotations

import sys

from jaxsft.train import main

sys.exit(main())
