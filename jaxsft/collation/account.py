"""The run's account of its collation, made once every shape is compiled (`account`): the cost
fitted to the compiled shapes' timings, the plan's predicted seconds over the planned steps, the
compile forecast of every program the run compiles, and this machine's calibration with the probes'
and warm-up's compiles learned (and saved). `summary.py` adds what the run then measured."""

from __future__ import annotations

import dataclasses
import logging
import pathlib

import jax

from jaxsft import config as config_lib
from jaxsft.collation import choice as choice_lib
from jaxsft.collation import compiles as compiles_lib
from jaxsft.collation import cost as cost_lib
from jaxsft.collation import probe as probe_lib
from jaxsft.collation.planner import Collation

log = logging.getLogger("jaxsft.train")  # the trainer's log: these lines are part of its setup


@dataclasses.dataclass(frozen=True)
class CollationAccount:
  """What a run knows of its collation after warm-up: `record`, summary.json's "collation" as
  predicted (`summary.summary` adds the measured seconds, cache and compiles); `compiles_predicted`,
  the compile forecast; `phases`, the compile tallies of the probes (where auto probed) and the
  warm-up; `generation_signatures`, the evaluation's generation programs; the calibration (with
  this run's probes and warm-up learned) and its file; `compile_start`, the ledger's tally when
  the run began (every program of the run counts, the model load's too)."""

  record: dict
  compiles_predicted: dict
  phases: dict
  generation_signatures: tuple[str, ...]
  calibration: compiles_lib.Calibration
  calibration_path: pathlib.Path | None
  compile_start: compiles_lib.CompileTally


def cache_folder() -> str | None:
  """The persistent compilation cache's folder, None where the cache is off."""
  folder = jax.config.jax_compilation_cache_dir
  return str(folder) if folder and jax.config.jax_enable_compilation_cache else None


def written_to_cache(compile_seconds: float) -> bool:
  """Whether JAX writes a program that took `compile_seconds` to the persistent cache: only those
  that took at least `jax_persistent_cache_min_compile_time_secs` (1 s by default)."""
  return compile_seconds >= float(jax.config.jax_persistent_cache_min_compile_time_secs)


def generation_programs(cfg: config_lib.TrainConfig, val_records, tokenizer) -> list[str]:
  """Signatures of the programs the tuned-vs-base evaluation compiles: one per padded prompt width
  (base and tuned share them: the same graph, the LoRA zeroed); none where it does not run."""
  if not (cfg.eval.generate and val_records):
    return []
  from jaxsft import evaluate
  from jaxsft.generate import encode_prompt

  records = list(val_records)[: cfg.eval.num_prompts]
  lengths = [len(encode_prompt(tokenizer, evaluate.prompt_messages(r))) for r in records]
  widths = compiles_lib.generation_widths(lengths, batch_size=8, prompt_multiple=128)
  return [compiles_lib.signature("generate", (8, w), f"new:{cfg.eval.max_new_tokens}") for w in widths]


def compiled_by_phase(probe_seconds: dict, probe_extra: str, shapes, compile_seconds: dict, extra: str) -> dict:
  """{phase: {shape: compile seconds}}: what the probes compiled (`probe_seconds`, their programs'
  signature `probe_extra`), and what the warm-up compiled (the plan's `shapes` the probes did not
  compile for the same program, as `compile_seconds` recorded them: auto choosing packing compiles
  its width again, with segment ids)."""
  probe_programs = set(probe_seconds) if probe_extra == extra else set()
  warm_up = {tuple(s): compile_seconds[tuple(s)] for s in shapes
             if tuple(s) not in probe_programs and tuple(s) in compile_seconds}
  return {"probe": dict(probe_seconds), "warm_up": warm_up}


def learn_from_compiles(calibration: compiles_lib.Calibration, shapes: dict, tally: compiles_lib.CompileTally | None,
                        extra: str) -> compiles_lib.Calibration:
  """`calibration` with one phase's compiles learned: its per-shape seconds (`shapes`) are cold
  samples where it found nothing in the persistent cache (`tally`), warm ones where it found
  everything; its programs (signature `extra`) are remembered as cached in the cache folder (where
  one is used). Unchanged where the phase compiled nothing."""
  samples = [[s[0], s[1], seconds] for s, seconds in shapes.items()]
  if tally is None or not samples:
    return calibration
  learned = {}
  if tally.cache_state == "cold":
    learned["cold"] = compiles_lib.merge_samples(calibration.cold, samples)
    if tally.seconds > 0:
      learned["front_share"] = tally.front_seconds / tally.seconds
  elif tally.cache_state == "warm":
    learned["warm"] = compiles_lib.merge_samples(calibration.warm, samples)
  folder = cache_folder()
  if folder:
    written = {compiles_lib.signature("train", s, extra) for s, seconds in shapes.items()
               if tally.cache_state == "warm" or written_to_cache(seconds / 2)}  # train step and evaluation
    learned["cached"] = {**calibration.cached, folder: sorted(set(calibration.cached.get(folder, [])) | written)}
  return dataclasses.replace(calibration, **learned)


