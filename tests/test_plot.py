"""loss_curve.png from a metrics file."""

import dataclasses
import json
import struct

import numpy as np
import pytest

from jaxsft.run_files import read_metrics
from jaxsft.plot import plot_loss_curve

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(path):
  data = path.read_bytes()
  assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
  return struct.unpack(">II", data[16:24])


def _write_metrics(run_dir):
  rng = np.random.default_rng(0)
  lines = [{"event": "config", "steps_per_epoch": 30}]
  for step in range(1, 91):
    line = {"step": step, "loss": float((0.8 + 2 * np.exp(-step / 15)) * (1 + 0.1 * rng.standard_normal()))}
    if step % 10 == 0:
      line["val_loss"] = float(1.0 + 1.8 * np.exp(-step / 20))
    lines.append(line)
    if step % 30 == 0:
      lines.append({"step": step, "epoch": step // 30, "epoch_loss": 1.0})
  lines[40]["loss"] = float("nan")  # a skipped step is drawn as a marker, not a gap in the axis
  run_dir.mkdir()
  (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
  return run_dir


def test_plot_writes_a_png_beside_the_metrics(tmp_path):
  run = _write_metrics(tmp_path / "run")
  out = plot_loss_curve(run)
  assert out == run / "loss_curve.png"
  width, height = _png_size(out)
  assert width > 300 and height > 200 and out.stat().st_size > 5000
  assert sorted(p.name for p in run.iterdir()) == ["loss_curve.png", "metrics.jsonl"]  # no temp left


def test_plot_from_loaded_metrics_and_explicit_path(tmp_path):
  run = _write_metrics(tmp_path / "run")
  out = plot_loss_curve(read_metrics(run), tmp_path / "plots" / "curve.png")
  assert out.is_file() and _png_size(out)[0] > 300
  with pytest.raises(ValueError, match="out_png is required"):  # metrics built in memory have no folder
    plot_loss_curve(dataclasses.replace(read_metrics(run), path=None))


def test_plot_missing_metrics_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="no metrics file"):
    plot_loss_curve(tmp_path, tmp_path / "x.png")
  assert not (tmp_path / "x.png").exists()
