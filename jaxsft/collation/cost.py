"""The cost model of a collation plan: step seconds per batch shape, compile seconds per shape,
summed over the run's planned steps. Pure functions of numbers; nothing here times anything.

A step on a (B, T) batch costs

    step_seconds(B, T) = a + b·B·T + c·B·T²   (+ h per trained token)

(`a`: dispatch, optimizer update and other per-step work; `b`: everything linear in the tokens:
projections, MLP; `c`: attention's scores and weighted sums, quadratic in the width; `h`: the LM
head and loss, which run only where a label is trained). B·T counts every computed token, fill
rows and padding included: the model computes on them. The trained tokens are the data's, the
same whatever the collation, so `h` moves every plan's time alike.
Compiling a shape costs

    compile_seconds(B, T) = p + q·T

and a plan that emits n_s batches of shape s over the run and compiles the set S costs

    seconds(plan) = Σ_s n_s · step_seconds(s)  +  h · trained tokens  +  Σ_{s ∈ S} compile_seconds(s).

`fit_step_cost` fits (a, b, c) by non-negative least squares to measured (B, T, seconds) triples,
with fewer terms when there are too few distinct shapes to tell them apart. Where more widths were
timed than the fit has terms, each form is multiplied by its measured correction

    r(T) = measured / fitted at the timed widths T_i, piecewise linear in T between them,
           r(T_1) below the narrowest and r(T_n) above the widest,

so every timed width costs what it measured: a step's time on a CPU is not smooth in T (cache
sizes), and three terms alone misrank plans a few percent apart. r = 1 where the fit is exact.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Mapping, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class StepCost:
  """Seconds of a step and of a compile as functions of the batch shape (see the module docstring).

  `source` says where the numbers come from ("measured: N shapes" or "default: ...")."""

  a: float
  b: float
  c: float
  compile_base: float = 0.0
  compile_per_width: float = 0.0
  per_trained_token: float = 0.0
  source: str = "given"
  step_ratios: tuple[tuple[float, float], ...] = ()
  """(T_i, measured / fitted step seconds) at the timed widths, narrowest first: r(T) of the step."""
  compile_ratios: tuple[tuple[float, float], ...] = ()
  """The same for the compile seconds."""

  def __post_init__(self):  # from JSON the pairs come as lists
    for name in ("step_ratios", "compile_ratios"):
      object.__setattr__(self, name, tuple((float(t), float(r)) for t, r in getattr(self, name)))

  def step_seconds(self, batch_size, width):
    """(a + b·B·T + c·B·T²)·r(T) (numpy arrays broadcast)."""
    tokens = np.multiply(batch_size, width, dtype=np.float64)
    return (self.a + self.b * tokens + self.c * tokens * width) * _ratio(self.step_ratios, width)

  def compile_seconds(self, batch_size, width):
    """(p + q·T)·r(T): a compile's time grows slowly with the shape (B does not enter the fit)."""
    del batch_size
    width = np.asarray(width, dtype=np.float64)
    return (self.compile_base + self.compile_per_width * width) * _ratio(self.compile_ratios, width)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


# The default when no timing exists: the step of `smollm2-shaped-4l` (SmolLM2-135M's shapes, 4
# layers, LoRA r 8 on q/v, float32) and its compiles, least-squares fitted to the per-shape table of
# benchmarks/results/collation.json (a 2-core Xeon). Absolute seconds differ on other machines and
# models; what the default keeps is the balance of per-step, per-token, attention and compile costs.
DEFAULT_COST = StepCost(a=0.088, b=6.98e-4, c=2.54e-7, compile_base=2.25, compile_per_width=1.39e-3,
                        source="default: smollm2-shaped-4l on a 2-core CPU (benchmarks/results/collation.json)")


def _ratio(pairs: tuple[tuple[float, float], ...], width):
  """r(T): 1 without pairs, else piecewise linear through them and constant past the ends."""
  if not pairs:
    return 1.0
  widths, ratios = zip(*pairs)
  return np.interp(np.asarray(width, dtype=np.float64), widths, ratios)


def _ratios(samples: list[tuple[int, int, float]], fitted) -> tuple[tuple[float, float], ...]:
  """(T, mean of measured / fitted(B, T) over the samples of width T) per width, where the fit is
  positive; none where one width or fewer was timed (nothing to interpolate between)."""
  per_width: dict[int, list[float]] = {}
  for b, t, seconds in samples:
    predicted = float(fitted(b, t))
    if predicted > 0:
      per_width.setdefault(t, []).append(seconds / predicted)
  if len(per_width) < 2:
    return ()
  return tuple((float(t), float(np.mean(r))) for t, r in sorted(per_width.items()))


def _nonnegative_least_squares(design: np.ndarray, target: np.ndarray) -> np.ndarray:
  """argmin_{x >= 0} |design·x - target|², columns rescaled to unit norm for conditioning."""
  from scipy.optimize import nnls

  scale = np.linalg.norm(design, axis=0)
  scale[scale == 0] = 1.0
  x, _ = nnls(design / scale, target)
  return x / scale


