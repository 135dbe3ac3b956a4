"""`python -m jaxsft.train`: LoRA supervised fine-tuning, one optimizer step read top to bottom.

    config → records → Grain batches (bucketed) → model + LoRA → warm-up compiles
      → loop: micro-batches → Σ grad nll, Σ nll, Σ valid → clip → AdamW → metrics
      → validation, orbax checkpoints (+ Grain iterator state), PEFT adapter
      → loss curve, doctor, tuned-vs-base evaluation

The step's loss is Σ token NLL / Σ valid tokens over all micro-batches (and all devices: the
sums run over the global, sharded batch), never a mean of per-batch means. Every bucket shape is
compiled before step 1; a compile after that is counted and reported.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pathlib
import queue
import shutil
import sys
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxsft import config as config_lib
from jaxsft import data as data_lib
from jaxsft import loss as loss_lib
from jaxsft import lora as lora_lib
from jaxsft import models
from jaxsft import sharding as sharding_lib
from jaxsft.fileio import atomic_write

log = logging.getLogger("jaxsft.train")

MODEL_INPUTS = ("input_ids", "attention_mask", "positions", "segment_ids")
BATCH_KEYS = MODEL_INPUTS + ("labels",)


class TrainingError(RuntimeError):
  """The run cannot go on (e.g. too many non-finite steps); saved state is kept."""


# --------------------------------------------------------------------------- compile counting
class CompileCounter:
  """Counts XLA backend compiles from JAX's own monitoring events."""

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
  global _COMPILES
  if _COMPILES is None:
    _COMPILES = CompileCounter()
  return _COMPILES


# --------------------------------------------------------------------------- data
def load_data(cfg: config_lib.TrainConfig) -> tuple[list[dict], list[dict]]:
  """Training and held-out records. Without a path: jaxsft's generated task set."""
  d = cfg.data
  if d.path is None:
    from jaxsft.data import synthetic

    records = synthetic.make_dataset(d.synthetic_size, seed=d.seed)
  else:
    records = data_lib.load_records(d.path, fmt=d.format, field_map=d.field_map, on_error=d.on_error)
  if d.val_path is not None:
    val = data_lib.load_records(d.val_path, fmt=d.format, field_map=d.field_map, on_error=d.on_error)
    train = list(records)
  else:
    order = np.random.default_rng(d.seed).permutation(len(records))
    n_val = min(max(1, int(round(len(records) * d.val_fraction))), d.max_val_examples) if d.val_fraction > 0 else 0
    if n_val >= len(records):
      raise data_lib.DataError(f"{d.path}: {len(records)} records leave none for training after a {d.val_fraction} validation split")
    val = [records[i] for i in order[:n_val]]
    train = [records[i] for i in order[n_val:]]
  return train, val[: d.max_val_examples]


def pipeline_kwargs(cfg: config_lib.TrainConfig, batch_multiple_of: int) -> dict[str, Any]:
  d = cfg.data
  return dict(
      max_length=d.max_length, batching=d.batching, bucket_lengths=list(d.bucket_lengths) if d.bucket_lengths else None,
      num_buckets=d.num_buckets, batch_size=d.batch_size, tokens_per_batch=d.tokens_per_batch,
      pad_to_multiple_of=d.pad_to_multiple_of, batch_multiple_of=batch_multiple_of, train_on=d.train_on,
  )


