"""`jaxsft.host_memory`: a step's scratch memory faulted in 2 MiB at a time, from the command line on."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxsft import host_memory

# Runs a jitted function whose 64 MiB intermediate lives in XLA's per-execution scratch buffer
# (the optimization barrier keeps XLA from fusing it away) and counts each call's page faults
# after a first call.
_PROBE = """
import json, resource
from jaxsft import host_memory
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.sum(jax.lax.optimization_barrier(x * 2.0)[::-1] + x))
x = jnp.ones(16 * 2**20, jnp.float32)
f(x).block_until_ready()
faults = []
for _ in range(12):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  total = float(f(x))
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"setting": host_memory.setting(), "faults": faults, "total": total}))
"""

needs_huge_pages = pytest.mark.skipif(not host_memory.huge_pages_possible(),
                                      reason="glibc >= 2.35 and transparent huge pages")


def _probe(env: dict) -> dict:
  out = subprocess.run([sys.executable, "-c", _PROBE], env={**env, "JAX_PLATFORMS": "cpu"}, capture_output=True,
                       text=True, timeout=120, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def _clean_environ() -> dict:
  env = dict(os.environ)
  env.pop("GLIBC_TUNABLES", None)
  env.pop(host_memory.ENV_VAR, None)
  return env


@needs_huge_pages
def test_scratch_memory_faults_in_huge_pages():
  pages = 64 * 2**20 // os.sysconf("SC_PAGE_SIZE")  # of one call's intermediate
  median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
  plain = _probe(_clean_environ())
  assert plain["setting"] == "system default"
  assert median(plain["faults"]) > pages // 2, plain  # each call faults its scratch buffer in again
  huge = _probe(host_memory.environment_with_huge_pages(_clean_environ()))
  assert huge["setting"] == "transparent huge pages (glibc.malloc.hugetlb=1)"
  assert median(huge["faults"]) < pages // 8, huge
  assert huge["total"] == plain["total"] == 3.0 * 16 * 2**20


def test_environment_adds_the_tunable_once(monkeypatch):
  monkeypatch.setattr(host_memory, "huge_pages_possible", lambda: True)
  assert host_memory.environment_with_huge_pages({})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
  other = host_memory.environment_with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "X": "1"})
  assert other == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1", "X": "1"}
  assert host_memory.environment_with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) is None  # the user's
  assert host_memory.environment_with_huge_pages({host_memory.ENV_VAR: "system"}) is None
  monkeypatch.setattr(host_memory, "huge_pages_possible", lambda: False)
  assert host_memory.environment_with_huge_pages({}) is None


@needs_huge_pages
def test_the_command_line_starts_itself_with_the_tunable():
  """`python -m jaxsft.train` (through `cli.console`) runs with the tunable, once: the started
  process finds it set and goes on; with JAXSFT_HOST_MALLOC=system it never restarts."""
  probe = ("import os, sys; from jaxsft import cli, host_memory; "
           "cli.main = lambda argv: print('TUNABLES', os.environ.get('GLIBC_TUNABLES'), host_memory.setting()) or 0; "
           "cli.console('doctor')")
  for env, expected in ((_clean_environ(), "TUNABLES glibc.malloc.hugetlb=1 transparent huge pages"),
                        ({**_clean_environ(), host_memory.ENV_VAR: "system"}, "TUNABLES None system default")):
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert [line for line in out.stdout.splitlines() if line.startswith("TUNABLES")] == [
        expected + (" (glibc.malloc.hugetlb=1)" if "huge" in expected else "")], out.stdout
