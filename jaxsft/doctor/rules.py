"""The doctor's rules: from a loss curve's statistics to one pattern, its likely cause and fix
(the rules, their order and thresholds are in the package docstring)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np

from jaxsft.doctor.statistics import (_lag1_autocorrelation, _mann_kendall_expected_z, _mann_kendall_z, _noise,
                                      smooth, smoothing_window)

__all__ = ["MIN_POINTS", "NEAR_ZERO", "NEAR_ZERO_VAL_DROP", "DIVERGE_REL_RISE", "GRAD_COLLAPSE",
           "GRAD_SPIKE", "UNIFORM_FRACTION", "VAL_RISE_REL", "REBOUND_MIN_DROP", "REBOUND_FRACTION",
           "REBOUND_MIN_POSITION", "FLAT_REL_DROP", "TREND_Z", "SWING_AUTOCORR", "WILD_NOISE_REL",
           "PLATEAU_FRACTION", "DETECT_REL_DROP", "LOW_LR", "USUAL_LORA_LR", "PATTERNS", "Diagnosis", "diagnose"]


MIN_POINTS = 8
NEAR_ZERO = 0.05
NEAR_ZERO_VAL_DROP = 0.5
DIVERGE_REL_RISE = 0.10
GRAD_COLLAPSE = 1e-3
GRAD_SPIKE = 4.0
UNIFORM_FRACTION = 0.8
VAL_RISE_REL = 0.05
REBOUND_MIN_DROP = 0.10
REBOUND_FRACTION = 0.25
REBOUND_MIN_POSITION = 0.85
FLAT_REL_DROP = 0.10
TREND_Z = 3.0
SWING_AUTOCORR = 0.3
WILD_NOISE_REL = 0.75
PLATEAU_FRACTION = 0.2
DETECT_REL_DROP = 0.25
LOW_LR = 1e-5
USUAL_LORA_LR = (1e-4, 3e-4)  # LoRA's usual peak learning rates

PATTERNS = ("healthy", "near_zero_early", "oscillating", "overfitting", "flat", "diverging", "too_noisy",
            "too_short")

_CHECK_TRAINABLE = "check the trainable parameters (LoRA params > 0, target modules matched, labels not all -100)"

_ADVICE = {
    "healthy": ("the loss decreases, then levels off: training is working", "nothing to fix"),
    "near_zero_early": (
        "learning rate too high, or data too small and repetitive (the adapter memorizes it)",
        "lower the learning rate 5-10x, add more diverse data, train fewer epochs"),
    "oscillating": (
        "learning rate too high or batch too small (noisy updates)",
        "lower the learning rate; raise gradient accumulation for a larger effective batch"),
    "overfitting": (
        "the adapter is memorizing the training set instead of generalizing",
        "train fewer epochs, use early stopping on validation loss, add more data, "
        "raise LoRA dropout"),
    "flat": (
        "learning rate too low, LoRA rank too small, or no gradient reaching the adapter",
        f"{_CHECK_TRAINABLE}; raise the learning rate (LoRA typically 1e-4 to 3e-4); raise the rank"),
    "diverging": (
        "learning rate far too high (or numerical trouble: overflow, broken records)",
        "lower the learning rate 10x, keep gradient clipping at 1.0, add warmup; check the "
        "data for broken records"),
    "too_noisy": (
        "too few steps, or too few trained tokens per batch, for the batch-to-batch noise: the curve "
        "cannot tell a model that learns from one that does not",
        "validate (eval.eval_every: the held-out loss has no batch noise), train longer, or raise "
        "the tokens per batch or gradient accumulation"),
    "too_short": (
        f"too few logged losses to judge (fewer than {MIN_POINTS})",
        "train longer or log the loss more often"),
}


@dataclasses.dataclass(frozen=True)
class Diagnosis:
  """What the curve does (`pattern`, one of PATTERNS), why, what to change, and the numbers."""

  pattern: str
  summary: str
  likely_cause: str
  fix: str
  evidence: dict[str, Any]

  def report(self, evidence: bool = True) -> str:
    """Pattern, summary, every number of the evidence (doctor.txt; without it: a run's closing
    summary, which names doctor.txt), likely cause and fix."""
    lines = [f"loss curve: {self.pattern}", f"  {self.summary}"]
    if evidence:
      lines += ["evidence:"] + [f"  {k}: {_fmt(v)}" for k, v in self.evidence.items()]
    lines += [f"likely cause: {self.likely_cause}", f"fix: {self.fix}"]
    return "\n".join(lines)


def _fmt(value: Any) -> str:
  if isinstance(value, float):
    return f"{value:.4g}"
  return str(value)


def _make(pattern: str, summary: str, evidence: dict[str, Any], *, fix: str | None = None,
          cause: str | None = None) -> Diagnosis:
  default_cause, default_fix = _ADVICE[pattern]
  clean = {k: (_rounded(float(v)) if isinstance(v, (float, np.floating)) else
               int(v) if isinstance(v, (np.integer,)) else bool(v) if isinstance(v, np.bool_) else v)
           for k, v in evidence.items()}
  return Diagnosis(pattern, summary, cause or default_cause, fix or default_fix, clean)


def _rounded(value: float) -> float:
  """Six decimals; six significant digits below 1e-3 (a learning rate would round to 0)."""
  return round(value, 6) if abs(value) >= 1e-3 else float(f"{value:.6g}")


def diagnose(train_steps: Sequence[float], train_loss: Sequence[float], *,
             val_steps: Sequence[float] | None = None, val_loss: Sequence[float] | None = None,
             steps_per_epoch: int | None = None, grad_norm: Sequence[float] | None = None,
             vocab_size: int | None = None, learning_rate: Sequence[float] | None = None) -> Diagnosis:
  """Classify a loss curve (see the module docstring for the statistics and thresholds).
  `grad_norm` and `learning_rate`, when given, are the gradient norm and the learning rate of each
  of `train_steps`; `vocab_size`, when given, the model's (rule 3b)."""
  curve = _finite_curve(train_steps, train_loss, grad_norm)
  if isinstance(curve, Diagnosis):
    return curve
  steps, loss, grads, evidence = curve
  vs, vl = _finite_validation(val_steps, val_loss)
  if loss.size < MIN_POINTS:
    return _make("too_short", f"only {loss.size} finite training losses", evidence)
  collapsed = _collapsed(loss, grads, evidence)
  if collapsed is not None:
    return collapsed
  lv = _Levels.of(steps, loss, evidence)
  if lv.last > lv.first + max(DIVERGE_REL_RISE * lv.scale, 3 * lv.se) and lv.z >= TREND_Z:
    return _make("diverging", f"the loss ended {-lv.rel_drop:.0%} above where it started "
                 f"({lv.first:.4g} -> {lv.last:.4g})", evidence)
  worse_than_uniform = _above_uniform(loss, lv.last, vocab_size, evidence)
  if worse_than_uniform is not None:
    return worse_than_uniform
  near_zero = _near_zero_early(steps, lv.s, lv.first, steps_per_epoch, vl, evidence)
  if near_zero is not None:
    return near_zero
  overfit = _validation_overfit(steps, lv.s, vs, vl, evidence)
  worse = _made_worse(loss, lv.last, vl, evidence)
  if worse is not None:
    return worse
  if overfit:
    return _make("overfitting", overfit, evidence)
  rebound = _rebound(steps, lv, evidence)
  if rebound is not None:
    return rebound
  return _trend(loss, grads, lv, vl, learning_rate, evidence)


