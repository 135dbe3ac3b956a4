"""Where arrays live: a (data, fsdp) device mesh and the shardings of batches and params.

Batches are split over both axes (every device gets different rows); frozen base weights are
sharded over `fsdp` along their largest divisible dimension (replicated when fsdp == 1); LoRA
params are tiny and replicated, and their optimizer state follows them. The train step's sums
(Σ nll, Σ valid, Σ grad) then run over the global batch: XLA inserts the all-reduces, and the
loss keeps its global normalization with no code of ours on the communication path:

    loss = Σ_devices Σ_rows nll / Σ_devices Σ_rows valid      (never a mean of per-device means)

Several processes (hosts): the launcher sets JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
JAX_PROCESS_ID and every process runs the same command; `maybe_initialize_distributed` calls
`jax.distributed.initialize` with them before any device is touched. The mesh then spans every
process's devices, each process feeds the rows of the global batch that its own devices hold
(`jax.make_array_from_process_local_data`), and process 0 alone writes the run's files.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxsft.errors import ConfigError, JaxsftError

BATCH_AXES = ("data", "fsdp")
DISTRIBUTED_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


class MeshError(JaxsftError, ValueError):
  """An incomplete or inconsistent multi-process launch (checked before any device is touched).
  A mesh or a batch size that doesn't fit the devices is the config's `ConfigError`."""


@dataclasses.dataclass
class MeshContext:
  mesh: jax.sharding.Mesh

  @property
  def batch_sharding(self) -> NamedSharding:
    return NamedSharding(self.mesh, P(BATCH_AXES))

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, P())

  @property
  def batch_multiple_of(self) -> int:
    """Global batch sizes must be multiples of this (the rows are split over data × fsdp)."""
    return int(self.mesh.shape["data"] * self.mesh.shape["fsdp"])

  def replicate(self, tree):
    return jax.device_put(tree, self.replicated)

  def frozen_spec(self, x) -> P:
    """Shard the largest dimension that fsdp divides; replicate what can't be split."""
    n = self.mesh.shape["fsdp"]
    if n == 1 or np.ndim(x) == 0:
      return P()
    dims = sorted(range(np.ndim(x)), key=lambda d: -x.shape[d])
    for d in dims:
      if x.shape[d] % n == 0:
        spec = [None] * np.ndim(x)
        spec[d] = "fsdp"
        return P(*spec)
    return P()

  def shard_frozen(self, tree):
    return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(self.mesh, self.frozen_spec(x))), tree)

  def put_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """Host batch (this process's rows) → one global array per key, split over the batch axes."""
    sharding = self.batch_sharding
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in batch.items()}


def maybe_initialize_distributed() -> bool:
  """Multi-host: `jax.distributed.initialize` when the launcher set the coordinator variables.

  JAX_COORDINATOR_ADDRESS (host:port of process 0), JAX_NUM_PROCESSES and JAX_PROCESS_ID
  (0 … N-1). Must run before anything touches a device. On CPU, cross-process collectives use
  gloo (jax's default `jax_cpu_collectives_implementation`). Returns whether several processes run.
  """
  address = os.environ.get("JAX_COORDINATOR_ADDRESS")
  if not address:
    missing = [k for k in DISTRIBUTED_ENV[1:] if os.environ.get(k)]
    if missing:
      raise MeshError(f"{', '.join(missing)} set without JAX_COORDINATOR_ADDRESS: a multi-process launch needs "
                      f"all of {', '.join(DISTRIBUTED_ENV)}")
    return False
  values = {}
  for key in DISTRIBUTED_ENV[1:]:
    raw = os.environ.get(key)
    try:
      values[key] = int(raw)
    except (TypeError, ValueError):
      raise MeshError(f"JAX_COORDINATOR_ADDRESS={address} is set, so {key} must be an integer, got {raw!r}") from None
  if values["JAX_NUM_PROCESSES"] < 1 or not 0 <= values["JAX_PROCESS_ID"] < values["JAX_NUM_PROCESSES"]:
    raise MeshError(f"JAX_PROCESS_ID={values['JAX_PROCESS_ID']} must be in [0, JAX_NUM_PROCESSES="
                    f"{values['JAX_NUM_PROCESSES']})")
  if not jax.distributed.is_initialized():
    jax.distributed.initialize(coordinator_address=address, num_processes=values["JAX_NUM_PROCESSES"],
                               process_id=values["JAX_PROCESS_ID"])
  return values["JAX_NUM_PROCESSES"] > 1


def is_main_process() -> bool:
  """Process 0 writes the run's files (metrics, adapter, summary); every process checkpoints."""
  return jax.process_index() == 0


def barrier(name: str):
  """All processes reach this point before any goes on (no-op with one process)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def sum_over_processes(values) -> np.ndarray:
  """Σ over processes of a small host vector (e.g. this process's token counts)."""
  values = np.asarray(values)
  if jax.process_count() == 1:
    return values
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.process_allgather(values)).sum(axis=0)


def to_host(tree):
  """Global values as numpy on every process (collective: all processes must call it)."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  from jax.experimental import multihost_utils

  return multihost_utils.process_allgather(tree, tiled=True)  # tiled: each array's global value


def make_mesh_context(mesh_cfg) -> MeshContext:
  """`mesh: {data: -1, fsdp: 1}` → a Mesh over all devices (-1 takes what fsdp leaves)."""
  n = jax.device_count()
  data, fsdp = mesh_cfg.data, mesh_cfg.fsdp
  # The config's ranges of data and fsdp are `config.validate`'s (repeated here for a caller that
  # builds a MeshConfig itself); fitting them to the devices needs the devices.
  if fsdp < 1 or data == 0 or data < -1:
    raise ConfigError(f"mesh: data={data}, fsdp={fsdp}: sizes must be positive (data may be -1)")
  if data == -1:
    if n % fsdp:
      raise ConfigError(f"mesh: fsdp={fsdp} does not divide the {n} available devices")
    data = n // fsdp
  if data * fsdp != n:
    raise ConfigError(f"mesh: data={data} × fsdp={fsdp} = {data * fsdp} devices, but {n} are available "
                      f"({jax.devices()[0].platform}); use data=-1 to take all of them")
  # Auto axes: XLA propagates shardings from the inputs (no sharding-in-types annotations needed).
  auto = (jax.sharding.AxisType.Auto,) * 2
  return MeshContext(jax.make_mesh((data, fsdp), ("data", "fsdp"), axis_types=auto))


def check_batch_sizes(cfg, ctx: MeshContext):
  """Every bucket's batch size must split evenly over data × fsdp (checked before compiling). The
  config's own range of batch_size is `config.validate`'s; this one needs the devices."""
  m = ctx.batch_multiple_of
  if cfg.data.tokens_per_batch is None and cfg.data.batch_size % m:
    raise ConfigError(f"data.batch_size={cfg.data.batch_size} is not a multiple of the {m} devices on the "
                      f"data×fsdp axes (mesh {dict(ctx.mesh.shape)}); use a multiple of {m}")
