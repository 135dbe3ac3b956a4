"""`loss_curve.png`: training loss (raw and smoothed) and validation loss against step.

matplotlib is imported lazily with the Agg backend (no display needed), and the PNG is written
atomically (`io.atomic_write`), so a reader never sees half an image.
"""

from __future__ import annotations

import os
import pathlib

import numpy as np

from jaxsft import doctor, io, run_files


def plot_loss_curve(run_dir_or_metrics, out_png: str | os.PathLike | None = None) -> pathlib.Path:
  """Plot the loss curve of a run.

  Args:
    run_dir_or_metrics: a run folder holding metrics.jsonl, the metrics.jsonl path, or already
      loaded metrics (a `run_files.MetricsLog`).
    out_png: where to write; default `loss_curve.png` beside the metrics file.

  The raw per-step loss is drawn faint, with the doctor's rolling median on top (window
  clip(n // 10, 5, 51), odd); epoch ends are dashed vertical lines when known.
  """
  if isinstance(run_dir_or_metrics, run_files.MetricsLog):
    log = run_dir_or_metrics
  else:
    log = run_files.read_metrics(run_dir_or_metrics)
  epoch_ends = log.epoch_end_steps
  if not epoch_ends and log.steps_per_epoch and log.train_steps:  # only the epoch length known
    spe, first = log.steps_per_epoch, log.train_steps[0]
    epoch_ends = list(range(first + spe - 1, log.train_steps[-1] + 1, spe))
  if out_png is None:
    if log.path is None:
      raise ValueError("plot_loss_curve: out_png is required when passing loaded metrics")
    out_png = run_files.RunFiles(log.path.parent, writer=False).loss_curve
  out_png = pathlib.Path(out_png)

  # Lazily (slow to import, and only the end of a run needs it); an Agg canvas on a bare Figure
  # leaves pyplot and the user's backend alone.
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  fig = Figure(figsize=(8, 4.5), dpi=110)
  FigureCanvasAgg(fig)
  ax = fig.add_subplot()
  steps = np.asarray(log.train_steps, dtype=np.float64)
  loss = np.asarray(log.train_loss, dtype=np.float64)
  finite = np.isfinite(loss)
  if steps.size:
    ax.plot(steps, loss, color="tab:blue", alpha=0.3, linewidth=1, label="train (per step)")
    if finite.sum() >= 5:
      window = doctor.smoothing_window(int(finite.sum()))
      ax.plot(steps[finite], doctor.smooth(loss[finite], window), color="tab:blue", linewidth=2,
              label=f"train (rolling median, {window} steps)")
    if (~finite).any():
      bottom = np.nanmin(loss[finite]) if finite.any() else 0.0
      ax.scatter(steps[~finite], np.full((~finite).sum(), bottom), marker="x", color="tab:red",
                 label="non-finite loss", zorder=3)
  if log.val_steps:
    ax.plot(log.val_steps, log.val_loss, color="tab:orange", marker="o", markersize=4, linewidth=2,
            label="validation")
  for i, step in enumerate(epoch_ends):
    ax.axvline(step, color="gray", linestyle="--", linewidth=1, label="epoch end" if i == 0 else None)
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats / token)")
  ax.set_title("loss curve" + (f" — {log.path.parent.name}" if log.path is not None else ""))
  ax.grid(alpha=0.3)
  ax.legend(loc="upper right")
  fig.tight_layout()

  return io.atomic_write(out_png, lambda f: fig.savefig(f, format="png"), binary=True)
