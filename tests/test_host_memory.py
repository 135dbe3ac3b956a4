"""`jaxsft.host_memory`: a step's scratch memory is reused, not page-faulted in again each call."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from jaxsft import host_memory

# Runs a jitted function whose 64 MiB intermediate lives in XLA's per-execution scratch buffer
# (the optimization barrier keeps XLA from fusing it away) and counts each call's page faults
# after a first call. (A reused heap still faults now and then, when small allocations land in
# the freed block and the next scratch buffer grows the heap: the median call is what is checked.)
_PROBE = """
import json, resource, sys
from jaxsft import host_memory
applied = host_memory.keep_freed_memory()
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.sum(jax.lax.optimization_barrier(x * 2.0)[::-1] + x))
x = jnp.ones(16 * 2**20, jnp.float32)
f(x).block_until_ready()
faults = []
for _ in range(24):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  total = float(f(x))
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "setting": host_memory.setting(), "faults": faults, "total": total}))
"""

needs_glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                 reason="glibc's mallopt")


def _probe(env_value: str | None) -> dict:
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env.pop(host_memory.ENV_VAR, None)
  if env_value is not None:
    env[host_memory.ENV_VAR] = env_value
  out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


@needs_glibc
def test_scratch_memory_is_reused_across_calls():
  pages = 64 * 2**20 // os.sysconf("SC_PAGE_SIZE")  # of one call's intermediate
  kept = _probe(None)
  assert kept["applied"] == "glibc malloc arena_max=1,mmap_max=0,trim_threshold=max"
  assert kept["setting"] == kept["applied"]
  median = lambda xs: sorted(xs)[len(xs) // 2]
  assert median(kept["faults"]) < pages // 4, kept
  system = _probe("system")
  assert system["applied"] is None and system["setting"] == "system default"
  assert median(system["faults"]) > pages // 2, system  # each call faults its scratch buffer in again
  assert kept["total"] == system["total"] == 3.0 * 16 * 2**20


def test_off_glibc_nothing_is_set(monkeypatch):
  monkeypatch.setattr(host_memory, "_applied", None)
  monkeypatch.setattr(host_memory, "_glibc", lambda: None)
  assert host_memory.keep_freed_memory() is None
  assert host_memory.setting() == "system default"