class DevicePrefetch:
  """Pulls batches on a thread and puts them on the devices while the current step runs.

  Each item carries the Grain iterator's state *after* that batch, so a checkpoint saves the
  position of the last consumed batch, not of the prefetched ones.
  """

  def __init__(self, iterator, put_on_device, size: int = 2):
    self._queue: queue.Queue = queue.Queue(maxsize=size)
    self._iterator = iterator
    self._put = put_on_device
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()

  def _run(self):
    try:
      for batch in self._iterator:
        if self._stop.is_set():
          return
        state = self._iterator.get_state()
        host = {k: batch[k] for k in ("epoch",) if k in batch}
        mask = batch["attention_mask"]
        host["real_tokens"] = int(mask.sum())
        host["valid_tokens"] = int((batch["labels"] != -100).sum())
        host["shape"] = tuple(batch["input_ids"].shape)
        self._queue.put((self._put({k: batch[k] for k in BATCH_KEYS if k in batch}), host, state))
      self._queue.put(StopIteration)
    except BaseException as e:  # surfaced in the training thread
      self._queue.put(e)

  def __iter__(self):
    return self

  def __next__(self):
    item = self._queue.get()
    if item is StopIteration:
      raise StopIteration
    if isinstance(item, BaseException):
      raise item
    return item

  def close(self):
    self._stop.set()
    try:
      while True:
        self._queue.get_nowait()
    except queue.Empty:
      pass


class _IteratorState:
  """What grain's orbax handler saves: the iterator state recorded after the last consumed batch."""

  def __init__(self, state=None):
    self.state = state

  def get_state(self) -> bytes:
    return json.dumps(self.state).encode()

  def set_state(self, raw: bytes):
    self.state = json.loads(raw)

  def start_prefetch(self):
    pass


