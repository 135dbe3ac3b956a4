"""The session's persistent XLA compilation cache, for this process and its subprocesses: runs with
the same model and shapes (resume tests, repeated CLI runs) compile once. Results are unchanged.

A cache hit emits no compile event, so a test that counts compiles opts out: the `no_compile_cache`
fixture (conftest.py) in this process, `NO_COMPILE_CACHE_ENV` in a subprocess's environment."""

import os
import tempfile

NO_COMPILE_CACHE_ENV = {"JAX_ENABLE_COMPILATION_CACHE": "false"}


def configure() -> None:
  """Before JAX is imported: a fresh cache folder for the session (unless one is given), and
  every executable cached, not only those that took a second to compile (whether a tiny model's
  step is shared between runs must not depend on how fast the machine compiles it)."""
  if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxsft-xla-cache-")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
