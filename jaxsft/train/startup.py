"""Everything before step 1: `setup` checks the run directory and the mesh, loads the data and the
model with its adapters, has the collation planned (`jaxsft.collation.plan`: the probes of the
step's cost for `auto`), compiles every shape in `warm_up` and returns the fixed `Run` with a fresh
`RunState`; `start_or_resume` then opens the trackers and restores the newest whole checkpoint
under --resume."""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import time
from typing import Any

import jax
from flax import nnx

from jaxsft import collation as collation_lib
from jaxsft import config as config_lib
from jaxsft import flops as flops_lib
from jaxsft import lora as lora_lib
from jaxsft import matmul as matmul_lib
from jaxsft import models
from jaxsft import quant
from jaxsft import sharding as sharding_lib
from jaxsft import step as step_lib
from jaxsft import tracking
from jaxsft.collation import account as account_lib
from jaxsft.collation import compiles as compiles_lib
from jaxsft.collation.probe import PADDED_KEYS, ProbeTarget
from jaxsft.models.decoder import with_layers_packed, with_layers_unpacked
from jaxsft.run_files import RunFiles
from jaxsft.train import finished
from jaxsft.train.checkpoints import Checkpoints
from jaxsft.train.data_plan import DataPlan, load_data, optimizer_steps, plan_data
from jaxsft.train.state import RunState

log = logging.getLogger("jaxsft.train")


@dataclasses.dataclass(frozen=True)
class Run:
  """What stays fixed once setup is done: the config, the run's files, the mesh, the data plan, the
  model's graph and frozen params, the compiled steps and what the warm-up made of them (the loop's
  state is `RunState`)."""

  cfg: config_lib.TrainConfig
  files: RunFiles
  mesh: sharding_lib.MeshContext
  tokenizer: Any
  data: DataPlan
  graphdef: Any
  frozen: Any  # its 16-bit layer stacks packed on a CPU, as the steps read them (`model` unpacks them)
  steps: step_lib.CompiledSteps
  total_steps: int
  steps_per_epoch: int
  checkpoints: Checkpoints
  t_start: float
  compiles_warmup: int
  config_line: dict  # metrics.jsonl's first line
  collation: account_lib.CollationAccount  # the collation's account at warm-up (summary.json's "collation")
  flop_count: flops_lib.StepFlops | None  # model FLOPs of a step, from its shapes
  peak_flops: float | None  # per device: the denominator of MFU (None: FLOP/s only)
  param_bytes: dict  # base_param_bytes, trainable_param_bytes
  trackers: tracking.Trackers = dataclasses.field(default_factory=lambda: tracking.Trackers({}))  # `start_or_resume` opens them

  def model(self, trainable):
    """The model of `trainable` beside the frozen base, with plain weights: what is saved,
    exported, evaluated and chatted with."""
    return nnx.merge(self.graphdef, trainable, with_layers_unpacked(self.frozen))


def param_paths(model) -> list[str]:
  """Dotted paths of the model's params (`trainable` is matched against these)."""
  return [".".join(map(str, path)) for path, value in nnx.iter_graph(model) if isinstance(value, nnx.Param)]


def trainable_filter(cfg: config_lib.TrainConfig):
  """The nnx filter of the trained params: LoRA factors, or (mode=full) every param whose
  dotted path `cfg.trainable` matches (all of them when it is None)."""
  if cfg.mode == "lora":
    return nnx.LoRAParam
  import re

  pattern = re.compile(cfg.trainable) if cfg.trainable else None  # `config.validate` refused a bad one

  def matches(path, value) -> bool:
    return isinstance(value, nnx.Param) and (pattern is None or bool(pattern.search(".".join(map(str, path)))))

  return matches


