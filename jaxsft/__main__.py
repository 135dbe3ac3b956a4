"""`python -m jaxsft COMMAND ...`: the `jaxsft` command line (`jaxsft.cli`) without the installed script."""

from jaxsft.cli import console

console()
