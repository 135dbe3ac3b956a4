"""The step's cost from this run's own timings: with `batching: auto` or `num_buckets: auto` the
probes compile and time three shapes (a quarter, half and all of the longest example) before the
plan is chosen (`probe`); every run may time its compiled shapes at warm-up (`fit_from_steps`).
Both fit `cost.StepCost` to `CompiledSteps`' own timings."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from jaxsft import config as config_lib
from jaxsft import step as step_lib
from jaxsft.collation import choice as choice_lib
from jaxsft.collation import compiles as compiles_lib
from jaxsft.collation import cost as cost_lib

log = logging.getLogger("jaxsft.train")  # the trainer's log: these lines are part of its setup

PADDED_KEYS = ("input_ids", "attention_mask", "labels")
"""The inputs of a padded batch (packed ones add segment ids and positions: `step.BATCH_KEYS`)."""


@dataclasses.dataclass(frozen=True)
class ProbeTarget:
  """What the probes compile: the model split into its graph, trained and frozen params, on `mesh`;
  `with_eval`: whether the run evaluates held-out data (the evaluation compiles with each shape)."""

  graphdef: Any
  trainable: Any
  frozen: Any
  mesh: Any
  with_eval: bool


@dataclasses.dataclass(frozen=True)
class Probes:
  """What the probes compiled and measured: their `steps` (whose executables then serve the run) and
  its initial `opt_state`, the fitted `cost`, the `seconds` they took, the compile `tally` of their
  programs, each shape's compile seconds and the rest of their programs' signature (`extra`)."""

  steps: step_lib.CompiledSteps
  opt_state: Any
  cost: cost_lib.StepCost
  seconds: float
  tally: compiles_lib.CompileTally
  compile_seconds: dict
  extra: str


def chosen_on_timings(d: config_lib.DataConfig) -> bool:
  """Whether the plan is chosen on the step's own timings (the probes): then they are fitted whatever
  `time_shapes` says, since the choice already paid for them."""
  return d.batching == "auto" or d.num_buckets == "auto"


def shape_signature_extra(keys: tuple[str, ...], fused: bool, with_eval: bool) -> str:
  """What selects a shape's programs besides the shape: the batch's inputs, fused or accumulated
  steps, and whether the evaluation compiles with it."""
  return f"{'+'.join(keys)}:{'fused' if fused else 'accumulate'}:{'eval' if with_eval else 'train'}"


def fit_from_steps(steps, shapes: list[tuple[int, int]], keys: tuple[str, ...], *, fused: bool) -> cost_lib.StepCost:
  """Times each of `timed_shapes(shapes)` not timed yet (compiled already) and fits the cost to every
  shape `steps` timed (probes included) and to the compile seconds it recorded for every shape."""
  timed = choice_lib.timed_shapes(shapes)
  for shape in timed:
    if tuple(shape) not in steps.step_seconds:
      steps.time_step(tuple(shape), keys, fused=fused)
  if not steps.trained_step_seconds:  # the LM head's share: the widest shape again, every label trained
    steps.time_step(tuple(timed[-1]), keys, fused=fused, trained=True)
  samples = [(b, t, s) for (b, t), s in steps.step_seconds.items()]
  compiles = [(b, t, s) for (b, t), s in steps.compile_seconds.items()]
  trained = [(b, t, s) for (b, t), s in steps.trained_step_seconds.items()]
  return cost_lib.fit_step_cost(samples, compiles, trained)


def with_cold_compiles(cost: cost_lib.StepCost, calibration: compiles_lib.Calibration,
                       tally: compiles_lib.CompileTally) -> cost_lib.StepCost:
  """The cost `auto` chooses with: compiles priced cold. Where the probes found their programs in
  the persistent cache their seconds are cache reads, not compiles: this machine's cold fit replaces
  them (when it has one), so a warm run chooses what a cold one does (and then finds it cached)."""
  cold = compiles_lib.fit_linear_in_width(calibration.cold)
  if tally.cache_hits == 0 or cold is None:
    return cost
  return dataclasses.replace(cost, compile_base=cold[0], compile_per_width=cold[1], compile_ratios=())


def probe(cfg: config_lib.TrainConfig, target: ProbeTarget, longest: int,
          calibration: compiles_lib.Calibration) -> Probes:
  """Compiles and times the three probe shapes of `longest` and fits the step's cost. The probes'
  executables then serve the run (its schedule is set once known)."""
  d = cfg.data
  t0 = time.time()
  size_for = choice_lib.batch_size_rule(d, target.mesh.batch_multiple_of)
  steps, opt_state = step_lib.build_steps(cfg, target.graphdef, target.trainable, target.frozen, target.mesh,
                                          cfg.max_steps or 1)
  shapes = [(size_for(t), t) for t in choice_lib.probe_widths(longest, d.pad_to_multiple_of)]
  # Compiled for the inputs the run will feed them when it can tell (auto may still pick packing:
  # then its one width compiles again, with segment ids).
  keys = step_lib.BATCH_KEYS if d.batching == "bucketed_packed" else PADDED_KEYS
  fused = cfg.optim.grad_accum == 1
  before = compiles_lib.ledger().tally()
  steps.warm_up(shapes, keys, with_eval=target.with_eval, fused=fused)
  tally = compiles_lib.ledger().tally() - before
  cost = fit_from_steps(steps, shapes, keys, fused=fused)
  cost = with_cold_compiles(cost, calibration, tally)
  log.info("collation probes %s: step %.3g + %.3g·B·T + %.3g·B·T² s, compile %.3g + %.3g·T s (%.1fs)", shapes,
           cost.a, cost.b, cost.c, cost.compile_base, cost.compile_per_width, time.time() - t0)
  return Probes(steps, opt_state, cost, time.time() - t0, tally, dict(steps.compile_seconds),
                shape_signature_extra(keys, fused, target.with_eval))
