"""One compute thread per test process when the test processes fill the machine's cores.

`pytest -n 2` on a 2-core machine runs two test processes side by side. Left alone, each sizes its
compute threads to every core (XLA's CPU client for its matmuls, torch for its intra-op pool), so
four threads share two cores and preempt each other inside every matmul. With one compute thread
per process the two processes keep a core each. The compiled programs are the same; only the
matmul library runs on one thread (`--xla_cpu_multi_thread_eigen=false`, `torch.set_num_threads`).
A single test process (no `-n`, or fewer processes than cores) keeps every thread.

Subprocesses of a test (CLI runs, multi-device workers) inherit the setting through the environment.
"""

import os

ONE_THREAD_XLA_FLAG = "--xla_cpu_multi_thread_eigen=false"


def cores() -> int:
  """The cores this process may run on (all of them where the OS has no affinity call)."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def processes_fill_the_cores() -> bool:
  """This is one of several pytest-xdist workers, at least as many as the cores it may run on."""
  workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
  return workers > 1 and workers >= cores()


def configure() -> None:
  """Before JAX or torch is imported."""
  if processes_fill_the_cores():
    flags = os.environ.get("XLA_FLAGS", "")
    if ONE_THREAD_XLA_FLAG not in flags:
      os.environ["XLA_FLAGS"] = f"{flags} {ONE_THREAD_XLA_FLAG}".strip()
    os.environ["OMP_NUM_THREADS"] = "1"  # torch's intra-op threads (and numpy's BLAS), here and in subprocesses


def torch_threads() -> int:
  """What a test that sets torch's thread count should set."""
  return 1 if processes_fill_the_cores() else cores()


def xla_flags(*flags: str) -> str:
  """`XLA_FLAGS` for a subprocess that needs `flags` (a device count) on top of this process's."""
  return " ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip()
