"""One optimizer step as pure functions, their ahead-of-time compilation, and compile counting.

    accumulate (per micro-batch):  Σ∇nll, Σ nll, Σ valid  +=  value_and_grad(nll_sum)(trainable)
    apply      (once per step):    g = Σ∇nll / Σ valid  →  clip_by_global_norm  →  AdamW
    train_step (grad_accum = 1):   apply(accumulate(zeros, batch)) as ONE executable

`trainable` is whatever the caller split off the model with a filter (the LoRA factors, or every
param for full fine-tuning); everything else is `frozen`, an input.
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
from jaxsft import neftune
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


class Schedule(NamedTuple):
  """The learning-rate schedule's numbers: linear warmup from 0 to `peak` over `warmup` updates,
  then `OptimConfig.schedule`'s shape over `decay` updates (cosine or linear to 0, or constant).

  The numbers are float32 arrays that the step takes as inputs, not constants compiled into it:
  a run with another learning rate, warmup or length runs the same executable (a persistent
  compilation cache hit, no compile). The shape is code, so it stays part of the compiled step.
  """

  peak: jax.Array
  warmup: jax.Array
  decay: jax.Array

  def at(self, count: jax.Array, shape: str) -> jax.Array:
    r"""The rate of update `count` (0-based), as optax's schedules give it for the same numbers:

        warmup:  peak · count / warmup                                     count < warmup
        cosine:  peak · ½ (1 + cos(π · min(count − warmup, decay) / decay))
        linear:  peak · (1 − min(count − warmup, decay) / decay)
        constant: peak
    """
    count = jnp.asarray(count, jnp.float32)
    t = jnp.minimum(jnp.maximum(count - self.warmup, 0.0), self.decay) / self.decay
    if shape == "cosine":
      after = self.peak * (0.5 * (1 + jnp.cos(jnp.pi * t)))
    elif shape == "linear":
      after = self.peak * (1 - t)
    else:
      after = self.peak * jnp.ones_like(t)
    warming = self.peak * (count / jnp.maximum(self.warmup, 1.0))
    return jnp.where(count < self.warmup, warming, after)


def make_schedule(o: config_lib.OptimConfig, total_steps: int) -> Schedule:
  """The schedule of a run of `total_steps` updates: warmup (`warmup_steps`, else `warmup_ratio`
  of the run, at most all but one update) then decay over the rest."""
  warmup = o.warmup_steps if o.warmup_steps is not None else int(math.ceil(o.warmup_ratio * total_steps))
  warmup = min(warmup, max(total_steps - 1, 0))
  decay_steps = max(total_steps - warmup, 1)
  return Schedule(*(np.float32(x) for x in (o.lr, warmup, decay_steps)))


def make_optimizer(o: config_lib.OptimConfig, schedule: Schedule) -> optax.GradientTransformation:
  """clip_by_global_norm → AdamW at `schedule`'s rate; an update with a non-finite gradient is skipped.

  Its state's structure does not depend on the schedule's numbers: the state one schedule's
  optimizer makes serves another's (`make_step_functions` builds the optimizer inside the step
  from the numbers it is given).

  `apply_if_finite` gives up (applies) only after 10⁹ bad steps: the loop stops the run first,
  after `max_nonfinite_steps` in a row. A skipped update leaves AdamW's state, and so its
  schedule's step count, unchanged.
  """
  tx = optax.chain(
      optax.clip_by_global_norm(o.max_grad_norm),
      optax.adamw(lambda count: schedule.at(count, o.schedule), b1=o.b1, b2=o.b2, eps=o.eps,
                  weight_decay=o.weight_decay),
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
  """Pure functions of (trainable params, frozen params, ...); `CompiledSteps` jits them.

  zeros(trainable) -> acc:                              an empty accumulator
  accumulate(acc, trainable, frozen, batch, micro) -> acc: adds one micro-batch's Σ∇nll, Σ nll, Σ valid
  apply(trainable, opt_state, acc, schedule) -> (trainable, opt_state, out): the update from the
      step's global sums at `schedule`'s rate (a `Schedule` of arrays: an input, not a constant);
      out: loss, nll, n_valid, grad_norm, finite, lr (the rate this update used)
  evaluate(trainable, frozen, batch) -> (Σ nll, Σ valid): validation with the same normalization
  """

  zeros: Callable
  accumulate: Callable
  apply: Callable
  evaluate: Callable


def loss_chunk_size() -> int:
  """Positions per LM-head matmul: small on a CPU (finer skipping of untrained positions, still
  matmul-efficient), larger on accelerators (fewer, bigger matmuls)."""
  return 256 if jax.default_backend() == "cpu" else 1024


def make_step_functions(graphdef, cfg: config_lib.TrainConfig) -> StepFunctions:
  dropout = cfg.lora.dropout > 0
  neftune_alpha = cfg.neftune_noise_alpha or 0.0  # None or 0: no noise
  base_key = jax.random.key(cfg.seed)

  def nll_sum(trainable, frozen, batch, rng, noise_rng=None):
    """Σ nll, Σ valid of `batch`; `rng`: the dropout key, `noise_rng`: NEFTune's (None: none)."""
    model = nnx.merge(graphdef, trainable, frozen)
    inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
    hook = None
    if noise_rng is not None:
      hook = neftune.embedding_noise(noise_rng, neftune_alpha, batch.get("attention_mask"), batch.get("segment_ids"))
    hidden = model.hidden_states(**inputs, dropout_rng=rng, embeddings_hook=hook)
    # The LM head only at trained positions, in chunks, each chunk's gradient beside its loss.
    return loss_lib.trained_cross_entropy_sum(hidden, model.output_embedding(), batch["labels"],
                                              chunk_size=loss_chunk_size())

  def zeros(trainable):
    return {"grads": jax.tree.map(jnp.zeros_like, trainable), "nll": jnp.zeros((), jnp.float32),
            "n_valid": jnp.zeros((), jnp.int32)}

  def accumulate(acc, trainable, frozen, batch, micro_index):
    rng = jax.random.fold_in(base_key, micro_index) if dropout else None
    # NEFTune's key, like dropout's, follows from the seed and the micro-batch index: a resumed
    # run draws the noise the uninterrupted one would have.
    noise_rng = neftune.noise_key(base_key, micro_index) if neftune_alpha > 0 else None
    (nll, n_valid), grads = jax.value_and_grad(nll_sum, has_aux=True)(trainable, frozen, batch, rng, noise_rng)
    return {"grads": jax.tree.map(jnp.add, acc["grads"], grads), "nll": acc["nll"] + nll,
            "n_valid": acc["n_valid"] + n_valid}

  def apply(trainable, opt_state, acc, schedule: Schedule):
    loss, grads = loss_lib.normalize_by_valid((acc["nll"], acc["grads"]), acc["n_valid"])
    tx = make_optimizer(cfg.optim, schedule)
    lr = schedule.at(updates_applied(opt_state), cfg.optim.schedule)  # read before the update: the rate it uses
    updates, opt_state = tx.update(grads, opt_state, trainable)
    trainable = optax.apply_updates(trainable, updates)
    finite = opt_state.last_finite & jnp.isfinite(loss)
    return trainable, opt_state, {"loss": loss, "nll": acc["nll"], "n_valid": acc["n_valid"],
                             "grad_norm": optax.tree.norm(grads), "finite": finite, "lr": lr}

  def evaluate(trainable, frozen, batch):
    return nll_sum(trainable, frozen, batch, None)  # no dropout, no NEFTune noise

  return StepFunctions(zeros=zeros, accumulate=accumulate, apply=apply, evaluate=evaluate)


