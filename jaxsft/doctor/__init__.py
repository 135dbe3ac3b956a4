"""The loss-curve doctor: classify a training curve and say what to change.

`diagnose` reads the per-step training loss (and the validation loss, when there is one) and
returns one of the patterns of the fine-tuning checklist, with the likely cause and the fix:

  pattern          what the curve does                               likely cause
  healthy          decreases, then plateaus                          -
  near_zero_early  ~0 within the first epoch                         LR too high / tiny repetitive data
  oscillating      swings without a trend (or its gradient norm      LR too high / batch too small
                   spikes)
  overfitting      decreases then rises, or train falls while        memorizing the training set
                   validation rises
  flat             barely moves                                      LR too low / rank too small / no
                                                                     gradient reaching the adapter
  diverging        ends clearly above where it started, near the     LR far too high / numerics
                   uniform level ln(vocab), or goes non-finite
  too_noisy        no trend, but too few or too noisy points to      too few steps / trained tokens
                   have shown the fall a working fine-tune makes     per batch for the noise
  too_short        fewer than MIN_POINTS finite losses               -

`python -m jaxsft.doctor RUN_DIR` prints the diagnosis of `RUN_DIR/metrics.jsonl`.

Statistics (all robust to the odd spike; n = number of finite train losses):

  k1, k2 = clip(n // 20, 3, 25), clip(n // 10, 3, 50)   points summarized at the start, the end
  s = rolling median of the loss, centered window w = clip(n // 10, 5, 51) (odd)
  first, last = median(loss[:k1]), median(loss[-k2:])
  r = loss - (median of its w - 1 neighbours),  c = sqrt(1 + pi / (2 (w - 1)))
  noise = 1.4826 * MAD(r) / c               typical per-step (batch) noise, as a Gaussian std
  se = 1.2533 * rms(r) / c * sqrt(1/k1 + 1/k2)
                                            std error of (first - last), medians of k1, k2
                                            points (rms: spikes and excursions move them too)
  z = Mann-Kendall trend statistic over every point (|z| >= 3: a significant monotone trend)
  drop = first - last,  rel_drop = drop / first,  noise_rel = noise / max(first, last)
                                            (the higher level: beside a loss that fell near 0,
                                            any batch noise would look wild)
  trend_to_noise = drop / noise             (reported as evidence)

Rules, first match wins:

  1. diverging        a non-finite loss among the last 3, or >= max(3, 5% of n) non-finite
  2. too_short        n < MIN_POINTS (8)
  3. diverging        last > first + max(DIVERGE_REL_RISE * first, 3 se) (10%) and z >= 3
  3a. diverging       collapsed: `last` >= 10% above the very first training loss while the
                      gradient norm (median of the last k2) fell to GRAD_COLLAPSE (1e-3) of
                      its largest among the first k2 (the weights were thrown where the output
                      is flat: the loss sits at the uniform level ln(vocab) and nothing flows
                      back; without this rule the still curve would read as "flat")
  3b. diverging       near the uniform level: `last` >= UNIFORM_FRACTION (80%) of ln(vocab
                      size), the loss of a uniform guess over the vocabulary, and >= 10% above
                      the very first training loss (a pretrained model starts far below ln V;
                      ending near it means the updates wrecked the model, however wild the
                      curve; needs the vocabulary size, which the trainer logs in metrics.jsonl's
                      config line)
  3c. diverging       validation (>= 2 points) ends >= 10% above its first value and `last`
                      is >= 10% above the very first training loss (an early blow-up that
                      the start median absorbs; checked after rule 4, before overfitting)
  4. near_zero_early  s < NEAR_ZERO (0.05 nats/token) by the end of the first epoch
                      (the first half of the run when the epoch length is unknown), unless
                      validation (>= 2 points) ends at its lowest, >= NEAR_ZERO_VAL_DROP (50%)
                      below its first value: then the held-out loss confirms a learned task
  5. overfitting      validation (>= 3 points): its minimum is not the last point, the last
                      value is >= VAL_RISE_REL (5%) above it (the last two, when two follow it,
                      >= half that), and train did not rise by more than 2% meanwhile;
                      or train alone: s falls to a minimum before 85% of the run by
                      >= max(REBOUND_MIN_DROP * first, 3 se) (10%), then `last` climbs back
                      >= max(REBOUND_FRACTION * that fall, 3 se) (25%)
  6. flat,           no meaningful trend: train (rel_drop) and validation both less than
     oscillating      FLAT_REL_DROP (10%) lower at the end than at the start, or the drop is not
     or too_noisy     significant by any of: drop >= 2.5 se; Mann-Kendall z <= -TREND_Z (3) over
                      every point; validation (>= 2 points) 10% lower at its end than at its start.
                      Then rho = lag-1 autocorrelation around a straight-line fit: batch-to-batch
                      noise alone is independent (rho ~ 0 +- 1/sqrt(n)), so a noisy curve is not
                      called oscillating unless |rho| >= max(SWING_AUTOCORR (0.3), 2.5 / sqrt(n))
                      (persistent swings, or an up-down alternation) or noise_rel >=
                      WILD_NOISE_REL (75%), or the gradient norm, when logged, rose to GRAD_SPIKE
                      (4x) its first step's at some step (a model that does not change keeps its
                      gradient norm; too large an update throws it up, and the loss with it):
                      oscillating.
                      "flat" also needs evidence that the model is not changing: validation (>= 2
                      points: the same held-out set each time, so no batch noise), a curve that
                      would have shown a fall of DETECT_REL_DROP (25%) of the first level (the
                      end medians' 2.5 se, or the Mann-Kendall z that a straight fall of that
                      size in this noise is expected to give, at or past -TREND_Z), or a peak
                      learning rate under LOW_LR (1e-5: under AdamW each weight moves about lr a
                      step at most). Without any of them: too_noisy. A flat curve whose learning
                      rate peaked in USUAL_LORA_LR (1e-4 to 3e-4) or above is told to train
                      longer (with the share of an epoch it covered), not to raise the rate
                      into that range
  7. healthy          otherwise; "plateaued" when the last quarter of the run holds under
                      PLATEAU_FRACTION (20%) of the total drop and, with validation, its last
                      interval fell less than half its average interval

Calibration of GRAD_SPIKE and UNIFORM_FRACTION: 8-step runs of SmolLM2-135M-Instruct (the
real-run test's settings, no warmup): the largest gradient norm after step 1 was 1.4x the first
step's at lr 1e-7, 1.3x, 1.3x and 1.6x at lr 1e-4, 3e-4 and 1e-3, and 7.1x at lr 0.01 (which
spiked the loss from 2.05 to 7.9 and came back); at lr 0.03 and 0.1 the loss ended at 1.06x and
1.11x ln V (collapsed towards uniform), at lr 0.3 at 1.7-2.7x. The default run (lr 2e-3 after
warmup, 38 steps, healthy) peaked at 1.7x its first gradient norm.

Calibration of DETECT_REL_DROP: runs that work fall by far more than a quarter (the default run
99%; 20 steps of the real-run test's settings at lr 3e-3 from 2.05 to ~0.5), yet 8 steps of those
settings at lr 3e-3 (batch noise 0.69 nats, a third of the first level) fall 42% without a
significant trend: their expected Mann-Kendall z for a 25% fall is about -0.6, so the curve cannot
tell a working run from a still one, and its old verdict, "flat", told the user to raise a
learning rate that was fine.

Calibration: real LoRA runs (r=8, q/v) of SmolLM2-135M-Instruct on the default dataset
(batch 8, replies of ~8 tokens, so ~60 trained tokens per batch) have batch-to-batch noise of
~0.7-0.9 nats, 30% of the starting level (lr 2e-4, 40 steps: noise 32% of the end level, rho
-0.06, z -4.0; lr 1e-3, 30 steps: rho +0.16, z -4.6; both "healthy"). That is why noise amplitude
alone never decides "oscillating" below 75% of the level. At 20 steps of the real-run test's
settings (~10 trained tokens a batch) lr 1e-3 fell from 2.05 to ~0.3 with noise of 0.7 nats, a
third of the first level and twice the last: against the last level it read "oscillating".

`python -m benchmarks.doctor_sweep` trains such runs and diagnoses each (verdicts, losses, gradient
norms and validation in benchmarks/results/doctor_sweep*.md: 8 steps at nine rates, 24 steps with
and without validation). It runs with XLA's default flags, so the wildest runs end elsewhere than
the figures above (lr 0.1 at 1.67x ln V).
"""

# The doctor by concern: the statistics of a curve, the rules that name its pattern, the command.
from jaxsft.doctor.command import build_parser, diagnose_run, main, parse_args
from jaxsft.doctor.rules import *  # noqa: F403  (the thresholds, PATTERNS, Diagnosis, diagnose)
from jaxsft.doctor.rules import __all__ as _rules_all
from jaxsft.doctor.statistics import _mann_kendall_expected_z, _mann_kendall_z, smooth, smoothing_window

__all__ = [*_rules_all, "build_parser", "diagnose_run", "main", "parse_args", "smooth", "smoothing_window"]
