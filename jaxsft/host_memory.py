"""Host memory that a CPU step faults in 2 MiB at a time, not 4 KiB at a time.

XLA's CPU runtime allocates each execution's scratch buffer (for a train step, everything the
backward pass keeps from the forward one: hundreds of MiB) with `posix_memalign` on one of its
worker threads, and frees it when the step ends. glibc serves an allocation that large from a
fresh `mmap` and returns it with `munmap`, so every step page-faults its whole scratch buffer in
again, one 4 KiB page at a time, on the cores that run the step.

With glibc's `glibc.malloc.hugetlb=1` tunable, malloc marks such mappings for transparent huge
pages (`madvise(MADV_HUGEPAGE)`), so the kernel faults them in 2 MiB at a time: the same memory,
returned to the system as before, for about 1/100 of the faults. The tunable is read once, when
the process starts, so the command line starts itself again with it set (`reexec_with_huge_pages`,
before anything else runs); a program that calls `jaxsft.train.train` itself gets the same by
running under `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`. Where glibc or the kernel cannot
(another C library, glibc before 2.35, transparent huge pages `never`) or with
`JAXSFT_HOST_MALLOC=system`, nothing changes.
"""

from __future__ import annotations

import os
import pathlib
import platform
import sys

ENV_VAR = "JAXSFT_HOST_MALLOC"  # "system": leave the C allocator as the process found it
TUNABLE = "glibc.malloc.hugetlb=1"
_THP = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _glibc_version() -> tuple[int, ...] | None:
  if platform.system() != "Linux":
    return None
  name, version = platform.libc_ver()
  if name != "glibc" or not version:
    return None
  return tuple(int(x) for x in version.split(".")[:2])


def huge_pages_possible() -> bool:
  """glibc 2.35 or newer (the tunable) on a kernel whose transparent huge pages are not `never`."""
  version = _glibc_version()
  if version is None or version < (2, 35):
    return False
  try:
    return "[never]" not in _THP.read_text()
  except OSError:
    return False


def environment_with_huge_pages(environ: dict) -> dict | None:
  """`environ` with the tunable added to `GLIBC_TUNABLES`, or None where it is there already, the
  user opted out (`JAXSFT_HOST_MALLOC=system`) or this machine cannot use it."""
  if environ.get(ENV_VAR, "").strip().lower() == "system" or not huge_pages_possible():
    return None
  tunables = environ.get("GLIBC_TUNABLES", "")
  if "glibc.malloc.hugetlb" in tunables:
    return None
  return {**environ, "GLIBC_TUNABLES": f"{tunables}:{TUNABLE}" if tunables else TUNABLE}


def reexec_with_huge_pages() -> None:
  """Starts this process's command again with the tunable set, where `environment_with_huge_pages`
  says so; returns otherwise (and in the started process, which has it). Only for a command line's
  entry point, before it has done anything: the process image is replaced."""
  env = environment_with_huge_pages(dict(os.environ))
  argv = getattr(sys, "orig_argv", None)
  if env is None or not argv:
    return
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, [sys.executable, *argv[1:]], env)


def setting() -> str:
  """How this process's large host allocations are faulted in, for a run's summary and a
  benchmark's result."""
  if TUNABLE in os.environ.get("GLIBC_TUNABLES", "") and huge_pages_possible():
    return "transparent huge pages (glibc.malloc.hugetlb=1)"
  return "system default"
