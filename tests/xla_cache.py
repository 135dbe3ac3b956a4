"""XLA compiles in the test session: a persistent compilation cache for this process and its
subprocesses, so runs with the same model and shapes (resume tests, repeated CLI runs) compile once;
LLVM's O1 for XLA's CPU kernels instead of its default O2; and XLA's CPU kernels emitted straight
to LLVM instead of through its MLIR fusion emitters.

A cache hit emits no compile event, so a test that counts compiles opts out: the `no_compile_cache`
fixture (conftest.py) in this process, `NO_COMPILE_CACHE_ENV` in a subprocess's environment.

Most tests compile a tiny model's step and run it a few times, so LLVM's heavier optimization of
the kernels costs them more than it saves. O1 keeps the arithmetic where it was checked: a tiny
model's loss and LoRA gradients come out bit for bit as at O2 (float32 and bfloat16). O0 would
compile faster still but gives different last bits, and slows the real SmolLM2's runs more than
it saves on the tiny ones (README, Tests). A level in the user's XLA_FLAGS is kept.

The MLIR fusion emitters (XLA's default on CPU) spend much of a tiny model's compile; emitting
the kernels straight to LLVM compiles them faster and runs them a little slower, which the tests'
few steps gain from (README, Tests). Their arithmetic moves in the last bits only, far inside the
suite's tolerances: the tests check jaxsft's math, not which of XLA's emitters ran it. The flag is
set only where the installed XLA accepts it (it aborts on a flag it does not know: a fresh
interpreter tries it once per test run), and not where the user's XLA_FLAGS names it."""

import atexit
import os
import shutil
import subprocess
import sys
import tempfile

NO_COMPILE_CACHE_ENV = {"JAX_ENABLE_COMPILATION_CACHE": "false"}
LLVM_LEVEL_FLAG = "--xla_backend_optimization_level=1"
EMITTERS_FLAG = "--xla_cpu_use_fusion_emitters=false"


def xla_accepts(flag: str) -> bool:
  """Whether XLA starts with `flag` in XLA_FLAGS (it aborts on a flag it does not know), asked of
  a fresh interpreter: this one must not import JAX before its flags are set."""
  env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip(), JAX_PLATFORMS="cpu")
  r = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True, timeout=300)
  return r.returncode == 0


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
  step is shared between runs must not depend on how fast the machine compiles it), LLVM's level
  and the emitters, inherited by subprocesses through XLA_FLAGS."""
  session_folder("JAX_COMPILATION_CACHE_DIR", "jaxsft-xla-cache-")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_backend_optimization_level" not in flags:
    flags = f"{flags} {LLVM_LEVEL_FLAG}"
  if "--xla_cpu_use_fusion_emitters" not in flags and xla_accepts(EMITTERS_FLAG):
    flags = f"{flags} {EMITTERS_FLAG}"
  os.environ["XLA_FLAGS"] = flags.strip()