# ---------------------------------------------------------------------------------------------
# Ahead-of-time compilation per batch shape.


REPEAT_UNDER_S = 1.0
"""`CompiledSteps.time_step` calls a step twice when its first call took less (seconds)."""


class CompiledSteps:
  """`StepFunctions` compiled ahead of time, once per batch shape.

  `train_step` (one micro-batch per optimizer step) is zeros → accumulate → apply fused into one
  executable, the trainable params and optimizer state donated. With accumulation the micro-batches
  chain `accumulate` calls on the device (the accumulator donated) and `apply` finishes the
  step; no call waits for the device. A call with a shape that was not warmed up falls back to
  `jax.jit` (and is recorded in `unexpected_shapes`); `recompiles` counts the XLA compiles that
  happened inside step calls.
  """

  def __init__(self, fns: StepFunctions, trainable, opt_state, frozen, mesh: sharding_lib.MeshContext,
               schedule: Schedule):
    self.mesh = mesh
    # Every output (trainable params, optimizer state, sums, metrics) is replicated over the mesh;
    # without out_shardings, constant outputs (zeros, counters) would land on one device and
    # clash with the mesh-wide inputs of the next call.
    rep = mesh.replicated

    def train_step(trainable, opt_state, frozen, batch, micro_index, schedule):
      return fns.apply(trainable, opt_state, fns.accumulate(fns.zeros(trainable), trainable, frozen, batch, micro_index),
                       schedule)

    self._jit = {
        "zeros": jax.jit(fns.zeros, out_shardings=rep),
        "accumulate": jax.jit(fns.accumulate, donate_argnums=0, out_shardings=rep),
        "apply": jax.jit(fns.apply, donate_argnums=(0, 1), out_shardings=rep),
        "train_step": jax.jit(train_step, donate_argnums=(0, 1), out_shardings=rep),
        "evaluate": jax.jit(fns.evaluate, out_shardings=rep),
    }
    self._compiled: dict[Any, Any] = {}
    self._trainable, self._opt_state, self._frozen = trainable, opt_state, frozen
    self.schedule = mesh.replicate(schedule)  # an input of every update: see `Schedule`
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
                         self._jit["zeros"](self._trainable))
      self._compiled["zeros"] = self._jit["zeros"].lower(self._trainable).compile()
      self._compiled["apply"] = self._jit["apply"].lower(self._trainable, self._opt_state, acc, self.schedule).compile()
    for shape in shapes:
      if self._warm_keys.get(tuple(shape)) == (tuple(keys), fused, with_eval):
        continue  # compiled by an earlier call (a probe of the step's cost)
      t0 = time.perf_counter()
      spec = self._spec(shape, keys)
      if fused:
        self._compiled[("train_step", shape)] = self._jit["train_step"].lower(
            self._trainable, self._opt_state, self._frozen, spec, micro, self.schedule).compile()
      else:
        self._compiled[("accumulate", shape)] = self._jit["accumulate"].lower(
            acc, self._trainable, self._frozen, spec, micro).compile()
      if with_eval:
        self._compiled[("evaluate", shape)] = self._jit["evaluate"].lower(self._trainable, self._frozen, spec).compile()
      self.compile_seconds[tuple(shape)] = time.perf_counter() - t0
      self._warm_keys[tuple(shape)] = (tuple(keys), fused, with_eval)

  def time_step(self, shape: tuple[int, int], keys: tuple[str, ...], *, fused: bool, trained: bool = False,
                calls: int | None = None) -> float:
    """Seconds of a compiled training call on a (B, T) batch (`train_step`, or `accumulate` when
    not `fused`), on copies of the state, so the run's params and optimizer state are untouched (call
    it before training: it copies the state `CompiledSteps` was built with). The token values do not
    matter to the time, the trained labels do (the LM head runs only where a label is trained): none,
    or with `trained` every one. Kept in `step_seconds` (none trained) or `trained_step_seconds`.

    The least of `calls` calls; by default one, and a second where the first may have paid one-off
    costs that later steps do not: the first call `time_step` makes (the process's first step, as a
    rule: threads and fresh memory), or a call under `REPEAT_UNDER_S` (an executable's first call
    pays tens of milliseconds once, a visible share of a short step). A later call of a longer
    step costs what the first did, within the machine's noise (benchmarks/results/time_step_calls*)."""
    b, t = shape
    rows = (b // jax.process_count(), t)  # this process's rows of the global batch
    values = {"input_ids": np.zeros(rows, np.int32), "attention_mask": np.ones(rows, np.int32),
              "labels": np.full(rows, 1 if trained else -100, np.int32), "segment_ids": np.ones(rows, np.int32),
              "positions": np.broadcast_to(np.arange(t, dtype=np.int32), rows).copy()}
    batch = self.mesh.put_batch({k: values[k] for k in keys})
    copy = lambda x: jax.device_put(x, may_alias=False)  # noqa: E731  a copy, no compile
    first_timed = not (self.step_seconds or self.trained_step_seconds)

    def call() -> float:
      trainable = jax.tree.map(copy, self._trainable)
      if fused:
        opt_state = jax.tree.map(copy, self._opt_state)
        jax.block_until_ready((trainable, opt_state, batch))
        t0 = time.perf_counter()
        jax.block_until_ready(self._compiled[("train_step", tuple(shape))](trainable, opt_state, self._frozen, batch,
                                                                           np.int32(0), self.schedule))
      else:
        acc = self._compiled["zeros"](trainable)
        jax.block_until_ready((acc, batch))
        t0 = time.perf_counter()
        jax.block_until_ready(self._compiled[("accumulate", tuple(shape))](acc, trainable, self._frozen, batch, np.int32(0)))
      return time.perf_counter() - t0

    times = [call()]
    repeats = calls - 1 if calls else int(first_timed or times[0] < REPEAT_UNDER_S)
    times += [call() for _ in range(repeats)]
    (self.trained_step_seconds if trained else self.step_seconds)[tuple(shape)] = min(times)
    return min(times)

  def use_schedule(self, schedule: Schedule) -> None:
    """Later updates follow `schedule` (the executables are unchanged: it is an input of them)."""
    self.schedule = self.mesh.replicate(schedule)

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

  def zeros(self, trainable):
    return self._call("zeros", trainable)

  def accumulate(self, acc, trainable, frozen, batch, micro_index):
    return self._call(("accumulate", batch["input_ids"].shape), acc, trainable, frozen, batch, micro_index)

  def apply(self, trainable, opt_state, acc):
    return self._call("apply", trainable, opt_state, acc, self.schedule)

  def train_step(self, trainable, opt_state, frozen, batch, micro_index):
    """(trainable, opt_state, out) after one optimizer step on one micro-batch: one dispatch."""
    return self._call(("train_step", batch["input_ids"].shape), trainable, opt_state, frozen, batch, micro_index,
                      self.schedule)

  def evaluate(self, trainable, frozen, batch):
    return self._call(("evaluate", batch["input_ids"].shape), trainable, frozen, batch)


def build_steps(cfg: config_lib.TrainConfig, graphdef, trainable, frozen, mesh: sharding_lib.MeshContext,
                total_steps: int) -> tuple[CompiledSteps, Any]:
  """(CompiledSteps, initial optimizer state) for a run of `total_steps` (the schedule's length)."""
  schedule = make_schedule(cfg.optim, total_steps)
  tx = make_optimizer(cfg.optim, schedule)
  opt_state = jax.jit(tx.init, out_shardings=mesh.replicated)(trainable)  # follows the replicated trainable params
  return CompiledSteps(make_step_functions(graphdef, cfg), trainable, opt_state, frozen, mesh, schedule), opt_state
