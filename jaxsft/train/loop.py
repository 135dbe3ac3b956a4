"""The training loop, step 1 to the end: `run_loop` dispatches each optimizer step (`train_step`),
finishes its record one step late (`finish_record`, `account_step`) or at once when the step has
duties (`StepDuties`), validates (`record_validation`) and saves checkpoints with the adapter or
full model (`save_checkpoint`) when due; `end_of_run` adds the last validation, epoch line and
checkpoint."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import jax
import numpy as np
from flax import nnx

from jaxsft import flops as flops_lib
from jaxsft import models
from jaxsft import sharding as sharding_lib
from jaxsft import step as step_lib
from jaxsft.train.prefetch import DevicePrefetch
from jaxsft.train.report import ProgressBar
from jaxsft.train.state import RunState, TrainingError

if TYPE_CHECKING:  # annotations only: setup and the loop are peers that the recipe joins
  from jaxsft.config import TrainConfig
  from jaxsft.train.preemption import StopSignals
  from jaxsft.train.startup import Run

log = logging.getLogger("jaxsft.train")


def validate(run: Run, state: RunState) -> float | None:
  """Held-out Σ nll / Σ valid over every validation batch (None without held-out records)."""
  if not run.data.val_records:
    return None
  nll, n = 0.0, 0
  for batch in run.data.val_batches(run.tokenizer):
    s, c = run.steps.evaluate(state.trainable, run.frozen, run.mesh.put_batch({k: batch[k] for k in step_lib.BATCH_KEYS if k in batch}))
    nll, n = nll + s, n + c  # summed on the device: no wait per batch
  return float(nll) / max(int(n), 1)


def record_validation(run: Run, state: RunState, record: dict) -> None:
  """Validates at `state.step`, adds `val_loss` to `record`, updates best/patience bookkeeping."""
  state.val_loss, state.val_step = validate(run, state), state.step
  if state.val_loss is None:
    return
  record["val_loss"] = state.val_loss
  if state.first_val_loss is None:
    state.first_val_loss = state.val_loss
  if state.best_val is None or state.val_loss < state.best_val:
    state.best_val, state.bad_evals = state.val_loss, 0
  else:
    state.bad_evals += 1


def train_step(run: Run, state: RunState, batches: DevicePrefetch) -> dict | None:
  """Dispatches one optimizer step over `grad_accum` micro-batches and returns its record, the
  device's metrics not read yet (`finish_record` waits for them); None when the data ran out
  before a single micro-batch.

  With `grad_accum` 1 the step is one executable (`CompiledSteps.train_step`); with more, the
  micro-batches chain `accumulate` calls on the device and `apply` ends the step. Nothing here
  waits for the device, so the host fetches the next batch while the step runs.
  """
  t_step = time.time()
  wait, tokens, real, epochs_seen, micro, shapes = 0.0, 0, 0, [], [], []
  for _ in range(run.cfg.optim.grad_accum):
    t_wait = time.time()
    try:
      batch, host, state.data_state = next(batches)
    except StopIteration:  # the data ran out: every batch the pipeline made was consumed
      state.data_stats = dataclasses.asdict(run.data.stats)
      break
    wait += time.time() - t_wait
    state.data_stats = host.get("data_stats", state.data_stats)
    micro.append(batch)
    tokens += host["shape"][0] * host["shape"][1]
    shapes.append(host["shape"])
    real += host["real_tokens"]
    epochs_seen.append(host["epoch"])
  if not epochs_seen:
    return None
  first = np.int32(state.step * run.cfg.optim.grad_accum)  # micro-batch index: the dropout key
  if run.cfg.optim.grad_accum == 1:
    state.trainable, state.opt_state, out = run.steps.train_step(state.trainable, state.opt_state, run.frozen, micro[0], first)
  else:
    acc = run.steps.zeros(state.trainable)
    for i, batch in enumerate(micro):
      acc = run.steps.accumulate(acc, state.trainable, run.frozen, batch, first + np.int32(i))
    state.trainable, state.opt_state, out = run.steps.apply(state.trainable, state.opt_state, acc)
  state.step += 1
  return {"step": state.step, "tokens": tokens, "real_tokens": real, "data_wait_s": round(wait, 4),
          "epoch": epochs_seen[-1], "device_out": out, "dispatched_at": t_step, "shapes": shapes}


def finish_record(run: Run, state: RunState, record: dict, since: float) -> float:
  """Waits for the step's device metrics and completes `record` in place (loss, lr, grad norm,
  valid tokens, throughput); returns when the step was seen done.

  `seconds` runs from `since` (the previous step seen done, or this step's dispatch when that
  was later: after a validation or a checkpoint) to now, so with steps in flight back to back
  the seconds add up to the wall time; they add to `state.step_seconds`.
  """
  out, dispatched_at, shapes = record.pop("device_out"), record.pop("dispatched_at"), record.pop("shapes")
  out = {k: np.asarray(v) for k, v in jax.device_get(out).items()}
  done = time.time()
  tokens, real = record["tokens"], record["real_tokens"]
  if jax.process_count() > 1:  # each process counted its own rows; the device sums are global
    tokens, real = (int(x) for x in sharding_lib.sum_over_processes([tokens, real]))
  valid = int(out["n_valid"])  # the loss's own (shifted) count
  seconds = max(done - max(since, dispatched_at), 1e-9)
  state.step_seconds += seconds
  record.update({
      "loss": float(out["loss"]), "lr": float(out["lr"]), "grad_norm": float(out["grad_norm"]),
      "tokens": tokens, "real_tokens": real, "valid_tokens": valid,
      "padding_fraction": round(1 - real / max(tokens, 1), 4),
      "tokens_per_s": round(real / seconds, 1), "valid_tokens_per_s": round(valid / seconds, 1),
      "compiles": run.steps.recompiles, "seconds": round(seconds, 4),
      "elapsed_s": round(done - run.t_start, 2), "finite": bool(out["finite"]), "nll": float(out["nll"]),
  })
  if run.flop_count is not None:
    # Every process ran the same (B, T) shapes on its rows of the global batch.
    flops = run.flop_count.step(shapes, valid) + (jax.process_count() - 1) * sum(run.flop_count.layers(*s) for s in shapes)
    record["flops"] = flops
    record.update(flops_lib.utilization(flops, seconds, run.peak_flops, jax.device_count()))
  return done


def account_step(run: Run, state: RunState, record: dict) -> None:
  """Non-finite streaks, epoch averages (Σ nll / Σ valid of the epoch's steps) and the last loss.

  Runs on a finished record, possibly one step late (the next step already dispatched): it
  names `record["step"]`, never the loop's current step.
  """
  nll, finite = record.pop("nll"), record.pop("finite")
  if not finite:
    state.nonfinite_in_row += 1
    record["skipped"] = True
    log.warning("step %d: non-finite loss or gradient (loss=%s, grad_norm=%s): update skipped",
                record["step"], record["loss"], record["grad_norm"])
    if state.nonfinite_in_row >= run.cfg.max_nonfinite_steps:
      run.files.log(record)
      kept = discard_poisoned_checkpoint(run, state, first_bad_step=record["step"] - state.nonfinite_in_row + 1)
      raise TrainingError(
          f"{state.nonfinite_in_row} consecutive steps with a non-finite loss or gradient (step {record['step']}); "
          f"stopping. Lower the learning rate or check the data. " +
          (f"The newest good checkpoint (step {kept}) and its adapter are kept." if kept is not None else
           "No checkpoint with finite weights was saved before the run diverged."))
    return
  state.nonfinite_in_row = 0
  if record["epoch"] != state.epoch and state.epoch_valid:
    # Logged with this step (the first of the new epoch): a resume that redoes this step drops the
    # line with the step's other metrics and logs it again.
    run.files.log({"step": record["step"], "epoch": state.epoch, "epoch_loss": state.epoch_nll / state.epoch_valid})
    state.epoch, state.epoch_nll, state.epoch_valid = record["epoch"], 0.0, 0
  state.epoch_nll += nll
  state.epoch_valid += record["valid_tokens"]
  state.last_loss = record["loss"]


def all_finite(tree) -> bool:
  """Every value of `tree` finite, checked on the host (no new executable after warm-up)."""
  return all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(jax.device_get(tree))
             if np.issubdtype(np.asarray(x).dtype, np.inexact))


def save_checkpoint(run: Run, state: RunState) -> bool:
  """Saves a checkpoint and the adapter (or the full model) of `state`, only after a finite,
  applied update and with finite weights and optimizer state: a diverging run never rotates
  its last good checkpoints out for poisoned ones. Returns whether it saved."""
  if state.nonfinite_in_row:
    log.warning("step %d: no checkpoint saved: the step's update was skipped (non-finite)", state.step)
    return False
  if not all_finite((state.trainable, state.opt_state)):
    log.warning("step %d: no checkpoint saved: the weights or the optimizer state hold non-finite values", state.step)
    return False
  run.checkpoints.save(state)
  state.last_saved_step = state.step
  save_tuned(run, state.trainable)
  return True


def discard_poisoned_checkpoint(run: Run, state: RunState, first_bad_step: int) -> int | None:
  """When the run diverged right after a checkpoint it saved itself (every loss of the streak was
  computed at the saved weights, the updates in between being skipped), that checkpoint is no
  good: it is deleted and the adapter (or full model) rewritten from the newest one left. A
  checkpoint the run resumed from is kept (the streak may come from something else, e.g. another
  base model). Returns the step of the newest good one."""
  checkpoints = run.checkpoints
  checkpoints.manager.wait_until_finished()
  newest = checkpoints.manager.latest_step()
  if newest is None or newest != first_bad_step - 1 or newest != state.last_saved_step:
    return newest
  log.warning("checkpoint %d: its weights gave a non-finite loss at step %d; deleting it", newest, first_bad_step)
  checkpoints.manager.delete(newest)
  good = checkpoints.manager.latest_step()
  if good is None:
    run.files.remove_tuned()
    return None
  restored = checkpoints._restore(good, state, lambda data_state: None)
  save_tuned(run, restored.trainable)
  return good


def save_tuned(run: Run, trainable) -> None:
  """The tuned weights where `RunFiles.tuned` puts them for the run's mode: the full model or
  the adapter."""
  if run.cfg.mode == "full":
    save_full_model(run, run.model(trainable))
  else:  # the adapter is the LoRA params alone: the frozen base stays as the steps hold it
    # The tokenizer goes beside it only where its chat template is not the base's own (a
    # model.chat_template, or the plain one of a base without any): an adapter of the base's own
    # template stays its two files.
    own_template = run.cfg.model.chat_template is None and getattr(run.tokenizer, "chat_template", None)
    run.files.save_adapter(nnx.merge(run.graphdef, trainable, run.frozen), run.cfg.model.name,
                           None if own_template else run.tokenizer)


def save_full_model(run: Run, model) -> None:
  """mode=full: the whole tuned model as a Hugging Face folder (RUN_DIR/model), swapped in whole."""
  if not run.files.writer:
    return
  from jaxsft import export
  from jaxsft.data.template import as_trained

  tensors = {k: np.asarray(v) for k, v in models.to_hf_state_dict(model).items()}
  dtype = str(np.dtype(next(iter(tensors.values())).dtype))
  run.files.save_full_model(lambda tmp: export.write_hf(
      tmp, model.config, tensors, as_trained(run.tokenizer), "bfloat16" if dtype == "bfloat16" else "float32"))


@dataclasses.dataclass(frozen=True)
class StepDuties:
  """What a dispatched step does besides its update: validate (every `eval.eval_every` steps and
  at the last step) and save a checkpoint (every `save_every` steps before the last; the last
  one is `end_of_run`'s)."""

  validate: bool
  save: bool

  @classmethod
  def at(cls, cfg: TrainConfig, step: int, total_steps: int) -> "StepDuties":
    last = step == total_steps
    return cls(validate=bool(cfg.eval.eval_every and step % cfg.eval.eval_every == 0) or last,
               save=bool(cfg.save_every and step % cfg.save_every == 0) and not last)

  @property
  def read_now(self) -> bool:
    """The step's metrics are read at once, not one step late: its params are read next."""
    return self.validate or self.save


def validate_base(run: Run, state: RunState) -> None:
  """The base model's held-out loss (step 0): the point every later validation is compared with."""
  record = {"step": 0}
  record_validation(run, state, record)
  run.files.log(record)
  log.info("validation loss before training: %.4f", state.val_loss)


STOPPED_COMPLETED, STOPPED_EARLY, STOPPED_BY_SIGNAL = "completed", "early_stopping", "signal"
"""Why a run's loop ended (summary.json's `stopped`): its planned steps or the end of the data,
early stopping on the validation loss, or SIGTERM / SIGINT (`preemption.StopSignals`)."""


def run_loop(run: Run, state: RunState, batches: DevicePrefetch, stop: StopSignals | None = None) -> str:
  """Steps until `total_steps`, early stopping, the end of the data or a stop signal; returns why
  it stopped (`STOPPED_COMPLETED`, `STOPPED_EARLY` or `STOPPED_BY_SIGNAL`).

  `stop` is asked at each step boundary: once a signal came, the step in flight is finished and
  logged and the loop returns (the caller saves the checkpoint).

  A step's metrics are read one step late: step N's record is finished (logged, non-finite
  streak and epoch sums updated) after step N + 1 is dispatched, so the device never waits for
  the host. A step that validates, saves a checkpoint or ends the run (`StepDuties.read_now`) is
  finished at once, before anything reads the params it produced.
  """
  cfg = run.cfg
  if state.step == 0 and run.data.val_records and cfg.eval.eval_every:
    validate_base(run, state)
  progress = ProgressBar(run.total_steps, state.step, cfg.progress)
  warned_recompiles = 0
  last_done = time.time()

  def complete(record: dict) -> None:
    nonlocal last_done, warned_recompiles
    last_done = finish_record(run, state, record, last_done)
    account_step(run, state, record)
    if run.steps.recompiles > warned_recompiles:
      warned_recompiles = run.steps.recompiles
      log.warning("step %d: the train step compiled again after warm-up (%d in all; unexpected: %s)",
                  record["step"], run.steps.recompiles, run.steps.unexpected_shapes[-3:])

  pending = None  # the dispatched step whose record is finished after the next dispatch

  def finish_pending() -> None:
    nonlocal pending
    if pending is not None:
      complete(pending)
      run.files.log(pending)
      progress.update(pending)
      pending = None

  try:
    while state.step < run.total_steps:
      if stop is not None and stop.requested():
        finish_pending()
        log.warning("stopping at step %d on %s%s", state.step, stop.signal_name(),
                    "" if stop.received else " (another process's)")
        return STOPPED_BY_SIGNAL
      record = train_step(run, state, batches)
      finish_pending()
      if record is None:
        log.warning("the data ran out after %d of %d planned steps", state.step, run.total_steps)
        break
      due = StepDuties.at(cfg, state.step, run.total_steps)
      if not due.read_now:
        pending = record
        continue
      complete(record)
      if due.validate:
        record_validation(run, state, record)
      run.files.log(record)
      progress.update(record)
      if due.save:
        save_checkpoint(run, state)
      last_done = time.time()  # validation and checkpoint time is no step's time
      patience = cfg.eval.early_stopping_patience
      if due.validate and patience and state.bad_evals >= patience:
        log.info("early stopping at step %d: no better validation loss in %d evaluations", state.step, patience)
        return STOPPED_EARLY
    return STOPPED_COMPLETED
  finally:
    progress.close()
    # A step may still run on the device (the loop raised a step late): let it end before the
    # caller tears down, so no XLA thread outlives the interpreter.
    jax.block_until_ready((state.trainable, state.opt_state))


def save_on_signal(run: Run, state: RunState) -> None:
  """The checkpoint of a run stopped by a signal, at the step it finished (the data position and
  the epoch sums included, so `--resume` goes on exactly); none when that step is already saved
  (a signal before the first step after a resume) or no step ran."""
  if state.step == 0 or state.step == state.last_saved_step or state.step in run.checkpoints.manager.all_steps():
    return
  if save_checkpoint(run, state):
    log.info("step %d: checkpoint saved (--resume continues from it)", state.step)


def end_of_run(run: Run, state: RunState) -> None:
  """A validation at the last step (when the data ran out before a planned one), the last
  (possibly unfinished) epoch's average, and the final checkpoint."""
  if run.data.val_records and state.step > 0 and state.val_step != state.step:
    record = {"step": state.step}
    record_validation(run, state, record)
    run.files.log(record)
  if state.epoch_valid:
    # Its sums stay in the checkpoint, so a resume that continues the epoch reports its whole
    # average; this line is then dropped (see `RunFiles.truncate_metrics`).
    run.files.log({"step": state.step, "epoch": state.epoch, "epoch_loss": state.epoch_nll / state.epoch_valid,
                   "end_of_run": True})
  save_checkpoint(run, state)
