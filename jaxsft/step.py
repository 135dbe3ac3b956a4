"""One optimizer step as pure functions, their ahead-of-time compilation, and compile counting.

    accumulate (per micro-batch):  Σ∇nll, Σ nll, Σ valid  +=  value_and_grad(nll_sum)(lora)
    apply      (once per step):    g = Σ∇nll / Σ valid  →  clip_by_global_norm  →  AdamW
    train_step (grad_accum = 1):   apply(accumulate(zeros, batch)) as ONE executable

`lora` is "the trainable params": whatever the caller split off the model with a filter (the
LoRA factors, or every param for full fine-tuning); everything else is `frozen`, an input.
The loss only runs the LM head where a label is trained (`loss.trained_cross_entropy_sum`).

The step's loss is Σ token NLL / Σ valid tokens over all its micro-batches (and all devices: the
sums run over the global, sharded batch), never a mean of per-batch means. Only the trainable
params are differentiated and carry optimizer state.

`CompiledSteps` compiles `train_step` (or `accumulate`, with accumulation) and `evaluate` once
per batch shape before training and counts every XLA compile after that (JAX's own compile
events), so a recompile is visible. Every call only dispatches: nothing waits for the device
until a caller reads a result.
This module is what the trainer, the benchmarks and the tests share.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxsft import config as config_lib
from jaxsft import loss as loss_lib
from jaxsft import sharding as sharding_lib

MODEL_INPUTS = ("input_ids", "attention_mask", "positions", "segment_ids")
BATCH_KEYS = MODEL_INPUTS + ("labels",)


# ---------------------------------------------------------------------------------------------
# Compile counting.


class CompileCounter:
  """Counts XLA backend compiles (and their seconds) from JAX's own monitoring events."""

  def __init__(self):
    self.count = 0
    self.seconds = 0.0
    jax.monitoring.register_event_duration_secs_listener(self._on_event)

  def _on_event(self, event: str, duration: float, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
      self.count += 1
      self.seconds += duration


_COMPILES: CompileCounter | None = None


def compile_counter() -> CompileCounter:
  """The process-wide counter (JAX listeners cannot be removed, so there is one)."""
  global _COMPILES
  if _COMPILES is None:
    _COMPILES = CompileCounter()
  return _COMPILES


# ---------------------------------------------------------------------------------------------
# Schedule and optimizer.


def make_schedule(o: config_lib.OptimConfig, total_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to `lr`, then cosine or linear decay to 0, or constant."""
  warmup = o.warmup_steps if o.warmup_steps is not None else int(math.ceil(o.warmup_ratio * total_steps))
  warmup = min(warmup, max(total_steps - 1, 0))
  decay_steps = max(total_steps - warmup, 1)
  if o.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, o.lr, warmup, warmup + decay_steps, end_value=0.0)
  after = optax.linear_schedule(o.lr, 0.0, decay_steps) if o.schedule == "linear" else optax.constant_schedule(o.lr)
  if warmup == 0:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, o.lr, warmup), after], [warmup])


def make_optimizer(o: config_lib.OptimConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
  """clip_by_global_norm → AdamW; an update with a non-finite gradient is skipped.

  `apply_if_finite` gives up (applies) only after 10⁹ bad steps: the loop stops the run first,
  after `max_nonfinite_steps` in a row. A skipped update leaves AdamW's state, and so its
  schedule's step count, unchanged.
  """
  tx = optax.chain(
      optax.clip_by_global_norm(o.max_grad_norm),
      optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay),
  )
  return optax.apply_if_finite(tx, max_consecutive_errors=10**9)


def updates_applied(opt_state) -> jax.Array:
  """How many updates AdamW has applied: the step count its learning-rate schedule reads.

  It lags the loop's step count by the number of skipped (non-finite) steps.
  """
  (count,) = [value for path, value in optax.tree_utils.tree_get_all_with_path(opt_state, "count")
              if getattr(path[-1], "tuple_name", None) == "ScaleByScheduleState"]
  return count


# ---------------------------------------------------------------------------------------------
# The step functions.


class StepFunctions(NamedTuple):
  """Pure functions of (LoRA params, frozen params, ...); `CompiledSteps` jits them.

  zeros(lora) -> acc:                              an empty accumulator
  accumulate(acc, lora, frozen, batch, micro) -> acc: adds one micro-batch's Σ∇nll, Σ nll, Σ valid
  apply(lora, opt_state, acc) -> (lora, opt_state, out): the update from the step's global sums;
      out: loss, nll, n_valid, grad_norm, finite, lr (the rate this update used)
  evaluate(lora, frozen, batch) -> (Σ nll, Σ valid): validation with the same normalization
  """

  zeros: Callable
  accumulate: Callable
  apply: Callable
  evaluate: Callable


def loss_chunk_size() -> int:
  """Positions per LM-head matmul: small on a CPU (finer skipping of untrained positions, still
  matmul-efficient), larger on accelerators (fewer, bigger matmuls)."""
  return 256 if jax.default_backend() == "cpu" else 1024


def make_step_functions(graphdef, cfg: config_lib.TrainConfig, tx: optax.GradientTransformation,
                        schedule: optax.Schedule) -> StepFunctions:
  dropout = cfg.lora.dropout > 0
  base_key = jax.random.key(cfg.seed)

  def nll_sum(lora, frozen, batch, rng):
    model = nnx.merge(graphdef, lora, frozen)
    inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
    hidden = model.hidden_states(**inputs, dropout_rng=rng)
    # The LM head only at trained positions, in chunks, each chunk's gradient beside its loss.
    return loss_lib.trained_cross_entropy_sum(hidden, model.output_embedding(), batch["labels"],
                                              chunk_size=loss_chunk_size())

  def zeros(lora):
    return {"grads": jax.tree.map(jnp.zeros_like, lora), "nll": jnp.zeros((), jnp.float32),
            "n_valid": jnp.zeros((), jnp.int32)}

  def accumulate(acc, lora, frozen, batch, micro_index):
    rng = jax.random.fold_in(base_key, micro_index) if dropout else None
    (nll, n_valid), grads = jax.value_and_grad(nll_sum, has_aux=True)(lora, frozen, batch, rng)
    return {"grads": jax.tree.map(jnp.add, acc["grads"], grads), "nll": acc["nll"] + nll,
            "n_valid": acc["n_valid"] + n_valid}

  def apply(lora, opt_state, acc):
    loss, grads = loss_lib.normalize_by_valid((acc["nll"], acc["grads"]), acc["n_valid"])
    lr = schedule(updates_applied(opt_state))  # read before the update: the rate it uses
    updates, opt_state = tx.update(grads, opt_state, lora)
    lora = optax.apply_updates(lora, updates)
    finite = opt_state.last_finite & jnp.isfinite(loss)
    return lora, opt_state, {"loss": loss, "nll": acc["nll"], "n_valid": acc["n_valid"],
                             "grad_norm": optax.tree.norm(grads), "finite": finite, "lr": lr}

  def evaluate(lora, frozen, batch):
    return nll_sum(lora, frozen, batch, None)

  return StepFunctions(zeros=zeros, accumulate=accumulate, apply=apply, evaluate=evaluate)


# ---------------------------------------------------------------------------------------------
# Ahead-of-time compilation per batch shape.


class CompiledSteps:
  """`StepFunctions` compiled ahead of time, once per batch shape.

  `train_step` (one micro-batch per optimizer step) is zeros → accumulate → apply fused into one
  executable, the LoRA params and optimizer state donated. With accumulation the micro-batches
  chain `accumulate` calls on the device (the accumulator donated) and `apply` finishes the
  step; no call waits for the device. A call with a shape that was not warmed up falls back to
  `jax.jit` (and is recorded in `unexpected_shapes`); `recompiles` counts the XLA compiles that
  happened inside step calls.
  """

  def __init__(self, fns: StepFunctions, lora, opt_state, frozen, mesh: sharding_lib.MeshContext):
    self.mesh = mesh
    # Every output (LoRA params, optimizer state, sums, metrics) is replicated over the mesh;
    # without out_shardings, constant outputs (zeros, counters) would land on one device and
    # clash with the mesh-wide inputs of the next call.
    rep = mesh.replicated

    def train_step(lora, opt_state, frozen, batch, micro_index):
      return fns.apply(lora, opt_state, fns.accumulate(fns.zeros(lora), lora, frozen, batch, micro_index))

    self._jit = {
        "zeros": jax.jit(fns.zeros, out_shardings=rep),
        "accumulate": jax.jit(fns.accumulate, donate_argnums=0, out_shardings=rep),
        "apply": jax.jit(fns.apply, donate_argnums=(0, 1), out_shardings=rep),
        "train_step": jax.jit(train_step, donate_argnums=(0, 1), out_shardings=rep),
        "evaluate": jax.jit(fns.evaluate, out_shardings=rep),
    }
    self._compiled: dict[Any, Any] = {}
    self._lora, self._opt_state, self._frozen = lora, opt_state, frozen
    self.unexpected_shapes: list[tuple] = []
    self.compile_seconds: dict[tuple[int, int], float] = {}  # per shape, train (and eval) compiles together
    self._warm_keys: dict[tuple[int, int], tuple] = {}  # per shape, what warm_up compiled it for
    self.step_seconds: dict[tuple[int, int], float] = {}  # per shape, `time_step`'s measurement (no label trained)
    self.trained_step_seconds: dict[tuple[int, int], float] = {}  # the same with every label trained
    self.recompiles = 0
    self._counter = compile_counter()

  def _spec(self, shape, keys):
    return {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.mesh.batch_sharding) for k in keys}

  def warm_up(self, shapes: list[tuple[int, int]], keys: tuple[str, ...], with_eval: bool, *,
              fused: bool = False) -> None:
    """Compiles, for every (B, T) in `shapes` not compiled yet, `train_step` (`fused`: one
    micro-batch per step) or `accumulate` (then zeros and apply once), and `evaluate` when
    `with_eval`; each shape's seconds go to `compile_seconds`."""
    micro = jax.ShapeDtypeStruct((), jnp.int32)
    if not fused:
      acc = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                         self._jit["zeros"](self._lora))
      self._compiled["zeros"] = self._jit["zeros"].lower(self._lora).compile()
      self._compiled["apply"] = self._jit["apply"].lower(self._lora, self._opt_state, acc).compile()
    for shape in shapes:
      if self._warm_keys.get(tuple(shape)) == (tuple(keys), fused, with_eval):
        continue  # compiled by an earlier call (a probe of the step's cost)
      t0 = time.perf_counter()
      spec = self._spec(shape, keys)
      if fused:
        self._compiled[("train_step", shape)] = self._jit["train_step"].lower(
            self._lora, self._opt_state, self._frozen, spec, micro).compile()
      else:
        self._compiled[("accumulate", shape)] = self._jit["accumulate"].lower(
            acc, self._lora, self._frozen, spec, micro).compile()
      if with_eval:
        self._compiled[("evaluate", shape)] = self._jit["evaluate"].lower(self._lora, self._frozen, spec).compile()
      self.compile_seconds[tuple(shape)] = time.perf_counter() - t0
      self._warm_keys[tuple(shape)] = (tuple(keys), fused, with_eval)

  def time_step(self, shape: tuple[int, int], keys: tuple[str, ...], *, fused: bool, trained: bool = False,
                calls: int = 2) -> float:
    """Seconds of a compiled training call on a (B, T) batch (`train_step`, or `accumulate` when
    not `fused`): the least of `calls` calls (the first call of an executable pays one-off costs),
    on copies of the state, so the run's params and optimizer state are untouched (call it before
    training: it copies the state `CompiledSteps` was built with). The token values do not matter
    to the time, the trained labels do (the LM head runs only where a label is trained): none, or
    with `trained` every one. Kept in `step_seconds` (none trained) or `trained_step_seconds`."""
    b, t = shape
    rows = (b // jax.process_count(), t)  # this process's rows of the global batch
    values = {"input_ids": np.zeros(rows, np.int32), "attention_mask": np.ones(rows, np.int32),
              "labels": np.full(rows, 1 if trained else -100, np.int32), "segment_ids": np.ones(rows, np.int32),
              "positions": np.broadcast_to(np.arange(t, dtype=np.int32), rows).copy()}
    batch = self.mesh.put_batch({k: values[k] for k in keys})
    copy = lambda x: jax.device_put(x, may_alias=False)  # noqa: E731  a copy, no compile
    times = []
    for _ in range(calls):
      lora = jax.tree.map(copy, self._lora)
      if fused:
        opt_state = jax.tree.map(copy, self._opt_state)
        jax.block_until_ready((lora, opt_state, batch))
        t0 = time.perf_counter()
        jax.block_until_ready(self._compiled[("train_step", tuple(shape))](lora, opt_state, self._frozen, batch,
                                                                           np.int32(0)))
      else:
        acc = self._compiled["zeros"](lora)
        jax.block_until_ready((acc, batch))
        t0 = time.perf_counter()
        jax.block_until_ready(self._compiled[("accumulate", tuple(shape))](acc, lora, self._frozen, batch, np.int32(0)))
      times.append(time.perf_counter() - t0)
    (self.trained_step_seconds if trained else self.step_seconds)[tuple(shape)] = min(times)
    return min(times)

  def compiled(self, name: str, shape: tuple[int, int] | None = None):
    """The AOT-compiled executable (`.as_text()`, `.cost_analysis()`), after `warm_up`."""
    return self._compiled[name if shape is None else (name, tuple(shape))]

  def _call(self, key, *args):
    fn = self._compiled.get(key)
    if fn is None:
      self.unexpected_shapes.append(key)
      fn = self._jit[key[0] if isinstance(key, tuple) else key]
    before = self._counter.count
    out = fn(*args)
    self.recompiles += self._counter.count - before
    return out

  def zeros(self, lora):
    return self._call("zeros", lora)

  def accumulate(self, acc, lora, frozen, batch, micro_index):
    return self._call(("accumulate", batch["input_ids"].shape), acc, lora, frozen, batch, micro_index)

  def apply(self, lora, opt_state, acc):
    return self._call("apply", lora, opt_state, acc)

  def train_step(self, lora, opt_state, frozen, batch, micro_index):
    """(lora, opt_state, out) after one optimizer step on one micro-batch: one dispatch."""
    return self._call(("train_step", batch["input_ids"].shape), lora, opt_state, frozen, batch, micro_index)

  def evaluate(self, lora, frozen, batch):
    return self._call(("evaluate", batch["input_ids"].shape), lora, frozen, batch)