def fit_step_cost(samples: Iterable[tuple[int, int, float]],
                  compile_samples: Iterable[tuple[int, int, float]] = (),
                  trained_samples: Iterable[tuple[int, int, float]] = ()) -> StepCost:
  """Fits `StepCost` to measured `(B, T, step seconds)` and `(B, T, compile seconds)` triples.

  `samples` are steps with no label trained; `trained_samples` steps of the same shapes with every
  label trained: h is the mean of (trained - untrained seconds) / (B·T) over them (at least 0).

  Non-negative least squares over the terms the samples can tell apart: a, b·B·T and c·B·T² with
  three or more distinct shapes; a and b·B·T with two; b·B·T alone with one (the step is then
  taken as proportional to its tokens). Compiles: p + q·T with two or more distinct widths, p alone
  with one, zero with none. Then r(T) of each from the same samples (module docstring).
  """
  samples = [(int(b), int(t), float(s)) for b, t, s in samples]
  if not samples:
    raise ValueError("fit_step_cost needs at least one (B, T, seconds) sample")
  shapes = np.array([(b, t) for b, t, _ in samples], dtype=np.float64)
  seconds = np.array([s for _, _, s in samples])
  tokens = shapes[:, 0] * shapes[:, 1]
  columns = [np.ones_like(tokens), tokens, tokens * shapes[:, 1]]
  distinct = len({(b, t) for b, t, _ in samples})
  used = {1: [1], 2: [0, 1]}.get(distinct, [0, 1, 2])
  coef = np.zeros(3)
  coef[used] = _nonnegative_least_squares(np.stack([columns[i] for i in used], axis=1), seconds)
  compile_coef = np.zeros(2)
  compile_samples = [(int(b), int(t), float(s)) for b, t, s in compile_samples]
  if compile_samples:
    widths = np.array([t for _, t, _ in compile_samples], dtype=np.float64)
    compile_seconds = np.array([s for _, _, s in compile_samples])
    if len(set(widths.tolist())) >= 2:
      compile_coef = _nonnegative_least_squares(np.stack([np.ones_like(widths), widths], axis=1), compile_seconds)
    else:
      compile_coef[0] = compile_seconds.mean()
  untrained = {(b, t): s for b, t, s in samples}
  extra = [(s - untrained[(b, t)]) / (b * t) for b, t, s in trained_samples if (b, t) in untrained]
  per_trained = max(float(np.mean(extra)), 0.0) if extra else 0.0
  fitted = StepCost(*map(float, coef), *map(float, compile_coef), per_trained_token=per_trained,
                    source=f"measured: {distinct} shapes")
  return dataclasses.replace(fitted, step_ratios=_ratios(samples, fitted.step_seconds),
                             compile_ratios=_ratios(compile_samples, fitted.compile_seconds))


@dataclasses.dataclass(frozen=True)
class PlanSeconds:
  """Predicted (or measured) seconds of a plan: `steps` (every batch's step) and `compiles`."""

  steps: float
  compiles: float

  @property
  def total(self) -> float:
    return self.steps + self.compiles

  def to_dict(self) -> dict:
    return {"steps": round(self.steps, 3), "compiles": round(self.compiles, 3)}


def epochs_planned(batches_per_epoch: int, *, epochs: int, max_steps: int | None, grad_accum: int = 1) -> float:
  """How many epochs of batches the run consumes: `epochs`, or with `max_steps` the
  max_steps·grad_accum batches it reads, as a fraction of one epoch's batches."""
  if max_steps:
    return max_steps * grad_accum / max(batches_per_epoch, 1)
  return float(epochs)


def plan_seconds(cost: StepCost, batches_per_shape: Mapping[tuple[int, int], float],
                 compiled_shapes: Sequence[tuple[int, int]], *, epochs: float = 1.0,
                 trained_tokens: int = 0) -> PlanSeconds:
  """epochs·(Σ_s n_s·step_seconds(s) + h·trained_tokens) + Σ_{s compiled} compile_seconds(s).

  `batches_per_shape`: batches of each (B, T) in one epoch (fill rows are in B·T already: a batch
  with fill rows costs what a full one does). `compiled_shapes`: the shapes compiled before step 1.
  `trained_tokens`: labels trained in one epoch.
  """
  steps = sum(float(n) * float(cost.step_seconds(b, t)) for (b, t), n in batches_per_shape.items())
  steps += cost.per_trained_token * trained_tokens
  compiles = sum(float(cost.compile_seconds(b, t)) for b, t in compiled_shapes)
  return PlanSeconds(steps * epochs, compiles)


def bucket_batches(count: int, batch_size: int) -> int:
  """Batches one epoch emits for a bucket of `count` examples: ceil(count / B) (the last one
  padded with fill rows)."""
  return math.ceil(count / batch_size) if count else 0


PADDED_TOKENS = StepCost(a=0.0, b=1.0, c=0.0, source="padded tokens")
"""The cost whose step 'seconds' are the step's B·T: minimizing it minimizes padded tokens."""
