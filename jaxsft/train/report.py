"""What a run shows and leaves behind for a reader: `finish` (loss curve, doctor, tuned-vs-base
evaluation, summary.json and the summary on stdout, `summary_text`), the `ProgressBar` the loop
updates, and the stderr log handler `main` installs."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import TYPE_CHECKING

from jaxsft import data as data_lib
from jaxsft import evaluate
from jaxsft import flops as flops_lib
from jaxsft import host_memory
from jaxsft import matmul as matmul_lib
from jaxsft import models
from jaxsft import tracking
from jaxsft.run_files import RunFiles
from jaxsft.train.state import RunResult, RunState

if TYPE_CHECKING:  # annotations only: startup.py imports the model and data layers
  from jaxsft.train.startup import Run

log = logging.getLogger("jaxsft.train")


def finish(run: Run, state: RunState, result: RunResult, model) -> None:
  """Loss curve, doctor, tuned-vs-base evaluation, summary."""
  from jaxsft import doctor, plot, run_files
  from jaxsft.collation.summary import summary as collation_summary

  cfg, files = run.cfg, run.files
  try:
    plot.plot_loss_curve(files.dir, files.loss_curve)
  except Exception as e:  # a plot must never cost the run
    log.warning("loss curve not plotted: %s", e)
  result.diagnosis = doctor.diagnose_run(files.dir)
  files.write_text(files.doctor_report, result.diagnosis.report() + "\n")
  generated = None  # what the evaluation's generation compiled
  if cfg.eval.generate and run.data.val_records:
    from jaxsft.collation import compiles as compiles_lib

    before = compiles_lib.ledger().tally()
    base = None
    if cfg.mode == "full":  # the base is the model as loaded, before any update
      base = models.load_causal_lm(cfg.model.name, dtype=str(model.dtype))
    result.evaluation = evaluate.compare_base_and_tuned(model, run.tokenizer, run.data.val_records, cfg, base=base,
                                                       show=not cfg.logging.quiet)
    files.write_json(files.evaluation, result.evaluation)
    generated = compiles_lib.ledger().tally() - before
  summary = {
      "steps": result.steps, "final_loss": result.final_loss, "first_val_loss": result.first_val_loss,
      "val_loss": result.val_loss, "warmup_compiles": result.compiles_warmup, "recompiles": result.recompiles,
      "stopped_early": result.stopped_early, "stopped": result.stopped, "diagnosis": result.diagnosis.pattern,
      **consumed_data(run, state), "seconds": round(time.time() - run.t_start, 1),
      "collation": collation_summary(run.collation, step_seconds=state.step_seconds, generate=generated,
                                     writer=files.writer),
      **run.param_bytes,
  }
  if result.evaluation:
    for name in ("base", "tuned"):
      summary[f"task_score_{name}"] = result.evaluation[name]["score"]
      if "format_rate" in result.evaluation[name]:
        summary[f"format_rate_{name}"] = result.evaluation[name]["format_rate"]
    if "references_cut_short" in result.evaluation:
      summary["references_cut_short"] = result.evaluation["references_cut_short"]
  summary.update(flops_lib.mean_utilization(run_files.read_records(files.metrics)))
  path = matmul_lib.cpu_matmul_path(model.dtype)  # which kernels ran the products (None off a CPU)
  if path:
    summary["matmul_path"] = path
    summary["host_malloc"] = host_memory.setting()  # whether step scratch memory is reused (host_memory)
  files.write_json(files.summary, summary)
  for tag, text in tracking.run_report_markdown(result.diagnosis.report(), result.evaluation).items():
    run.trackers.text(tag, text, result.steps)
  run.trackers.log_adapter(files.tuned(cfg.mode == "full"), f"{files.dir.name}-{cfg.mode}")
  # The results on stdout (logs and the progress bar are on stderr): `... > result.txt` keeps them.
  if cfg.logging.json:
    print(json.dumps(summary, default=str), flush=True)
  elif not cfg.logging.quiet:
    print(summary_text(files, summary, result), flush=True)


def finish_stopped(run: Run, state: RunState, result: RunResult, saved: int | None) -> None:
  """The summary of a run a signal stopped (`stopped: "signal"`): what it reached and where
  `--resume` goes on from (`saved`, the newest checkpoint's step); nothing slow (a preempted
  machine may have seconds left)."""
  from jaxsft import run_files

  files = run.files
  if not files.writer:
    return
  summary = {
      "steps": result.steps, "final_loss": result.final_loss, "first_val_loss": result.first_val_loss,
      "val_loss": result.val_loss, "warmup_compiles": result.compiles_warmup, "recompiles": result.recompiles,
      "stopped_early": False, "stopped": result.stopped, "signal": result.stop_signal, "checkpoint_step": saved,
      "planned_steps": run.total_steps, **consumed_data(run, state),
      "seconds": round(time.time() - run.t_start, 1),
  }
  summary.update(flops_lib.mean_utilization(run_files.read_records(files.metrics)))
  files.write_json(files.summary, summary)
  if run.cfg.logging.json:
    print(json.dumps(summary, default=str), flush=True)
  elif not run.cfg.logging.quiet:
    print(f"\n== jaxsft run stopped by {result.stop_signal} at step {result.steps} of {run.total_steps}: {files.dir} ==\n"
          f"checkpoint: step {saved}   continue with the same command and --resume", flush=True)


def consumed_data(run: Run, state: RunState) -> dict:
  """summary.json's `data` (the pipeline's counts as of the last batch the steps consumed: the
  batches read ahead for steps that never ran are not counted) and, with a `data.mix`, its
  `data_sources`."""
  stats = run.data.stats if state.data_stats is None else data_lib.PipelineStats.of(state.data_stats)
  return {"data": stats.summary(), **data_sources(run, stats)}


def data_sources(run: Run, stats: data_lib.PipelineStats) -> dict:
  """summary.json's `data_sources` with a `data.mix`: per source its path, weight (as given), share
  (normalized), and the examples and trained tokens the run took from it (they sum to the `stats`
  totals: examples read, and labels != -100 of the batches); nothing without a mix."""
  sources, mix = run.cfg.data.mix, run.data.mix
  if not sources or mix is None:
    return {}
  counts = stats.source_counts(len(sources))
  return {"data_sources": [{"path": s.path, "weight": s.weight, "share": round(share, 6), **c}
                           for s, share, c in zip(sources, mix.weights, counts)]}


def _loss_text(value) -> str:
  """A loss for the closing text, to 4 decimals like the step lines (summary.json keeps every digit)."""
  return "none" if value is None else f"{value:.4f}"


def summary_text(files: RunFiles, summary: dict, result: RunResult) -> str:
  lines = [f"\n== jaxsft run finished: {files.dir} ==",
           f"steps {summary['steps']}, final train loss {_loss_text(summary['final_loss'])}, "
           f"val loss {_loss_text(summary['first_val_loss'])} → {_loss_text(summary['val_loss'])}",
           f"compiles: {summary['warmup_compiles']} at warm-up, {summary['recompiles']} after",
           f"data: {summary['data']}"]
  if "task_score_base" in summary:
    cut = summary.get("references_cut_short")
    note = f"; {evaluate.cut_short_text(cut)}" if cut else ""
    lines.append(f"task score: base {summary['task_score_base']:.3f} → tuned {summary['task_score_tuned']:.3f}{note}")
    if "format_rate_tuned" in summary:
      lines.append(f"answer format: base {summary['format_rate_base']:.3f} → tuned {summary['format_rate_tuned']:.3f}")
  if "flops_per_s" in summary:
    mfu = f", MFU {100 * summary['mfu']:.1f}%" if "mfu" in summary else ""
    lines.append(f"throughput: {summary['flops_per_s'] / 1e9:.1f} GFLOP/s (model FLOPs){mfu}")
  if "matmul_path" in summary:
    lines.append(f"matmuls: {summary['matmul_path']}")
  lines.append(result.diagnosis.report(evidence=False))  # the evidence: doctor.txt, named below
  full = files.holds_full_model()
  tuned = files.tuned(full)
  kind = "tuned model (HF format)" if full else "adapter (PEFT format)"
  lines.append(f"{kind}: {tuned}   curve: {files.loss_curve}   doctor: {files.doctor_report}   "
               f"wall time {summary['seconds']}s")
  lines.append(f"chat with it:  python -m jaxsft.chat {files.dir}\n"
               f"export it:     python -m jaxsft.export {files.dir} --out {files.dir}-hf  (--format gguf for llama.cpp)")
  return "\n".join(lines)


class ProgressBar:
  """A tqdm bar with loss, tokens/s and ETA (plain log lines when disabled)."""

  def __init__(self, total: int, initial: int, enabled: bool):
    self.bar = None
    if enabled:
      from tqdm import tqdm

      self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr)

  def update(self, record: dict):
    if self.bar is not None:
      post = {"loss": f"{record['loss']:.4f}", "tok/s": f"{record['tokens_per_s']:.0f}"}
      if "val_loss" in record:
        post["val"] = f"{record['val_loss']:.4f}"
      self.bar.set_postfix(post, refresh=False)
      self.bar.update(1)
    else:
      val = f" val_loss {record['val_loss']:.4f}" if "val_loss" in record else ""
      log.info("step %d loss %.4f%s (%.0f tokens/s)", record["step"], record["loss"], val, record["tokens_per_s"])

  def close(self):
    if self.bar is not None:
      self.bar.close()


class _StderrHandler(logging.StreamHandler):
  """Writes to `sys.stderr` as it is at each record: a caller of `main` that swaps it between
  runs (a test's capture) never leaves the handler writing to a closed stream."""

  @property
  def stream(self):
    return sys.stderr

  @stream.setter
  def stream(self, value):
    pass


def log_to_stderr():
  """jaxsft's INFO lines on stderr, whatever absl or JAX did to the root logger."""
  logger = logging.getLogger("jaxsft")
  if not logger.handlers:
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