def _finite_curve(train_steps: Sequence[float], train_loss: Sequence[float], grad_norm: Sequence[float] | None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, dict[str, Any]] | Diagnosis:
  """(steps, loss, grad norms, evidence) of the finite losses in step order, or "diverging" when
  the loss went non-finite at the end or more than now and then."""
  steps = np.asarray(train_steps, dtype=np.float64).reshape(-1)
  loss = np.asarray(train_loss, dtype=np.float64).reshape(-1)
  if steps.shape != loss.shape:
    raise ValueError(f"diagnose: {steps.size} train steps but {loss.size} train losses")
  order = np.argsort(steps, kind="stable")
  steps, loss = steps[order], loss[order]
  finite = np.isfinite(loss)
  n_nonfinite = int((~finite).sum())
  evidence: dict[str, Any] = {"n_points": int(finite.sum()), "n_nonfinite": n_nonfinite}
  if n_nonfinite and (not finite[-3:].all() or n_nonfinite >= max(3, 0.05 * loss.size)):
    first_bad = steps[~finite][0]
    evidence["first_nonfinite_step"] = int(first_bad)
    return _make("diverging", f"the loss became non-finite ({n_nonfinite} of {loss.size} steps, "
                 f"first at step {int(first_bad)})", evidence)
  grads = None if grad_norm is None else np.asarray(grad_norm, dtype=np.float64).reshape(-1)[order][finite]
  return steps[finite], loss[finite], grads, evidence


