"""`python -m jaxsft.train`: the training command line (`jaxsft.train.recipe.main`)."""

from __future__ import annotations

from jaxsft.train import main
from jaxsft.train.recipe import exit_after_run

exit_after_run(main())