def save_calibration(calibration: compiles_lib.Calibration, path: pathlib.Path | None, writer: bool) -> None:
  if writer and path is not None:
    try:
      calibration.save(path)
    except OSError as e:  # the calibration only improves later predictions: never cost the run
      log.warning("compile calibration not saved to %s: %s", path, e)


def forecast_compiles(cfg: config_lib.TrainConfig, collation: Collation, data, steps, *, keys: tuple[str, ...],
                      cost: cost_lib.StepCost, warm_up: compiles_lib.CompileTally, generation: list[str],
                      writer: bool):
  """(CompileForecast, CompilePrices, calibration): every program the run compiles, priced cold or
  warm from this machine's calibration (its earlier runs and this run's probes: what auto knew when
  it chose, not the warm-up's own compiles), where it was cached before this run; and the
  calibration with the warm-up's compiles learned too, saved."""
  with_eval = bool(data.val_records)
  extra = probe_lib.shape_signature_extra(keys, cfg.optim.grad_accum == 1, with_eval)
  probes = collation.probes
  probe_seconds, probe_extra = (probes.compile_seconds, probes.extra) if probes else ({}, "")
  folder = cache_folder()
  cal = collation.calibration
  cached_before = set(cal.cached.get(folder, [])) if folder else set()
  compiled = compiled_by_phase(probe_seconds, probe_extra, data.shapes, steps.compile_seconds, extra)
  cal = learn_from_compiles(cal, compiled["probe"], probes.tally if probes else None, probe_extra)
  compile_prices = compiles_lib.prices(cal, (cost.compile_base, cost.compile_per_width))
  programs = [(tuple(s), probe_extra) for s in sorted(probe_seconds)] + [(tuple(s), extra) for s in data.shapes]
  forecast = compiles_lib.predict_compiles(compile_prices, programs, with_eval=with_eval, generation_programs=generation,
                                           cached=cached_before, cache_enabled=folder is not None)
  cal = learn_from_compiles(cal, compiled["warm_up"], warm_up, extra)
  save_calibration(cal, collation.calibration_path, writer)
  return forecast, compile_prices, cal


def account(cfg: config_lib.TrainConfig, collation: Collation, data, steps, tokenizer, *, batch_multiple_of: int,
            keys: tuple[str, ...], warm_up: compiles_lib.CompileTally, compile_start: compiles_lib.CompileTally,
            writer: bool) -> CollationAccount:
  """Times one call of (up to `choice.TIMED_SHAPES` of) the compiled shapes, fits the cost, and keeps
  the plan's predicted seconds (over the planned steps) and compiles; logs the choice (auto: with its
  runners-up). `data`: the run's `DataPlan` (shapes, batching, batches per epoch, tokenized splits);
  `steps`: its `CompiledSteps`, every shape compiled; `warm_up`: the warm-up's compile tally."""
  size_for = choice_lib.batch_size_rule(cfg.data, batch_multiple_of)
  if jax.process_count() > 1:  # timing copies the state; across processes it is not addressable here
    cost = cost_lib.DEFAULT_COST
  elif not (cfg.data.time_shapes or probe_lib.chosen_on_timings(cfg.data)):
    cost = cost_lib.DEFAULT_COST
  else:
    log.info("timing the compiled shapes for the collation's predicted seconds (data.time_shapes=false skips this)")
    cost = probe_lib.fit_from_steps(steps, data.shapes, keys, fused=cfg.optim.grad_accum == 1)
  epochs = cost_lib.epochs_planned(data.batches_per_epoch, epochs=cfg.epochs, max_steps=cfg.max_steps,
                                   grad_accum=cfg.optim.grad_accum)
  predicted = choice_lib.predicted(cost, data.batching, collation.train_lengths, data.shapes, batch_size_for=size_for,
                                   epochs=epochs, trained=choice_lib.trained_tokens(data.train_tokens))
  generation = generation_programs(cfg, data.val_records, tokenizer)  # the prompts are tokenized once, here
  forecast, compile_prices, calibration = forecast_compiles(cfg, collation, data, steps, keys=keys, cost=cost,
                                                            warm_up=warm_up, generation=generation, writer=writer)
  predicted = cost_lib.PlanSeconds(predicted.steps, forecast.seconds)
  choice = collation.choice
  record = {"choice": choice.name if choice else data.batching["batching"],
            "batching": {k: data.batching[k] for k in ("batching", "bucket_lengths", "max_length")},
            "predicted_seconds": predicted.to_dict(), "cost": cost.to_dict(), "epochs": round(epochs, 4)}
  if choice is not None:
    choice_lib.log_choice(choice)
    if choice.candidates:
      record["chosen_with"] = choice.cost.to_dict()
      record["candidates"] = [c.summary() for c in choice.candidates]
  log.info("collation %s: predicted %.1fs of steps over %.3g epochs, %.1fs of compiles (cost fitted to %s)",
           record["choice"], predicted.steps, epochs, predicted.compiles, cost.source)
  phases = {"probe": collation.probes.tally} if collation.probes else {}
  phases["warm_up"] = warm_up
  return CollationAccount(record, {**forecast.to_dict(), "prices": compile_prices.source}, phases, tuple(generation),
                          calibration, collation.calibration_path, compile_start)