@dataclasses.dataclass(frozen=True)
class _Levels:
  """The start and end levels of a finite curve, its noise and trend (the rules' common numbers)."""

  n: int
  s: np.ndarray  # the smoothed loss
  first: float
  last: float
  se: float  # standard error of first - last
  noise: float  # typical per-step noise (robust)
  drop: float
  scale: float
  rel_drop: float
  noise_rel: float
  i_min: int  # the smoothed minimum's index
  z: float  # Mann-Kendall

  @classmethod
  def of(cls, steps: np.ndarray, loss: np.ndarray, evidence: dict[str, Any]) -> "_Levels":
    """The levels of `loss`, also added to `evidence`."""
    n = loss.size
    k_first, k_last = int(np.clip(n // 20, 3, 25)), int(np.clip(n // 10, 3, 50))
    window = smoothing_window(n)
    s = smooth(loss, window)
    first, last = float(np.median(loss[:k_first])), float(np.median(loss[-k_last:]))
    noise, noise_rms = _noise(loss, window)
    se = 1.2533 * noise_rms * math.sqrt(1.0 / k_first + 1.0 / k_last)
    drop, scale = first - last, max(abs(first), 1e-12)
    rel_drop, noise_rel = drop / scale, noise / max(abs(first), abs(last), 1e-12)
    i_min = int(np.argmin(s))
    evidence.update(first_level=first, last_level=last, rel_drop=rel_drop, noise=noise, noise_rel=noise_rel,
                    trend_to_noise=drop / noise, smoothed_min=float(s[i_min]), smoothed_min_step=int(steps[i_min]),
                    window=window)
    evidence["mann_kendall_z"] = z = _mann_kendall_z(loss)
    return cls(n, s, first, last, se, noise, drop, scale, rel_drop, noise_rel, i_min, z)


def _rebound(steps: np.ndarray, lv: _Levels, evidence: dict[str, Any]) -> Diagnosis | None:
  """Overfitting seen in the training loss alone: it fell, then rose back a good part of its fall."""
  fall, rebound = lv.first - float(lv.s[lv.i_min]), lv.last - float(lv.s[lv.i_min])
  if not (lv.i_min < REBOUND_MIN_POSITION * lv.n and fall >= max(REBOUND_MIN_DROP * lv.scale, 3 * lv.se)
          and rebound >= max(REBOUND_FRACTION * fall, 3 * lv.se)):
    return None
  evidence["rebound_fraction"] = rebound / fall
  return _make("overfitting", f"the training loss fell to {lv.s[lv.i_min]:.4g} at step "
               f"{int(steps[lv.i_min])}, then rose back to {lv.last:.4g} ({rebound / fall:.0%} of "
               "its fall)", evidence)


def _trend(loss: np.ndarray, grads: np.ndarray | None, lv: _Levels, vl: np.ndarray,
           learning_rate: Sequence[float] | None, evidence: dict[str, Any]) -> Diagnosis:
  """Healthy (leveled off or still falling) after a significant fall, else `_without_trend`."""
  # A trend: 10% lower at the end, and significant by the end medians, by Mann-Kendall over
  # every point, or by the (low-noise) validation loss: two points are enough, the same held-out
  # set before and after.
  val_drop = None
  if vl.size >= 2:
    evidence["val_rel_drop"] = val_drop = (vl[0] - vl[-1]) / max(abs(vl[0]), 1e-12)
  significant = lv.drop >= 2.5 * lv.se or lv.z <= -TREND_Z or (val_drop is not None and val_drop >= FLAT_REL_DROP)
  if max(lv.rel_drop, val_drop or 0.0) < FLAT_REL_DROP or not significant:
    return _without_trend(loss, grads, lv, val_drop is not None, learning_rate, evidence)

  # Leveled off: the last quarter fell less than PLATEAU_FRACTION of the whole drop, unless the
  # (far less noisy) validation loss fell in its last interval at least half its average interval.
  q3 = float(lv.s[min(int(0.75 * lv.n), lv.n - 1)])
  plateaued = (q3 - lv.last) < PLATEAU_FRACTION * lv.drop
  if val_drop is not None:
    mean_interval = (vl[0] - vl[-1]) / (vl.size - 1)
    plateaued = plateaued and not (mean_interval > 0 and vl[-2] - vl[-1] >= 0.5 * mean_interval)
  evidence["plateaued"] = plateaued
  summary = f"the loss fell {lv.rel_drop:.0%} ({lv.first:.4g} -> {lv.last:.4g})"
  if plateaued:
    return _make("healthy", summary + " and leveled off", evidence)
  return _make("healthy", summary + " and was still falling at the end", evidence,
               fix="nothing to fix; it was still improving: more steps may help")


def _collapsed(loss: np.ndarray, grads: np.ndarray | None, evidence: dict[str, Any]) -> Diagnosis | None:
  """Rule 3a: the loss rose and the gradients vanished (see the module docstring)."""
  if grads is None or grads.size != loss.size:
    return None
  k = int(np.clip(loss.size // 10, 3, 50))
  g_first, g_last = float(np.max(grads[:k])), float(np.median(grads[-k:]))  # the collapse may take one step
  last = float(np.median(loss[-k:]))
  if not (last >= (1 + DIVERGE_REL_RISE) * loss[0] and g_first > 0 and g_last <= GRAD_COLLAPSE * g_first):
    return None
  evidence.update(grad_norm_first=g_first, grad_norm_last=g_last)
  return _make("diverging", f"the loss rose from {loss[0]:.4g} to {last:.4g} and the gradients vanished "
               f"(norm {g_first:.3g} -> {g_last:.3g}): the update threw the weights where the output is "
               f"flat, and nothing flows back", evidence)


def _above_uniform(loss: np.ndarray, last: float, vocab_size: int | None,
                   evidence: dict[str, Any]) -> Diagnosis | None:
  """Rule 3b: the end level is near ln(vocab_size) (UNIFORM_FRACTION of it or more), where a model
  that spreads its probability evenly over the vocabulary sits, and above the first step's loss (the
  base model's, on the first batch). Noise cannot put a pretrained model there, so no trend statistic
  is needed: a short, wild curve that the start median and Mann-Kendall cannot call a rise is still
  caught."""
  if not vocab_size or vocab_size < 2:
    return None
  uniform = math.log(vocab_size)
  if not (last >= UNIFORM_FRACTION * uniform and last > (1 + DIVERGE_REL_RISE) * float(loss[0])):
    return None
  evidence.update(uniform_level=uniform, first_train_loss=float(loss[0]))
  return _make("diverging", f"the loss ended at {last:.4g}, {last / uniform:.0%} of ln({vocab_size}) = {uniform:.4g}, "
               f"what a uniform guess over the vocabulary scores, from {float(loss[0]):.4g} at the first step: "
               "the updates wrecked the model", evidence)


def _near_zero_early(steps: np.ndarray, s: np.ndarray, first: float, steps_per_epoch: int | None,
                     vl: np.ndarray, evidence: dict[str, Any]) -> Diagnosis | None:
  """"near_zero_early" when the smoothed loss fell below NEAR_ZERO within the first epoch (the
  first half of the run when the epoch is unknown) and validation does not confirm it."""
  if steps_per_epoch:
    early_end = steps[0] + steps_per_epoch - 1
    evidence["steps_per_epoch"] = int(steps_per_epoch)
  else:
    early_end = steps[0] + 0.5 * (steps[-1] - steps[0])
  below = np.flatnonzero(s < NEAR_ZERO)
  if not (below.size and first > 2 * NEAR_ZERO):
    return None
  evidence["near_zero_step"] = int(steps[below[0]])
  # Memorizing (or too high a rate) leaves the held-out loss behind; when it fell to its best
  # at the end as well, the task is simply learned (replies a program could write).
  confirmed = _validation_keeps_falling(vl)
  evidence["near_zero_confirmed_by_validation"] = confirmed
  if not (steps[below[0]] <= early_end and not confirmed):
    return None
  when = "the first epoch" if steps_per_epoch else "the first half of the run"
  return _make("near_zero_early", f"the loss fell to ~0 (< {NEAR_ZERO}) by step "
               f"{int(steps[below[0]])}, within {when}", evidence)


def _made_worse(loss: np.ndarray, last: float, vl: np.ndarray, evidence: dict[str, Any]) -> Diagnosis | None:
  """"diverging" when worse on both sides: the held-out loss ends above its first value (the base
  model's, logged before step 1) and the training loss above its very first step. Overfitting needs
  the training loss to have improved; an early blow-up that the start median absorbed does not.
  Two validation points are enough (a run that validates only before step 1 and at the end): the
  held-out set is the same each time, so its change is the model's, not a batch's."""
  if vl.size < 2:
    return None
  val_first, val_last = float(vl[0]), float(vl[-1])
  val_rise = (val_last - val_first) / max(abs(val_first), 1e-12)
  if not (val_rise >= DIVERGE_REL_RISE and last > (1 + DIVERGE_REL_RISE) * float(loss[0])):
    return None
  evidence.update(val_first=val_first, val_last=val_last, val_rise_from_first=val_rise, first_train_loss=float(loss[0]))
  return _make("diverging", f"training made the model worse: validation {val_first:.4g} -> {val_last:.4g}, "
               f"training loss {float(loss[0]):.4g} at the first step -> {last:.4g} at the end", evidence)


def _without_trend(loss: np.ndarray, grads: np.ndarray | None, lv: _Levels, validated: bool,
                   learning_rate: Sequence[float] | None, evidence: dict[str, Any]) -> Diagnosis:
  """"oscillating" when the steps swing together (|lag-1 autocorrelation| above what noise
  gives for n points), the noise is wild or the gradient norm spiked; else "flat" when something
  shows the model still (`_could_show_a_fall`, or a learning rate under LOW_LR), else "too_noisy"."""
  n, first, last, noise_rel = loss.size, lv.first, lv.last, lv.noise_rel
  change = -evidence["rel_drop"]  # (last - first) / first: + for a rise
  no_trend = f"no significant trend: {first:.4g} -> {last:.4g} ({change:+.1%})"
  rho = _lag1_autocorrelation(loss)
  evidence["lag1_autocorrelation"] = rho
  limit = max(SWING_AUTOCORR, 2.5 / math.sqrt(n))
  if abs(rho) >= limit or noise_rel >= WILD_NOISE_REL:
    kind = ("alternating up and down from step to step" if rho <= -limit else
            "persistent swings" if rho >= limit else "wild step-to-step noise")
    return _make("oscillating", f"{no_trend}, but {kind} (lag-1 autocorrelation {rho:+.2f}, noise "
                 f"{noise_rel:.0%} of the level)", evidence)
  if grads is not None and grads.size == n and grads[0] > 0:
    k = int(np.argmax(grads))
    evidence["grad_norm_max_over_first"] = spike = float(grads[k] / grads[0])
    if spike >= GRAD_SPIKE:
      return _make("oscillating", f"{no_trend}, but the updates threw the model about: the gradient norm rose "
                   f"to {spike:.1f}x its first step's ({grads[0]:.3g} -> {grads[k]:.3g}) and the loss as high as "
                   f"{float(loss.max()):.4g} (first step {float(loss[0]):.4g})", evidence)
  if not _could_show_a_fall(lv, validated, evidence):
    peak = _peak_lr(learning_rate, evidence)
    if peak is None or peak >= LOW_LR:
      return _make("too_noisy", f"{no_trend}, but {n} losses with batch-to-batch noise of {noise_rel:.0%} of the "
                   f"level could not show one: a straight {DETECT_REL_DROP:.0%} fall would give a Mann-Kendall z "
                   f"of about {evidence['detectable_fall_z']:.2g} (a trend needs {-TREND_Z:.3g})", evidence)
    return _make("flat", f"{no_trend}, and the learning rate peaked at {peak:.3g}, too low for the adapter to move "
                 "(AdamW moves each weight by about the learning rate a step; LoRA typically trains at 1e-4 to "
                 "3e-4)", evidence)
  advice = _flat_advice(_peak_lr(learning_rate, evidence), evidence)
  if abs(change) < FLAT_REL_DROP:
    return _make("flat", f"the loss barely moved: {first:.4g} -> {last:.4g} ({change:+.1%}); "
                 "what varies looks like batch-to-batch noise", evidence, **advice)
  return _make("flat", f"{no_trend} is within what batch-to-batch noise moves these levels", evidence, **advice)


def _flat_advice(peak_lr: float | None, evidence: dict[str, Any]) -> dict[str, str]:
  """{cause, fix} of a still curve whose learning rate peaked in USUAL_LORA_LR or above, where "too
  low a rate, raise it into the usual range" would be no advice: too few steps, a longer run first
  (with how much of an epoch this one covered), then a higher rate (where it is not above the usual
  range already) or rank. {} (the usual advice) otherwise."""
  low, high = USUAL_LORA_LR
  if peak_lr is None or peak_lr < low:
    return {}
  cause = "too few steps, LoRA rank too small, or no gradient reaching the adapter"
  steps, per_epoch = evidence["n_points"], evidence.get("steps_per_epoch")
  longer = "train longer" + (f" ({steps} steps were {steps / per_epoch:.0%} of one epoch)"
                             if per_epoch and steps < per_epoch else "")
  if peak_lr <= high:
    return {"cause": cause, "fix": f"{_CHECK_TRAINABLE}; the learning rate peaked at {peak_lr:.3g}, in LoRA's usual "
            f"range (1e-4 to 3e-4): {longer}, then try a 2-3x higher learning rate or a larger rank"}
  return {"cause": cause, "fix": f"{_CHECK_TRAINABLE}; the learning rate peaked at {peak_lr:.3g}, above LoRA's usual "
          f"range (1e-4 to 3e-4), so it is not too low: {longer} or raise the rank"}


def _could_show_a_fall(lv: _Levels, validated: bool, evidence: dict[str, Any]) -> bool:
  """Whether validation or the curve itself would have shown a fall of DETECT_REL_DROP (see the
  module docstring): then no trend means a still model, "flat"."""
  fall = DETECT_REL_DROP * lv.scale
  evidence["detectable_fall_z"] = z = _mann_kendall_expected_z(lv.n, fall, lv.noise)
  return validated or 2.5 * lv.se <= fall or z <= -TREND_Z


def _peak_lr(learning_rate: Sequence[float] | None, evidence: dict[str, Any]) -> float | None:
  """The largest logged learning rate (None when not every step logged a finite one)."""
  lr = None if learning_rate is None else np.asarray(learning_rate, dtype=np.float64)
  if lr is None or not lr.size or not np.isfinite(lr).all():
    return None
  evidence["peak_lr"] = peak = float(lr.max())
  return peak


def _finite_validation(val_steps, val_loss) -> tuple[np.ndarray, np.ndarray]:
  """The finite validation points (steps, losses) in step order; empty without validation."""
  if val_steps is None or val_loss is None:
    return np.empty(0), np.empty(0)
  vs = np.asarray(val_steps, dtype=np.float64).reshape(-1)
  vl = np.asarray(val_loss, dtype=np.float64).reshape(-1)
  if vs.shape != vl.shape:
    raise ValueError(f"diagnose: {vs.size} validation steps but {vl.size} validation losses")
  keep = np.isfinite(vl)
  order = np.argsort(vs[keep], kind="stable")
  return vs[keep][order], vl[keep][order]


def _validation_keeps_falling(vl: np.ndarray) -> bool:
  """At least two finite validation points, the last one the lowest and at most
  (1 - NEAR_ZERO_VAL_DROP) of the first."""
  return bool(vl.size >= 2 and vl[-1] <= vl.min() and vl[-1] <= (1 - NEAR_ZERO_VAL_DROP) * vl[0])


def _validation_overfit(steps: np.ndarray, s: np.ndarray, vs: np.ndarray, vl: np.ndarray,
                        evidence: dict[str, Any]) -> str | None:
  """A summary when validation rose from its minimum while train did not rise, else None."""
  if vl.size < 3:
    return None
  j = int(np.argmin(vl))
  vmin, vlast = float(vl[j]), float(vl[-1])
  rise = (vlast - vmin) / max(abs(vmin), 1e-12)
  # Train level where validation was best vs at the end (smoothed, nearest logged step).
  t_at = float(s[min(int(np.searchsorted(steps, vs[j])), s.size - 1)])
  t_change = (float(s[-1]) - t_at) / max(abs(t_at), 1e-12)
  evidence.update(val_points=int(vl.size), val_first=float(vl[0]), val_min=vmin,
                  val_min_step=int(vs[j]), val_last=vlast, val_rise_rel=rise,
                  train_change_since_val_min=t_change)
  after = vl[j + 1:]
  sustained = after.size >= 1 and bool(np.all(after[-2:] >= vmin * (1 + VAL_RISE_REL / 2)))
  if j < vl.size - 1 and rise >= VAL_RISE_REL and sustained and t_change <= 0.02:
    return (f"validation loss rose {rise:.0%} from its best ({vmin:.4g} at step {int(vs[j])}) "
            f"to {vlast:.4g} while the training loss went {t_change:+.0%}")
  return None