# --------------------------------------------------------------------------- optimizer
def make_schedule(o: config_lib.OptimConfig, total_steps: int) -> optax.Schedule:
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
  after `max_nonfinite_steps` in a row.
  """
  tx = optax.chain(
      optax.clip_by_global_norm(o.max_grad_norm),
      optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay),
  )
  return optax.apply_if_finite(tx, max_consecutive_errors=10**9)


# --------------------------------------------------------------------------- the step
def make_step_fns(graphdef, cfg: config_lib.TrainConfig, tx: optax.GradientTransformation, schedule: optax.Schedule):
  """Pure functions of (lora, frozen, ...) that the loop jits.

  accumulate: one micro-batch → adds its Σ grad nll, Σ nll and Σ valid to the accumulator.
  apply:      grads = Σ grad nll / Σ valid (the step's global count) → clip → AdamW.
  evaluate:   one batch → (Σ nll, Σ valid), for validation with the same normalization.
  """
  dropout = cfg.lora.dropout > 0
  base_key = jax.random.key(cfg.seed)

  def nll_sum(lora, frozen, batch, rng):
    model = nnx.merge(graphdef, lora, frozen)
    inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
    if cfg.model.chunked_loss:
      hidden = model.hidden_states(**inputs, dropout_rng=rng)
      return loss_lib.chunked_cross_entropy_sum(hidden, model.output_embedding(), batch["labels"])
    return loss_lib.cross_entropy_sum(model(**inputs, dropout_rng=rng), batch["labels"])

  def accumulate(acc, lora, frozen, batch, micro_index):
    rng = jax.random.fold_in(base_key, micro_index) if dropout else None
    (nll, n_valid), grads = jax.value_and_grad(nll_sum, has_aux=True)(lora, frozen, batch, rng)
    return {
        "grads": jax.tree.map(jnp.add, acc["grads"], grads),
        "nll": acc["nll"] + nll,
        "n_valid": acc["n_valid"] + n_valid,
    }

  def apply(lora, opt_state, acc, step):
    n_valid = jnp.maximum(acc["n_valid"], 1).astype(jnp.float32)
    grads = jax.tree.map(lambda g: g / n_valid, acc["grads"])
    loss = acc["nll"] / n_valid
    updates, opt_state = tx.update(grads, opt_state, lora)
    lora = optax.apply_updates(lora, updates)
    finite = opt_state.last_finite & jnp.isfinite(loss)
    return lora, opt_state, {"loss": loss, "grad_norm": optax.global_norm(grads), "finite": finite,
                             "lr": schedule(step)}

  def evaluate(lora, frozen, batch):
    return nll_sum(lora, frozen, batch, None)

  def zeros(lora):
    return {
        "grads": jax.tree.map(jnp.zeros_like, lora),
        "nll": jnp.zeros((), jnp.float32),
        "n_valid": jnp.zeros((), jnp.int32),
    }

  return accumulate, apply, evaluate, zeros


class CompiledSteps:
  """Ahead-of-time compiled executables, one per batch shape; unknown shapes fall back to jit."""

  def __init__(self, fns, lora, opt_state, frozen, mesh_ctx: sharding_lib.MeshContext):
    accumulate, apply, evaluate, zeros = fns
    self.mesh = mesh_ctx
    # Every output (LoRA params, optimizer state, accumulated sums, metrics) is replicated over the
    # mesh; without out_shardings, outputs that are constants (zeros, counters) would land on one
    # device and clash with the mesh-wide inputs of the next call.
    rep = mesh_ctx.replicated
    self._jit = {
        "accumulate": jax.jit(accumulate, donate_argnums=0, out_shardings=rep),
        "apply": jax.jit(apply, donate_argnums=(0, 1), out_shardings=rep),
        "evaluate": jax.jit(evaluate, out_shardings=rep),
        "zeros": jax.jit(zeros, out_shardings=rep),
    }
    self._compiled: dict[Any, Any] = {}
    self._lora, self._opt_state, self._frozen = lora, opt_state, frozen
    self.unexpected_shapes: list[tuple] = []
    self.recompiles = 0  # XLA compiles during step calls after warm-up (JAX's own compile events)
    self._counter = compile_counter()

  def _batch_spec(self, shape, keys):
    return {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.mesh.batch_sharding) for k in keys}

  def warm_up(self, shapes: list[tuple[int, int]], keys: tuple[str, ...], with_eval: bool):
    acc = jax.eval_shape(self._jit["zeros"], self._lora)
    acc = jax.tree.map(lambda s, x: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=x.sharding),
                       acc, self._jit["zeros"](self._lora))
    self._compiled["zeros"] = self._jit["zeros"].lower(self._lora).compile()
    step = jax.ShapeDtypeStruct((), jnp.int32)
    self._compiled["apply"] = self._jit["apply"].lower(self._lora, self._opt_state, acc, step).compile()
    micro = jax.ShapeDtypeStruct((), jnp.int32)
    for shape in shapes:
      spec = self._batch_spec(shape, keys)
      self._compiled[("accumulate", shape)] = self._jit["accumulate"].lower(acc, self._lora, self._frozen, spec, micro).compile()
      if with_eval:
        self._compiled[("evaluate", shape)] = self._jit["evaluate"].lower(self._lora, self._frozen, spec).compile()

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

  def apply(self, lora, opt_state, acc, step):
    return self._call("apply", lora, opt_state, acc, step)

  def evaluate(self, lora, frozen, batch):
    return self._call(("evaluate", batch["input_ids"].shape), lora, frozen, batch)


# --------------------------------------------------------------------------- run directory
class RunFiles:
  """metrics.jsonl (append, flushed per line), config, held-out records, adapter.

  With several processes only process 0 writes (`writer`); orbax checkpoints are every process's.
  """

  def __init__(self, output_dir: str, writer: bool = True):
    self.dir = pathlib.Path(output_dir)
    self.writer = writer
    self.metrics = self.dir / "metrics.jsonl"
    self.checkpoints = self.dir / "checkpoints"
    self.adapter = self.dir / "adapter"

  def write_json(self, name: str, obj):
    if not self.writer:
      return
    _atomic_write_text(self.dir / name, json.dumps(obj, indent=2, default=str))

  def truncate_metrics(self, last_step: int):
    """On resume: drop metric lines from steps after the checkpoint (they will be redone) and
    the previous run's end-of-run epoch line (the resumed run reports that epoch again)."""
    if not self.writer or not self.metrics.exists():
      return
    kept = []
    for line in self.metrics.read_text().splitlines():
      rec = json.loads(line)
      if rec.get("event") == "config" or (rec.get("step", 0) <= last_step and not rec.get("end_of_run")):
        kept.append(line)
    _atomic_write_text(self.metrics, "".join(l + "\n" for l in kept))

  def log(self, record: dict):
    if not self.writer:
      return
    with open(self.metrics, "a") as f:
      f.write(json.dumps(record) + "\n")


def _atomic_write_text(path: pathlib.Path, text: str):
  atomic_write(path, lambda f: f.write(text))


def save_adapter_atomic(model, target: pathlib.Path, base_name: str):
  tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
  shutil.rmtree(tmp, ignore_errors=True)
  lora_lib.save_adapter(model, str(tmp), base_model_name_or_path=base_name)
  old = target.with_name(f".{target.name}.old{os.getpid()}")
  if target.exists():
    os.replace(target, old)
  os.replace(tmp, target)
  shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------- the run
@dataclasses.dataclass
class RunResult:
  output_dir: str
  steps: int
  final_loss: float | None
  val_loss: float | None
  first_val_loss: float | None
  compiles_warmup: int
  recompiles: int
  stopped_early: bool
  diagnosis: Any = None
  evaluation: dict | None = None


def train(cfg: config_lib.TrainConfig) -> RunResult:
  t_start = time.time()
  sharding_lib.maybe_initialize_distributed()  # several processes: before anything touches a device
  if cfg.compile_cache and not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    jax.config.update("jax_compilation_cache_dir", str(pathlib.Path(cfg.compile_cache).expanduser()))
  counter = compile_counter()
  files = RunFiles(cfg.output_dir, writer=sharding_lib.is_main_process())
  if not cfg.resume and (files.checkpoints.exists() or files.metrics.exists()):
    raise config_lib.ConfigError(
        f"{files.dir} already holds a run (metrics.jsonl or checkpoints/). Pass --resume to continue it, "
        f"or choose another --output-dir.")

  # Mesh first: a mesh that doesn't fit the devices fails before anything loads or compiles.
  mesh_ctx = sharding_lib.make_mesh_context(cfg.mesh)
  sharding_lib.check_batch_sizes(cfg, mesh_ctx)
  sharding_lib.barrier("jaxsft: output dir checked")  # no process writes before all have looked

  # Data: records → held-out split; the tokenizer comes with the model.
  log.info("loading data")
  train_records, val_records = load_data(cfg)
  # Records (a list subclass) lets the pipeline cache each split's tokenization across calls.
  train_records, val_records = data_lib.Records(train_records), data_lib.Records(val_records)
  log.info("loading model %s (%s)", cfg.model.name, cfg.model.dtype)
  model, tokenizer = models.load_model(cfg.model.name, dtype=cfg.model.dtype,
                                     remat="full" if cfg.model.remat else None)
  lora_lib.apply_lora(model, r=cfg.lora.r, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout,
                      target_modules=cfg.lora.target_modules, rslora=cfg.lora.rslora, seed=cfg.seed)
  graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
  n_lora = sum(x.size for x in jax.tree.leaves(lora))
  n_all = n_lora + sum(x.size for x in jax.tree.leaves(frozen))
  log.info("trainable LoRA params: %d of %d (%.3f%%)", n_lora, n_all, 100 * n_lora / max(n_all, 1))

  kw = pipeline_kwargs(cfg, batch_multiple_of=mesh_ctx.batch_multiple_of)
  stats = data_lib.PipelineStats()
  if kw["batching"] == "bucketed" and kw["bucket_lengths"] is None:
    # One set of boundaries for train and validation (the eval step reuses the train shapes); the
    # largest is the longest example, so no bucket is compiled that no batch would use.
    examples, _ = data_lib.tokenized(data_lib.Records(train_records + val_records), tokenizer,
                                     max_length=cfg.data.max_length, train_on=cfg.data.train_on)
    lengths = [len(e["input_ids"]) for e in examples if e is not None]
    kw["max_length"] = min(cfg.data.max_length, data_lib.round_up(max(lengths), cfg.data.pad_to_multiple_of))
    kw["bucket_lengths"] = data_lib.choose_buckets(lengths, cfg.data.num_buckets, multiple_of=cfg.data.pad_to_multiple_of,
                                                   max_length=kw["max_length"])
  train_ds = lambda num_epochs: data_lib.make_batches(
      train_records, tokenizer, seed=cfg.data.seed, shuffle=True, num_epochs=num_epochs,
      worker_count=cfg.data.worker_count, shard_by_process=jax.process_count() > 1, stats=stats, **kw)
  val_ds = lambda: data_lib.make_batches(val_records, tokenizer, seed=0, shuffle=False, num_epochs=1,
                                        shard_by_process=jax.process_count() > 1, **kw)
  shapes = sorted(set(data_lib.batch_shapes(train_records, tokenizer, **kw)) | set(data_lib.batch_shapes(val_records, tokenizer, **kw)))
  batches_per_epoch = sum(1 for _ in data_lib.make_batches(train_records, tokenizer, seed=cfg.data.seed, shuffle=True,
                                                            num_epochs=1, **kw))
  steps_per_epoch = max(batches_per_epoch // cfg.optim.grad_accum, 1)
  total_steps = steps_per_epoch * cfg.epochs
  if cfg.max_steps is not None:
    total_steps = min(total_steps, cfg.max_steps) if cfg.max_steps > 0 else total_steps
  log.info("batch shapes %s; %d batches per epoch, %d optimizer steps", shapes, batches_per_epoch, total_steps)

  files.dir.mkdir(parents=True, exist_ok=True)  # only now: bad config, data or model wrote nothing
  schedule = make_schedule(cfg.optim, total_steps)
  tx = make_optimizer(cfg.optim, schedule)
  lora = mesh_ctx.replicate(lora)
  frozen = mesh_ctx.shard_frozen(frozen)
  opt_state = jax.jit(tx.init, out_shardings=mesh_ctx.replicated)(lora)  # follows the replicated LoRA params
  steps = CompiledSteps(make_step_fns(graphdef, cfg, tx, schedule), lora, opt_state, frozen, mesh_ctx)

  # Warm-up: every shape the pipeline can emit, before step 1.
  keys = BATCH_KEYS if cfg.data.batching == "packed" else ("input_ids", "attention_mask", "labels")
  compiles0, secs0 = counter.count, counter.seconds
  t0 = time.time()
  steps.warm_up(shapes, keys, with_eval=bool(val_records))
  warmup_compiles, warmup_secs = counter.count - compiles0, time.time() - t0
  log.info("warm-up: %d compiles in %.1fs (XLA %.1fs) for %d shapes", warmup_compiles, warmup_secs,
           counter.seconds - secs0, len(shapes))

  # Resume: LoRA params, optimizer state, step, data position and running sums.
  import orbax.checkpoint as ocp
  import grain

  manager = ocp.CheckpointManager(
      files.checkpoints.resolve(),
      options=ocp.CheckpointManagerOptions(max_to_keep=cfg.keep_checkpoints, create=True),
  )
  step = 0
  data_state = None
  meta: dict[str, Any] = {"epoch_nll": 0.0, "epoch_valid": 0, "epoch": 0, "best_val": None, "bad_evals": 0,
                          "nonfinite_in_row": 0, "first_val_loss": None}
  if cfg.resume and manager.latest_step() is not None:
    step = manager.latest_step()
    holder = _IteratorState()
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore({"lora": lora, "opt_state": opt_state}),
        data_iter=grain.checkpoint.CheckpointRestore(holder),
        meta=ocp.args.JsonRestore(),
    ))
    lora, opt_state = restored["state"]["lora"], restored["state"]["opt_state"]
    meta.update(restored["meta"])
    data_state = holder.state
    files.truncate_metrics(step)
    log.info("resumed from step %d", step)
  else:
    if cfg.resume:
      log.info("--resume: no checkpoint in %s, starting fresh", files.checkpoints)
    files.log({"event": "config", "steps_per_epoch": steps_per_epoch, "total_steps": total_steps,
               "batch_shapes": shapes, "bucket_lengths": kw["bucket_lengths"], "warmup_compiles": warmup_compiles,
               "warmup_seconds": round(warmup_secs, 2), "lora_params": n_lora})
  files.write_json("config.json", config_lib.to_dict(cfg))
  files.write_json("heldout.json", val_records)

  iterator = iter(train_ds(None if cfg.max_steps else cfg.epochs))
  if data_state is not None:
    iterator.set_state(data_state)
  batches = DevicePrefetch(iterator, mesh_ctx.put_batch)

  def run_validation() -> float | None:
    if not val_records:
      return None
    nll, n = 0.0, 0
    for batch in val_ds():
      b = mesh_ctx.put_batch({k: batch[k] for k in BATCH_KEYS if k in batch})
      s, c = steps.evaluate(lora, frozen, b)
      nll, n = nll + float(s), n + int(c)
    return nll / max(n, 1)

  def save_checkpoint(at_step: int, state_after: Any):
    manager.save(at_step, args=ocp.args.Composite(
        state=ocp.args.StandardSave({"lora": lora, "opt_state": opt_state}),
        data_iter=grain.checkpoint.CheckpointSave(_IteratorState(state_after)),
        meta=ocp.args.JsonSave(meta),
    ))
    if files.writer:  # LoRA params are replicated: process 0 holds all of them
      save_adapter_atomic(nnx.merge(graphdef, lora, frozen), files.adapter, cfg.model.name)

  if step == 0 and val_records and cfg.eval.eval_every:
    # The base model's held-out loss: the point every later validation is compared with.
    meta["first_val_loss"] = meta["best_val"] = run_validation()
    files.log({"step": 0, "val_loss": meta["first_val_loss"]})
    log.info("validation loss before training: %.4f", meta["first_val_loss"])
  progress = _progress(total_steps, step, cfg.progress)
  last_loss = val_loss = None
  stopped_early = False
  last_state = data_state
  micro_index = step * cfg.optim.grad_accum
  warned_recompiles = 0
  try:
    while step < total_steps:
      t_step = time.time()
      acc = steps.zeros(lora)
      wait = 0.0
      tokens = real = valid = 0
      epochs_seen = []
      for _ in range(cfg.optim.grad_accum):
        t_wait = time.time()
        try:
          batch, host, last_state = next(batches)
        except StopIteration:
          break
        wait += time.time() - t_wait
        acc = steps.accumulate(acc, lora, frozen, batch, np.int32(micro_index))
        micro_index += 1
        tokens += host["shape"][0] * host["shape"][1]
        real += host["real_tokens"]
        valid += host["valid_tokens"]
        epochs_seen.append(int(host.get("epoch", 0)))
      if valid == 0 and not epochs_seen:
        break  # data exhausted
      lora, opt_state, out = steps.apply(lora, opt_state, acc, np.int32(step))
      if jax.process_count() > 1:  # each process counted its own rows
        tokens, real, valid = (int(x) for x in sharding_lib.sum_over_processes([tokens, real, valid]))
      loss, grad_norm, finite = float(out["loss"]), float(out["grad_norm"]), bool(out["finite"])
      step += 1
      seconds = time.time() - t_step
      record = {
          "step": step, "loss": loss, "lr": float(out["lr"]), "grad_norm": grad_norm,
          "tokens": tokens, "real_tokens": real, "valid_tokens": valid,
          "padding_fraction": round(1 - real / max(tokens, 1), 4),
          "tokens_per_s": round(real / seconds, 1), "valid_tokens_per_s": round(valid / seconds, 1),
          "compiles": steps.recompiles, "data_wait_s": round(wait, 4),
          "seconds": round(seconds, 4), "elapsed_s": round(time.time() - t_start, 2), "epoch": epochs_seen[-1],
      }
      if not finite:
        meta["nonfinite_in_row"] += 1
        record["skipped"] = True
        log.warning("step %d: non-finite loss or gradient (loss=%s, grad_norm=%s): update skipped", step, loss, grad_norm)
        if meta["nonfinite_in_row"] >= cfg.max_nonfinite_steps:
          files.log(record)
          raise TrainingError(
              f"{meta['nonfinite_in_row']} consecutive steps with a non-finite loss or gradient (step {step}); "
              f"stopping. Lower the learning rate or check the data. The last good checkpoint and adapter are kept.")
      else:
        meta["nonfinite_in_row"] = 0
        # Epoch averages with the same normalization: Σ nll / Σ valid over the epoch's steps.
        if epochs_seen[-1] != meta["epoch"] and meta["epoch_valid"]:
          # Logged with this step (the first of the new epoch): a resume that redoes this step
          # drops the line with the step's other metrics and logs it again.
          files.log({"step": step, "epoch": meta["epoch"], "epoch_loss": meta["epoch_nll"] / meta["epoch_valid"]})
          meta.update(epoch=epochs_seen[-1], epoch_nll=0.0, epoch_valid=0)
        meta["epoch_nll"] += loss * valid
        meta["epoch_valid"] += valid
        last_loss = loss
      if steps.recompiles > warned_recompiles:
        warned_recompiles = steps.recompiles
        log.warning("step %d: the train step compiled again after warm-up (%d in all; unexpected: %s)",
                    step, steps.recompiles, steps.unexpected_shapes[-3:])
      evaluate_now = (cfg.eval.eval_every and step % cfg.eval.eval_every == 0) or step == total_steps
      if evaluate_now:
        val_loss = run_validation()
        if val_loss is not None:
          record["val_loss"] = val_loss
          if meta["first_val_loss"] is None:
            meta["first_val_loss"] = val_loss
          if meta["best_val"] is None or val_loss < meta["best_val"]:
            meta["best_val"], meta["bad_evals"] = val_loss, 0
          else:
            meta["bad_evals"] += 1
      files.log(record)
      progress.update(record)
      if cfg.save_every and step % cfg.save_every == 0 and step < total_steps:
        save_checkpoint(step, last_state)
      patience = cfg.eval.early_stopping_patience
      if evaluate_now and patience and meta["bad_evals"] >= patience:
        log.info("early stopping at step %d: no better validation loss in %d evaluations", step, patience)
        stopped_early = True
        break
    if meta["epoch_valid"]:
      # The run's last (possibly unfinished) epoch. Its sums stay in the checkpoint, so a resume
      # that continues the epoch reports its whole average; this line is then dropped (see
      # `truncate_metrics`).
      files.log({"step": step, "epoch": meta["epoch"], "epoch_loss": meta["epoch_nll"] / meta["epoch_valid"],
                 "end_of_run": True})
    save_checkpoint(step, last_state)
  finally:
    batches.close()
    progress.close()
    manager.wait_until_finished()
    manager.close()

  recompiles = steps.recompiles
  dropped = stats.summary() if hasattr(stats, "summary") else str(stats)
  result = RunResult(str(files.dir), step, last_loss, val_loss, meta["first_val_loss"], warmup_compiles, recompiles, stopped_early)
  if jax.process_count() > 1:
    # Process 0 finishes alone (plot, doctor, generation) on a local copy of the gathered weights.
    lora, frozen = sharding_lib.to_host((lora, frozen))
    if not files.writer:
      return result
  model = nnx.merge(graphdef, lora, frozen)
  _finish(cfg, files, result, model, tokenizer, val_records, dropped, time.time() - t_start)
  return result


