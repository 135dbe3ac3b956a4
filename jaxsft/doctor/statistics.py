"""The doctor's statistics: robust smoothing, per-step noise and the Mann-Kendall trend test
(pure numpy; the formulas are in the package docstring)."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def smooth(values: Sequence[float], window: int) -> np.ndarray:
  """Centered rolling median; windows shrink at the ends (robust to single-step spikes)."""
  x = np.asarray(values, dtype=np.float64)
  half = max(int(window), 1) // 2
  if x.size == 0 or half == 0:
    return x.copy()
  padded = np.pad(x, half, constant_values=np.nan)
  windows = np.lib.stride_tricks.sliding_window_view(padded, 2 * half + 1)
  return np.nanmedian(windows, axis=1)


def _noise(x: np.ndarray, window: int) -> tuple[float, float]:
  """Per-step noise from each point's distance to the median of its neighbours: (robust, rms).

  The robust one (MAD) is the typical batch-to-batch noise; the rms one also counts spikes and
  excursions, which move the end medians, so the standard error uses it.

  The point itself is left out of its window (so the residual is not shrunk towards it), and
  the spread of a median of m Gaussian neighbours (variance ~ pi/2 sigma^2 / m) is divided out.
  """
  half = window // 2
  padded = np.pad(x, half, constant_values=np.nan)
  windows = np.lib.stride_tricks.sliding_window_view(padded, 2 * half + 1).copy()
  windows[:, half] = np.nan
  resid = x - np.nanmedian(windows, axis=1)
  correction = math.sqrt(1 + math.pi / 2 / (2 * half))
  mad = 1.4826 * float(np.median(np.abs(resid - np.median(resid))))
  rms = float(np.sqrt(np.mean(np.square(resid))))
  return max(mad / correction, 1e-12), max(rms / correction, 1e-12)


def _mann_kendall_z(x: np.ndarray, max_points: int = 400) -> float:
  """Mann-Kendall trend statistic: z < -3 is a significant decrease (any monotone shape).

  Long series are first reduced to `max_points` block medians (the test is O(n^2)).
  """
  if x.size > max_points:
    x = np.array([np.median(b) for b in np.array_split(x, max_points)])
  n = x.size
  i, j = np.triu_indices(n, 1)
  s = float(np.sign(x[j] - x[i]).sum())
  var = n * (n - 1) * (2 * n + 5) / 18.0
  return (s - math.copysign(1.0, s)) / math.sqrt(var) if s else 0.0


def _lag1_autocorrelation(x: np.ndarray) -> float:
  """Lag-1 autocorrelation around a straight-line fit: ~0 (+-1/sqrt(n)) for batch noise alone."""
  t = np.arange(x.size, dtype=np.float64)
  r = x - np.polyval(np.polyfit(t, x, 1), t)
  denom = float(np.dot(r, r))
  return float(np.dot(r[:-1], r[1:]) / denom) if denom > 0 else 0.0


def smoothing_window(n: int) -> int:
  """The rolling-median window for n points: clip(n // 10, 5, 51), made odd (centered)."""
  w = int(np.clip(n // 10, 5, 51))
  return w if w % 2 else w + 1


def _mann_kendall_expected_z(n: int, fall: float, noise: float, max_points: int = 400) -> float:
  """The Mann-Kendall z that a straight fall of `fall` over n points, with Gaussian noise of
  std `noise`, is expected to give (0 for no fall, <= -3 when the test would usually see it).

  With d = fall / (n - 1) a step, the pair k steps apart has x_j - x_i ~ N(-k d, 2 noise^2), so
  E[sign(x_j - x_i)] = -erf(k d / (2 noise)), E[S] = -sum_k (n - k) erf(k d / (2 noise)), and the
  expected z is E[S] / sd(S) (no continuity correction: a mean, not a test).
  Beyond `max_points` the test reads block medians (`_mann_kendall_z`): fewer, quieter points.
  """
  if n > max_points:
    noise *= math.sqrt(math.pi / 2 * max_points / n)  # a median of m Gaussian points: pi/2 sigma^2 / m
    n = max_points
  if n < 2:
    return 0.0
  k = np.arange(1, n)
  d = fall / (n - 1)
  s = -float(np.sum((n - k) * np.vectorize(math.erf)(k * d / (2 * max(noise, 1e-12)))))
  var = n * (n - 1) * (2 * n + 5) / 18.0
  return s / math.sqrt(var)
