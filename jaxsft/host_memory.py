"""Host memory that a CPU step allocates once, not once a step.

XLA's CPU runtime allocates each execution's scratch buffer (for a train step, everything the
backward pass keeps from the forward one: hundreds of MiB) with `posix_memalign` on one of its
worker threads, and frees it when the step ends. glibc serves an allocation that large from a
fresh `mmap` (a thread's arena can never hold it, whatever `M_MMAP_THRESHOLD` says) and returns it
with `munmap`, so every step page-faults its whole scratch buffer in again, and the kernel zeroes
every page of it, on the same cores that run the step.

`keep_freed_memory` makes glibc serve every allocation from the one main heap and keep what is
freed (the `mallopt` equivalents of `GLIBC_TUNABLES=glibc.malloc.arena_max=1:
glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=<max>`): the second step reuses the first
step's pages. The process's resident memory then stays at its peak instead of falling between
steps; a training process is at its peak every step anyway.

It acts on later allocations only, and a thread keeps the arena it already has, so it must run
before JAX starts its CPU client (the first computation or `jax.devices()`): `python -m
jaxsft.train` calls it first thing. Elsewhere (no glibc, or `JAXSFT_HOST_MALLOC=system`) it
changes nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

ENV_VAR = "JAXSFT_HOST_MALLOC"  # "system" leaves the C allocator as the process found it

# mallopt's parameter numbers, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

_applied: str | None = None


def _glibc():
  """glibc's shared library, or None where the C library is another (musl, macOS, Windows)."""
  if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
    return None
  try:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
  except OSError:
    return None


def keep_freed_memory() -> str | None:
  """Makes glibc keep freed memory for reuse (see the module docstring); returns what it set.

  None where nothing was set: not glibc, or `JAXSFT_HOST_MALLOC=system`. Calling it again
  returns the first call's answer.
  """
  global _applied
  if _applied is not None:
    return _applied
  if os.environ.get(ENV_VAR, "").strip().lower() == "system":
    return None
  libc = _glibc()
  if libc is None:
    return None
  libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
  # -1 is the largest size_t once glibc widens it: never give the heap's top back to the system.
  settings = ((_M_ARENA_MAX, 1, "arena_max=1"), (_M_MMAP_MAX, 0, "mmap_max=0"),
              (_M_TRIM_THRESHOLD, -1, "trim_threshold=max"))
  done = [name for param, value, name in settings if libc.mallopt(param, value) == 1]
  _applied = "glibc malloc " + ",".join(done) if done else None
  return _applied


def setting() -> str:
  """How this process allocates host memory, for a run's summary and a benchmark's result."""
  return _applied or "system default"