def _finish(cfg, files: RunFiles, result: RunResult, model, tokenizer, val_records, dropped: str, seconds: float):
  """Loss curve, doctor, tuned-vs-base evaluation, summary."""
  from jaxsft import doctor, plot

  try:
    plot.plot_loss_curve(files.dir, files.dir / "loss_curve.png")
  except Exception as e:  # a plot must never cost the run
    log.warning("loss curve not plotted: %s", e)
  result.diagnosis = doctor.diagnose_run(files.dir)
  _atomic_write_text(files.dir / "doctor.txt", result.diagnosis.report() + "\n")
  if cfg.eval.generate and val_records:
    from jaxsft import evaluate

    result.evaluation = evaluate.compare_base_and_tuned(model, tokenizer, val_records, cfg)
    files.write_json("evaluation.json", result.evaluation)
  summary = {
      "steps": result.steps, "final_loss": result.final_loss, "first_val_loss": result.first_val_loss,
      "val_loss": result.val_loss, "warmup_compiles": result.compiles_warmup, "recompiles": result.recompiles,
      "stopped_early": result.stopped_early, "diagnosis": result.diagnosis.pattern, "data": dropped,
      "seconds": round(seconds, 1),
  }
  if result.evaluation:
    summary["task_score_base"] = result.evaluation["base"]["score"]
    summary["task_score_tuned"] = result.evaluation["tuned"]["score"]
    if "format_rate" in result.evaluation["tuned"]:
      summary["format_rate_base"] = result.evaluation["base"]["format_rate"]
      summary["format_rate_tuned"] = result.evaluation["tuned"]["format_rate"]
  files.write_json("summary.json", summary)
  print(_summary_text(files, summary, result), file=sys.stderr)