def setup(cfg: config_lib.TrainConfig) -> tuple[Run, RunState]:
  """Everything before step 1. Bad config, data, mesh or model raise before anything is written;
  a `--resume` of a run that has already finished raises `finished.AlreadyFinished`."""
  t_start = time.time()
  compile_start = compiles_lib.ledger().tally()  # every program of the run counts, the model load's too
  sharding_lib.maybe_initialize_distributed()  # several processes: before anything touches a device
  if cfg.compile_cache and not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    jax.config.update("jax_compilation_cache_dir", str(pathlib.Path(cfg.compile_cache).expanduser()))
  files = RunFiles(cfg.output_dir, writer=sharding_lib.is_main_process())
  files.lock()  # held until `train` ends: a second process on this run directory is refused
  try:
    done = finished.finished_summary(cfg, files)
    if done is not None:  # a --resume with nothing left to train: nothing loads or compiles
      raise finished.AlreadyFinished(files, done)
    return _setup(cfg, files, t_start, compile_start)
  except BaseException:
    files.unlock()
    raise


def load_model_to_train(cfg: config_lib.TrainConfig):
  """(model, tokenizer): the base as the config stores it, with LoRA applied in lora mode."""
  log.info("loading model %s (%s%s%s)", cfg.model.name, cfg.model.dtype,
           "" if cfg.model.quantize == "none" else f", base quantized {cfg.model.quantize}",
           "" if cfg.model.chat_template is None else f", chat template {cfg.model.chat_template}")
  model, tokenizer = models.load_model(cfg.model.name, dtype=cfg.model.dtype, remat=cfg.model.remat,
                                       quantize=cfg.model.quantize, quant_block_size=cfg.model.quant_block_size,
                                       quantize_embeddings=cfg.model.quantize_embeddings,
                                       chat_template=cfg.model.chat_template)
  note = matmul_lib.cpu_16bit_note(model.dtype)
  if note:
    log.warning("%s", note)
  if cfg.mode == "lora":
    lora_lib.apply_lora(model, r=cfg.lora.r, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout,
                        target_modules=cfg.lora.target_modules, rslora=cfg.lora.rslora,
                        use_dora=cfg.lora.use_dora, seed=cfg.seed)
  return model, tokenizer


