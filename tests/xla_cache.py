"""The session's persistent XLA compilation cache, for this process and its subprocesses: runs with
the same model and shapes (resume tests, repeated CLI runs) compile once. Results are unchanged.

A cache hit emits no compile event, so a test that counts compiles opts out: the `no_compile_cache`
fixture (conftest.py) in this process, `NO_COMPILE_CACHE_ENV` in a subprocess's environment."""

import atexit
import os
import shutil
import tempfile

NO_COMPILE_CACHE_ENV = {"JAX_ENABLE_COMPILATION_CACHE": "false"}


def session_folder(env_var: str, prefix: str) -> None:
  """`env_var` names a fresh temporary folder, unless it is already set (by the user, or by the
  pytest process that started this worker). Subprocesses inherit it; the process that made it
  removes it when it exits."""
  if env_var not in os.environ:
    os.environ[env_var] = folder = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)


def configure() -> None:
  """Before JAX is imported: a fresh cache folder for the session (unless one is given), and
  every executable cached, not only those that took a second to compile (whether a tiny model's
  step is shared between runs must not depend on how fast the machine compiles it)."""
  session_folder("JAX_COMPILATION_CACHE_DIR", "jaxsft-xla-cache-")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
