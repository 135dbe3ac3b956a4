"""`python -m jaxsft.train`: the training command line, as `jaxsft train` (`jaxsft.train.command.main`)."""

from jaxsft.cli import console

console("train")