def _summary_text(files, summary, result) -> str:
  lines = [f"\n== jaxsft run finished: {files.dir} ==",
           f"steps {summary['steps']}, final train loss {summary['final_loss']}, "
           f"val loss {summary['first_val_loss']} → {summary['val_loss']}",
           f"compiles: {summary['warmup_compiles']} at warm-up, {summary['recompiles']} after",
           f"data: {summary['data']}"]
  if "task_score_base" in summary:
    lines.append(f"task score: base {summary['task_score_base']:.3f} → tuned {summary['task_score_tuned']:.3f}")
    if "format_rate_tuned" in summary:
      lines.append(f"answer format: base {summary['format_rate_base']:.3f} → tuned {summary['format_rate_tuned']:.3f}")
  lines.append(result.diagnosis.report())
  lines.append(f"adapter (PEFT format): {files.adapter}   curve: {files.dir / 'loss_curve.png'}   "
               f"wall time {summary['seconds']}s")
  return "\n".join(lines)


class _progress:
  """A tqdm bar with loss, tokens/s and ETA (plain log lines when stderr isn't a terminal)."""

  def __init__(self, total: int, initial: int, enabled: bool):
    self.bar = None
    if enabled:
      from tqdm import tqdm

      self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr)

  def update(self, record: dict):
    if self.bar is not None:
      post = {"loss": f"{record['loss']:.4f}", "tok/s": f"{record['tokens_per_s']:.0f}"}
      if "val_loss" in record:
        post["val"] = f"{record['val_loss']:.4f}"
      self.bar.set_postfix(post, refresh=False)
      self.bar.update(1)
    else:
      val = f" val_loss {record['val_loss']:.4f}" if "val_loss" in record else ""
      log.info("step %d loss %.4f%s (%.0f tokens/s)", record["step"], record["loss"], val, record["tokens_per_s"])

  def close(self):
    if self.bar is not None:
      self.bar.close()


def _log_to_stderr():
  """jaxsft's INFO lines on stderr, whatever absl or JAX did to the root logger."""
  logger = logging.getLogger("jaxsft")
  if not logger.handlers:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def main(argv: list[str] | None = None) -> int:
  _log_to_stderr()
  try:
    cfg = config_lib.parse_args(argv)
    train(cfg)
  except (config_lib.ConfigError, data_lib.DataError, sharding_lib.MeshError, FileNotFoundError, TrainingError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