def _setup(cfg: config_lib.TrainConfig, files: RunFiles, t_start: float,
           compile_start: compiles_lib.CompileTally) -> tuple[Run, RunState]:
  # The config's own checks ran before (`config.validate`); these need the disk, the devices, the model.
  if not cfg.resume and files.holds_a_run():
    raise config_lib.ConfigError(
        f"{files.dir} already holds a run (metrics.jsonl or checkpoints/). Pass --resume to continue it, "
        f"or choose another --output-dir.")
  # Mesh first: a mesh that doesn't fit the devices fails before anything loads or compiles.
  mesh = sharding_lib.make_mesh_context(cfg.mesh)
  sharding_lib.check_batch_sizes(cfg, mesh)
  sharding_lib.barrier("jaxsft: output dir checked")  # no process writes before all have looked

  log.info("loading data")
  train_records, val_records = load_data(cfg)
  model, tokenizer = load_model_to_train(cfg)
  flop_count = flops_lib.StepFlops.from_model(model, trainable_filter(cfg))
  # The trainable state: the LoRA factors, or the model's own params in full mode.
  graphdef, trainable, frozen = nnx.split(model, trainable_filter(cfg), ...)
  n_trainable = sum(x.size for x in jax.tree.leaves(trainable))
  n_all = n_trainable + quant.param_count(frozen)
  if n_trainable == 0:
    raise config_lib.ConfigError(f"trainable={cfg.trainable!r} matches no parameter; paths look like "
                                 f"{sorted(param_paths(model))[:6]}")
  log.info("trainable %s params: %d of %d (%.3f%%)", "LoRA" if cfg.mode == "lora" else "model", n_trainable, n_all,
           100 * n_trainable / max(n_all, 1))
  param_bytes = {"base_param_bytes": quant.tree_bytes(frozen), "trainable_param_bytes": quant.tree_bytes(trainable)}
  log.info("frozen base: %.1f MB as stored (quantize=%s); trainable: %.1f MB", param_bytes["base_param_bytes"] / 1e6,
           cfg.model.quantize, param_bytes["trainable_param_bytes"] / 1e6)
  trainable, frozen = mesh.replicate(trainable), mesh.shard_frozen(frozen)
  # Every step reads the whole frozen base: its 16-bit stacks are packed for the CPU's scan once,
  # here, not in each step (`jaxsft.models.stack16`).
  frozen = with_layers_packed(frozen)

  target = ProbeTarget(graphdef, trainable, frozen, mesh, with_eval=bool(val_records))
  data = plan_data(cfg, train_records, val_records, tokenizer, mesh.batch_multiple_of, target,
                   resumed=resumed_collation(files) if cfg.resume else None)
  steps_per_epoch = max(data.batches_per_epoch // cfg.optim.grad_accum, 1)
  total_steps = optimizer_steps(cfg, data.batches_per_epoch)
  log.info("batch shapes %s; %d batches per epoch, %d optimizer steps", data.shapes, data.batches_per_epoch, total_steps)

  files.dir.mkdir(parents=True, exist_ok=True)  # only now: bad config, data or model wrote nothing
  probes = data.collation.probes
  if probes:  # the probes' executables serve the run: its schedule is an input of them
    steps, opt_state = probes.steps, probes.opt_state
    steps.use_schedule(step_lib.make_schedule(cfg.optim, total_steps))
  else:
    steps, opt_state = step_lib.build_steps(cfg, graphdef, trainable, frozen, mesh, total_steps)
  checkpoints, peak_flops = Checkpoints(files, cfg.keep_checkpoints), resolve_peak_flops(cfg)
  compiles_warmup, collation, config_line = warm_up(cfg, data, steps, tokenizer, files, mesh, compile_start,
                                                    steps_per_epoch=steps_per_epoch, total_steps=total_steps,
                                                    n_trainable=n_trainable, flop_count=flop_count,
                                                    param_bytes=param_bytes)
  run = Run(cfg=cfg, files=files, mesh=mesh, tokenizer=tokenizer, data=data, graphdef=graphdef, frozen=frozen,
            steps=steps, total_steps=total_steps, steps_per_epoch=steps_per_epoch,
            checkpoints=checkpoints, t_start=t_start, compiles_warmup=compiles_warmup,
            config_line=config_line, collation=collation, flop_count=flop_count, peak_flops=peak_flops,
            param_bytes=param_bytes)
  return run, RunState(trainable=trainable, opt_state=opt_state)


def resumed_collation(files: RunFiles) -> dict | None:
  """The collation the run in `files.dir` started with (its metrics' config line), where a checkpoint
  is there to continue; None without one, or where the config line does not record it."""
  from jaxsft import run_files

  if not (files.checkpoint_steps() and files.metrics.exists()):
    return None
  config = next((r for r in run_files.read_records(files.metrics) if r.get("event") == "config"), {})
  return config.get("collation")


def resolve_peak_flops(cfg: config_lib.TrainConfig) -> float | None:
  """Peak FLOP/s of one device: the user's `logging.peak_flops`, else the table's for this
  device and compute dtype, else None (MFU is then not logged, FLOP/s are)."""
  from jaxsft.models.decoder import resolve_dtype

  if cfg.logging.peak_flops:
    return cfg.logging.peak_flops
  kind = jax.devices()[0].device_kind
  found = flops_lib.peak_flops(kind, str(resolve_dtype(cfg.model.dtype)))
  if found is None:
    log.info("no known peak FLOP/s for %r: logging achieved FLOP/s, no MFU (--peak-flops sets one)", kind)
    return None
  log.info("MFU against the %s peak, %.0f TFLOP/s per device", found[0], found[1] / 1e12)
  return found[1]


def warm_up(cfg: config_lib.TrainConfig, data: DataPlan, steps: step_lib.CompiledSteps, tokenizer, files: RunFiles,
            mesh: sharding_lib.MeshContext, compile_start: compiles_lib.CompileTally, *, steps_per_epoch: int,
            total_steps: int, n_trainable: int, flop_count, param_bytes: dict):
  """Compiles every shape the pipeline can emit, before step 1, and accounts the collation;
  returns (the warm-up's compiles, the collation's account, the config line)."""
  counter = step_lib.compile_counter()
  packed = data.batching["batching"] in ("packed", "bucketed_packed")
  keys = step_lib.BATCH_KEYS if packed else PADDED_KEYS
  compiles0, seconds0, t0 = counter.count, counter.seconds, time.time()
  before = compiles_lib.ledger().tally()
  log.info("warm-up: compiling the step for %d shapes before step 1", len(data.shapes))
  steps.warm_up(data.shapes, keys, with_eval=bool(data.val_records), fused=cfg.optim.grad_accum == 1)
  tally = compiles_lib.ledger().tally() - before
  compiles, seconds = counter.count - compiles0, time.time() - t0
  collation = account_lib.account(cfg, data.collation, data, steps, tokenizer, batch_multiple_of=mesh.batch_multiple_of,
                                  keys=keys, warm_up=tally, compile_start=compile_start, writer=files.writer)
  log.info("warm-up: %d compiles in %.1fs (XLA %.1fs) for %d shapes", compiles, seconds,
           counter.seconds - seconds0, len(data.shapes))
  config_line = {"event": "config", "steps_per_epoch": steps_per_epoch, "total_steps": total_steps,
                 "batch_shapes": data.shapes, "bucket_lengths": data.batching["bucket_lengths"],
                 "collation": collation_lib.resolved(data.batching),  # what a resumed run keeps
                 "warmup_compiles": compiles, "warmup_seconds": round(seconds, 2), "trainable_params": n_trainable,
                 # for the doctor: ln(vocab_size) is what a uniform guess scores
                 "vocab_size": flop_count.vocab_size if flop_count else None, **param_bytes}
  return compiles, collation, config_line


def start_or_resume(run: Run, fresh: RunState) -> tuple[Run, RunState, Any]:
  """(run with its trackers open, state, batch iterator): the state restored from the newest whole
  checkpoint with --resume, else fresh."""
  cfg = run.cfg
  num_epochs = None if cfg.max_steps else cfg.epochs

  def batches():
    return iter(run.data.train_batches(run.tokenizer, seed=cfg.data.seed, num_epochs=num_epochs,
                                       worker_count=cfg.data.worker_count))

  restored_iterator = []

  def restore_data_position(data_state):  # a data position that does not restore is damage too
    iterator = batches()
    if data_state is not None:
      iterator.set_state(data_state)
    restored_iterator[:] = [iterator]

  state = run.checkpoints.restore_newest(fresh, restore_data_position) if cfg.resume else None
  resumed_at = None if state is None else state.step
  if run.files.writer:
    run = dataclasses.replace(run, trackers=tracking.open_trackers(cfg.logging, run.files.dir, resumed_at=resumed_at,
                                                                   config=config_lib.to_dict(cfg)))
    run.files.sinks.append(run.trackers.log)
  if state is not None:
    run.files.truncate_metrics(state.step)
    if state.data_stats:  # the run's data counts go on from the checkpoint's, not from zero
      run.data.stats.restore(state.data_stats)
    log.info("resumed from step %d", state.step)
  else:
    if cfg.resume:
      log.info("--resume: no checkpoint in %s, starting fresh", run.files.checkpoints)
    state = fresh
    run.files.log(run.config_line)
    run.trackers.text("config", tracking.config_markdown(config_lib.to_dict(cfg)), 0)
  run.files.write_json(run.files.config, config_lib.to_dict(cfg))
  run.files.write_json(run.files.heldout, run.data.val_records)
  return run, state, restored_iterator[0] if state is not fresh else batches()
