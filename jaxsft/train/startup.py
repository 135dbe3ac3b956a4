"""Everything before step 1: `setup` checks the run directory and the mesh, loads the data and the
model with its adapters, plans the batches (probing the step's cost for `auto`), compiles every
shape in `warm_up` and returns the fixed `Run` with a fresh `RunState`; `start_or_resume` then
opens the trackers and restores the newest whole checkpoint under --resume."""

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
from jaxsft import compiles as compiles_lib
from jaxsft import config as config_lib
from jaxsft import data as data_lib
from jaxsft import flops as flops_lib
from jaxsft import lora as lora_lib
from jaxsft import models
from jaxsft import quant
from jaxsft import sharding as sharding_lib
from jaxsft import step as step_lib
from jaxsft import tracking
from jaxsft.models.hub import jaxsft_cache
from jaxsft.run_files import RunFiles
from jaxsft.train.checkpoints import Checkpoints
from jaxsft.train.data_plan import DataPlan, load_data, plan_data
from jaxsft.train.state import RunState

log = logging.getLogger("jaxsft.train")


@dataclasses.dataclass
class Run:
  """What stays fixed during a run (the loop's state is `RunState`)."""

  cfg: config_lib.TrainConfig
  files: RunFiles
  mesh: sharding_lib.MeshContext
  tokenizer: Any
  data: DataPlan
  graphdef: Any
  frozen: Any
  steps: step_lib.CompiledSteps
  total_steps: int
  steps_per_epoch: int
  checkpoints: Checkpoints
  t_start: float
  compiles_warmup: int = 0
  config_line: dict = dataclasses.field(default_factory=dict)  # metrics.jsonl's first line
  last_saved_step: int | None = None  # the newest checkpoint this process saved (not one it resumed from)
  probe_seconds: float = 0.0  # auto's probe compiles and timings, before the plan was chosen
  warmup_seconds: float = 0.0
  step_seconds: float = 0.0  # Σ of the steps' `seconds` this process ran
  collation: dict = dataclasses.field(default_factory=dict)  # summary.json's "collation"
  compile_start: compiles_lib.CompileTally = dataclasses.field(default_factory=compiles_lib.CompileTally)
  compile_phases: dict = dataclasses.field(default_factory=dict)  # probe, warm_up, generate: CompileTally each
  calibration: Any = None  # compiles_lib.Calibration of this machine, model and config
  calibration_path: Any = None
  probe_shapes: list = dataclasses.field(default_factory=list)  # the shapes auto's probes compiled
  probe_compile_seconds: dict = dataclasses.field(default_factory=dict)  # per probe shape, as the probe timed it
  probe_extra: str = ""  # and the rest of their programs' signature (`shape_signature_extra`)
  generation_signatures: list = dataclasses.field(default_factory=list)  # `generation_programs`, found once
  flop_count: flops_lib.StepFlops | None = None  # model FLOPs of a step, from its shapes
  peak_flops: float | None = None  # per device: the denominator of MFU (None: FLOP/s only)
  trackers: tracking.Trackers = dataclasses.field(default_factory=lambda: tracking.Trackers({}))
  param_bytes: dict = dataclasses.field(default_factory=dict)  # base_param_bytes, trainable_param_bytes


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
  """Everything before step 1. Bad config, data, mesh or model raise before anything is written."""
  t_start = time.time()
  compile_start = compiles_lib.ledger().tally()  # every program of the run counts, the model load's too
  sharding_lib.maybe_initialize_distributed()  # several processes: before anything touches a device
  if cfg.compile_cache and not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    jax.config.update("jax_compilation_cache_dir", str(pathlib.Path(cfg.compile_cache).expanduser()))
  files = RunFiles(cfg.output_dir, writer=sharding_lib.is_main_process())
  files.lock()  # held until `train` ends: a second process on this run directory is refused
  try:
    return _setup(cfg, files, t_start, compile_start)
  except BaseException:
    files.unlock()
    raise


