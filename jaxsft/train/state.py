"""What a run carries from step to step: `RunState`, everything the loop changes (and a checkpoint
holds), `TrainingError`, raised when the run cannot go on, and `RunResult`, what a run ends with."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxsft.errors import JaxsftError


class TrainingError(JaxsftError, RuntimeError):
  """The run cannot go on (too many non-finite steps, no checkpoint to resume); saved state is kept."""


@dataclasses.dataclass
class RunState:
  """Everything the loop changes. Checkpoints hold `trainable`, `opt_state`, `data_state` and the
  scalars (`scalars()`); a resume restores all of them and continues exactly. `step_seconds` and
  `last_saved_step` are this process's and not in a checkpoint."""

  trainable: Any  # the LoRA factors, or every param in full mode
  opt_state: Any
  step: int = 0
  data_state: Any = None  # the Grain iterator's state after the last consumed batch
  epoch: int = 0
  epoch_nll: float = 0.0  # Σ nll and Σ valid of the current epoch's steps (the device's counts)
  epoch_valid: int = 0
  first_val_loss: float | None = None
  best_val: float | None = None
  bad_evals: int = 0
  nonfinite_in_row: int = 0
  last_loss: float | None = None
  val_loss: float | None = None
  val_step: int | None = None  # the step `val_loss` was measured at
  data_stats: dict | None = None  # the pipeline's counters as of the last consumed batch
  # This process's own, never checkpointed (a resumed run starts them afresh):
  step_seconds: float = 0.0  # Σ of the steps' `seconds` this process ran
  last_saved_step: int | None = None  # the newest checkpoint this process saved (not one it resumed from)

  SCALARS = ("epoch", "epoch_nll", "epoch_valid", "first_val_loss", "best_val", "bad_evals",
             "nonfinite_in_row", "last_loss", "val_loss", "val_step", "data_stats")

  def scalars(self) -> dict[str, Any]:
    return {name: getattr(self, name) for name in self.SCALARS}


@dataclasses.dataclass
class RunResult:
  """What `train` returns: where the run is, how far it got, and what finish found."""

  output_dir: str
  steps: int
  final_loss: float | None
  val_loss: float | None
  first_val_loss: float | None
  compiles_warmup: int
  recompiles: int
  stopped_early: bool
  diagnosis: Any = None
  evaluation: dict | None = None
  stopped: str = "completed"  # "completed", "early_stopping" or "signal" (summary.json's `stopped`)
  stop_signal: str | None = None  # "SIGTERM" or "SIGINT" when stopped == "signal"