def load_model_to_train(cfg: config_lib.TrainConfig):
  """(model, tokenizer): the base as the config stores it, with LoRA applied in lora mode."""
  log.info("loading model %s (%s%s)", cfg.model.name, cfg.model.dtype,
           "" if cfg.model.quantize == "none" else f", base quantized {cfg.model.quantize}")
  model, tokenizer = models.load_model(cfg.model.name, dtype=cfg.model.dtype, remat=cfg.model.remat,
                                       quantize=cfg.model.quantize, quant_block_size=cfg.model.quant_block_size,
                                       quantize_embeddings=cfg.model.quantize_embeddings)
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

  calibration, calibration_path = load_calibration(cfg)
  probes = []  # (steps, opt_state, cost, seconds, compile tally) when auto probed the step's cost
  data = plan_data(cfg, train_records, val_records, tokenizer, mesh.batch_multiple_of,
                   cost_for=lambda longest: probe_step_cost(cfg, graphdef, trainable, frozen, mesh, bool(val_records),
                                                            longest, probes, calibration))
  steps_per_epoch = max(data.batches_per_epoch // cfg.optim.grad_accum, 1)
  # max_steps (like Hugging Face's) overrides epochs: the data repeats for as long as it takes.
  total_steps = cfg.max_steps if cfg.max_steps else steps_per_epoch * cfg.epochs
  log.info("batch shapes %s; %d batches per epoch, %d optimizer steps", data.shapes, data.batches_per_epoch, total_steps)

  files.dir.mkdir(parents=True, exist_ok=True)  # only now: bad config, data or model wrote nothing
  if probes:  # the probes' executables serve the run: its schedule is an input of them
    steps, opt_state = probes[0][0], probes[0][1]
    steps.use_schedule(step_lib.make_schedule(cfg.optim, total_steps))
  else:
    steps, opt_state = build_steps(cfg, graphdef, trainable, frozen, mesh, total_steps)
  run = Run(cfg, files, mesh, tokenizer, data, graphdef, frozen, steps, total_steps, steps_per_epoch,
            Checkpoints(files, cfg.keep_checkpoints), t_start, probe_seconds=probes[0][3] if probes else 0.0,
            flop_count=flop_count, peak_flops=resolve_peak_flops(cfg), param_bytes=param_bytes,
            compile_start=compile_start, calibration=calibration, calibration_path=calibration_path)
  if probes:
    keep_probe_compiles(run, probes[0])
  warm_up(run, n_trainable)
  return run, RunState(trainable=trainable, opt_state=opt_state)


def build_steps(cfg: config_lib.TrainConfig, graphdef, trainable, frozen, mesh, total_steps: int):
  """(CompiledSteps, initial optimizer state) for a run of `total_steps` (the schedule's length)."""
  schedule = step_lib.make_schedule(cfg.optim, total_steps)
  tx = step_lib.make_optimizer(cfg.optim, schedule)
  opt_state = jax.jit(tx.init, out_shardings=mesh.replicated)(trainable)  # follows the replicated trainable params
  return step_lib.CompiledSteps(step_lib.make_step_functions(graphdef, cfg), trainable, opt_state, frozen, mesh,
                                schedule), opt_state


def load_calibration(cfg: config_lib.TrainConfig):
  """(this machine's compile calibration for the run's programs, its file)."""
  path = compiles_lib.Calibration.path(jaxsft_cache(), compiles_lib.calibration_key(
      compiles_lib.machine_description(), program_config(cfg)))
  return compiles_lib.Calibration.load(path), path


def keep_probe_compiles(run: Run, probe: tuple) -> None:
  """What auto's probes compiled (their tally, per-shape seconds and program signature), for the
  compile forecast and the calibration."""
  run.compile_phases["probe"] = probe[4]
  run.probe_compile_seconds, run.probe_extra = probe[5], probe[6]
  run.probe_shapes = sorted(run.probe_compile_seconds)


def program_config(cfg: config_lib.TrainConfig) -> dict:
  """The config that shapes the compiled programs (with the batch shape and keys): the model, its
  dtype and quantization, the adapters, the optimizer, what trains and the mesh."""
  return {"model": dataclasses.asdict(cfg.model), "lora": dataclasses.asdict(cfg.lora) if cfg.mode == "lora" else None,
          "optim": dataclasses.asdict(cfg.optim), "mode": cfg.mode, "trainable": cfg.trainable,
          "mesh": dataclasses.asdict(cfg.mesh)}


def with_cold_compiles(cost, calibration: compiles_lib.Calibration, tally: compiles_lib.CompileTally):
  """The cost `auto` chooses with: compiles priced cold. Where the probes found their programs in
  the persistent cache their seconds are cache reads, not compiles: this machine's cold fit replaces
  them (when it has one), so a warm run chooses what a cold one does (and then finds it cached)."""
  cold = compiles_lib.fit_linear_in_width(calibration.cold)
  if tally.cache_hits == 0 or cold is None:
    return cost
  return dataclasses.replace(cost, compile_base=cold[0], compile_per_width=cold[1], compile_ratios=())


def probe_step_cost(cfg: config_lib.TrainConfig, graphdef, trainable, frozen, mesh, with_eval: bool, longest: int,
                    out: list, calibration: compiles_lib.Calibration | None = None):
  """With `batching: auto` or `num_buckets: auto`: compiles and times three probe shapes (a quarter,
  half and all of `longest`) and fits the step's cost, before the plan is chosen. Appends (steps,
  opt_state, cost, seconds) to `out` and returns the cost; None (nothing probed) when no choice
  needs seconds. The probes' executables then serve the run (its schedule is set once known).
  """
  d = cfg.data
  if not chosen_on_timings(d):
    return None
  t0 = time.time()
  size_for = collation_lib.batch_size_rule(d, mesh.batch_multiple_of)
  steps, opt_state = build_steps(cfg, graphdef, trainable, frozen, mesh, cfg.max_steps or 1)
  shapes = [(size_for(t), t) for t in collation_lib.probe_widths(longest, d.pad_to_multiple_of)]
  # Compiled for the inputs the run will feed them when it can tell (auto may still pick packing:
  # then its one width compiles again, with segment ids).
  keys = step_lib.BATCH_KEYS if d.batching == "bucketed_packed" else ("input_ids", "attention_mask", "labels")
  before = compiles_lib.ledger().tally()
  steps.warm_up(shapes, keys, with_eval=with_eval, fused=cfg.optim.grad_accum == 1)
  tally = compiles_lib.ledger().tally() - before
  cost = collation_lib.fit_from_steps(steps, shapes, keys, fused=cfg.optim.grad_accum == 1)
  cost = with_cold_compiles(cost, calibration or compiles_lib.Calibration(), tally)
  log.info("collation probes %s: step %.3g + %.3g·B·T + %.3g·B·T² s, compile %.3g + %.3g·T s (%.1fs)", shapes,
           cost.a, cost.b, cost.c, cost.compile_base, cost.compile_per_width, time.time() - t0)
  extra = shape_signature_extra(keys, cfg.optim.grad_accum == 1, with_eval)
  out.append((steps, opt_state, cost, time.time() - t0, tally, dict(steps.compile_seconds), extra))
  return cost


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


def warm_up(run: Run, n_trainable: int) -> None:
  """Compiles every shape the pipeline can emit, before step 1, and logs the config line."""
  counter = step_lib.compile_counter()
  packed = run.data.batching["batching"] in ("packed", "bucketed_packed")
  keys = step_lib.BATCH_KEYS if packed else ("input_ids", "attention_mask", "labels")
  compiles0, seconds0, t0 = counter.count, counter.seconds, time.time()
  before = compiles_lib.ledger().tally()
  run.steps.warm_up(run.data.shapes, keys, with_eval=bool(run.data.val_records), fused=run.cfg.optim.grad_accum == 1)
  run.compile_phases["warm_up"] = compiles_lib.ledger().tally() - before
  run.compiles_warmup, seconds = counter.count - compiles0, time.time() - t0
  run.warmup_seconds = seconds
  account_collation(run, keys)
  log.info("warm-up: %d compiles in %.1fs (XLA %.1fs) for %d shapes", run.compiles_warmup, seconds,
           counter.seconds - seconds0, len(run.data.shapes))
  run.config_line = {"event": "config", "steps_per_epoch": run.steps_per_epoch, "total_steps": run.total_steps,
                     "batch_shapes": run.data.shapes, "bucket_lengths": run.data.batching["bucket_lengths"],
                     "warmup_compiles": run.compiles_warmup, "warmup_seconds": round(seconds, 2), "trainable_params": n_trainable,
                     # for the doctor: ln(vocab_size) is what a uniform guess scores
                     "vocab_size": run.flop_count.vocab_size if run.flop_count else None, **run.param_bytes}


def chosen_on_timings(d: config_lib.DataConfig) -> bool:
  """Whether the plan was chosen on the step's own timings (the probes): then they are fitted whatever
  `time_shapes` says, since the choice already paid for them."""
  return d.batching == "auto" or d.num_buckets == "auto"


def account_collation(run: Run, keys: tuple[str, ...]) -> None:
  """Times one call of the compiled shapes, fits the cost, and keeps the plan's predicted seconds
  (over the planned steps) for summary.json; logs the choice (auto: with its runners-up)."""
  cfg, data = run.cfg, run.data
  size_for = collation_lib.batch_size_rule(cfg.data, run.mesh.batch_multiple_of)
  if jax.process_count() > 1:  # timing copies the state; across processes it is not addressable here
    cost = data_lib.cost.DEFAULT_COST
  elif not (cfg.data.time_shapes or chosen_on_timings(cfg.data)):
    cost = data_lib.cost.DEFAULT_COST
  else:
    cost = collation_lib.fit_from_steps(run.steps, data.shapes, keys, fused=cfg.optim.grad_accum == 1)
  epochs = data_lib.cost.epochs_planned(data.batches_per_epoch, epochs=cfg.epochs, max_steps=cfg.max_steps,
                                        grad_accum=cfg.optim.grad_accum)
  predicted = collation_lib.predicted(cost, data.batching, data.train_lengths, data.shapes, batch_size_for=size_for, epochs=epochs,
                                      trained=collation_lib.trained_tokens(data.train_tokens))
  forecast, compile_prices = forecast_compiles(run, keys, cost)
  predicted = data_lib.cost.PlanSeconds(predicted.steps, forecast.seconds)
  choice = data.collation
  run.collation = {"choice": choice.name if choice else data.batching["batching"],
                   "batching": {k: data.batching[k] for k in ("batching", "bucket_lengths", "max_length")},
                   "predicted_seconds": predicted.to_dict(), "cost": cost.to_dict(), "epochs": round(epochs, 4),
                   "compiles_predicted": {**forecast.to_dict(), "prices": compile_prices.source}}
  if choice is not None:
    collation_lib.log_choice(choice)
    if choice.candidates:
      run.collation["chosen_with"] = choice.cost.to_dict()
      run.collation["candidates"] = [c.summary() for c in choice.candidates]
  log.info("collation %s: predicted %.1fs of steps, %.1fs of compiles (cost fitted to %s)", run.collation["choice"],
           predicted.steps, predicted.compiles, cost.source)


def cache_folder() -> str | None:
  """The persistent compilation cache's folder, None where the cache is off."""
  folder = jax.config.jax_compilation_cache_dir
  return str(folder) if folder and jax.config.jax_enable_compilation_cache else None


def written_to_cache(compile_seconds: float) -> bool:
  """Whether JAX writes a program that took `compile_seconds` to the persistent cache: only those
  that took at least `jax_persistent_cache_min_compile_time_secs` (1 s by default)."""
  return compile_seconds >= float(jax.config.jax_persistent_cache_min_compile_time_secs)


def shape_signature_extra(keys: tuple[str, ...], fused: bool, with_eval: bool) -> str:
  return f"{'+'.join(keys)}:{'fused' if fused else 'accumulate'}:{'eval' if with_eval else 'train'}"


def generation_programs(run: Run) -> list[str]:
  """Signatures of the programs the tuned-vs-base evaluation compiles: one per padded prompt width
  (base and tuned share them: the same graph, the LoRA zeroed); none where it does not run."""
  cfg = run.cfg
  if not (cfg.eval.generate and run.data.val_records):
    return []
  from jaxsft import evaluate
  from jaxsft.generate import encode_prompt

  records = list(run.data.val_records)[: cfg.eval.num_prompts]
  lengths = [len(encode_prompt(run.tokenizer, evaluate.prompt_messages(r))) for r in records]
  widths = compiles_lib.generation_widths(lengths, batch_size=8, prompt_multiple=128)
  return [compiles_lib.signature("generate", (8, w), f"new:{cfg.eval.max_new_tokens}") for w in widths]


def compiled_by_phase(run: Run, extra: str) -> dict:
  """{phase: {shape: compile seconds}}: what the probes compiled, and what the warm-up compiled (the
  plan's shapes the probes did not compile for the same program: auto choosing packing compiles its
  width again, with segment ids)."""
  probe_programs = set(run.probe_compile_seconds) if run.probe_extra == extra else set()
  warm_up = {tuple(s): run.steps.compile_seconds[tuple(s)] for s in run.data.shapes
             if tuple(s) not in probe_programs and tuple(s) in run.steps.compile_seconds}
  return {"probe": dict(run.probe_compile_seconds), "warm_up": warm_up}


def learn_from_compiles(run: Run, extra: str, phases: tuple[str, ...]) -> None:
  """Adds this run's `phases` (probe, warm_up) to the calibration: a phase's per-shape seconds are
  cold samples where it found nothing in the persistent cache, warm ones where it found everything;
  the programs are remembered as cached in the cache folder (where one is used)."""
  cal = run.calibration
  folder = cache_folder()
  for phase, shapes in compiled_by_phase(run, extra).items():
    if phase not in phases:
      continue
    tally = run.compile_phases.get(phase)
    samples = [[s[0], s[1], seconds] for s, seconds in shapes.items()]
    if tally is None or not samples:
      continue
    if tally.cache_state == "cold":
      cal.cold = compiles_lib.merge_samples(cal.cold, samples)
      if tally.seconds > 0:
        cal.front_share = tally.front_seconds / tally.seconds
    elif tally.cache_state == "warm":
      cal.warm = compiles_lib.merge_samples(cal.warm, samples)
    if folder:
      phase_extra = run.probe_extra if phase == "probe" else extra
      written = {compiles_lib.signature("train", s, phase_extra) for s, seconds in shapes.items()
                 if tally.cache_state == "warm" or written_to_cache(seconds / 2)}  # train step and evaluation
      cal.cached[folder] = sorted(set(cal.cached.get(folder, [])) | written)


def forecast_compiles(run: Run, keys: tuple[str, ...], cost) -> tuple:
  """(CompileForecast, CompilePrices): every program the run compiles, priced cold or warm from
  this machine's calibration (its earlier runs and this run's probes: what auto knew when it chose,
  not the warm-up's own compiles), where it was cached before this run. The calibration is then
  saved with the warm-up's samples too."""
  cal = run.calibration
  extra = shape_signature_extra(keys, run.cfg.optim.grad_accum == 1, bool(run.data.val_records))
  folder = cache_folder()
  cached_before = set(cal.cached.get(folder, [])) if folder else set()
  learn_from_compiles(run, extra, ("probe",))
  compile_prices = compiles_lib.prices(cal, (cost.compile_base, cost.compile_per_width))
  programs = [(tuple(s), run.probe_extra) for s in run.probe_shapes] + [(tuple(s), extra) for s in run.data.shapes]
  run.generation_signatures = generation_programs(run)  # the prompts are tokenized once, here
  forecast = compiles_lib.predict_compiles(compile_prices, programs, with_eval=bool(run.data.val_records),
                                           generation_programs=run.generation_signatures, cached=cached_before,
                                           cache_enabled=folder is not None)
  learn_from_compiles(run, extra, ("warm_up",))
  save_calibration(run)
  return forecast, compile_prices


def save_calibration(run: Run) -> None:
  if run.files.writer and run.calibration_path is not None:
    try:
      run.calibration.save(run.calibration_path)
    except OSError as e:  # the calibration only improves later predictions: never cost the run
      log.warning("compile calibration not saved to %s: %s", run.calibration_path, e)


def start_or_resume(run: Run, fresh: RunState):
  """(state, batch iterator): restored from the newest whole checkpoint with --resume, else fresh."""
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
    run.trackers = tracking.open_trackers(cfg.logging, run.files.dir, resumed_at=resumed_at, config=config_lib.to_dict(cfg))
    run.files.sinks.append(run.trackers.log)
  if state is not None:
    run.files.truncate_metrics(state.step)
    if state.data_stats:  # the run's data counts go on from the checkpoint's, not from zero
      for name, value in state.data_stats.items():
        if name == "dropped_per_epoch":
          value = {int(epoch): count for epoch, count in value.items()}
        setattr(run.data.stats, name, value)
    log.info("resumed from step %d", state.step)
  else:
    if cfg.resume:
      log.info("--resume: no checkpoint in %s, starting fresh", run.files.checkpoints)
    state = fresh
    run.files.log(run.config_line)
    run.trackers.text("config", tracking.config_markdown(config_lib.to_dict(cfg)), 0)
  run.files.write_json(run.files.config, config_lib.to_dict(cfg))
  run.files.write_json(run.files.heldout, run.data.val_records)
  return state, restored_iterator[0] if state is not fresh else batches()
