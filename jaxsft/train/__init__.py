"""`python -m jaxsft.train`: LoRA supervised fine-tuning, the recipe read top to bottom.

    setup:   config → records → tokenized once → collation planned → model + LoRA → warm-up compiles
             → resume from the newest checkpoint that restores whole
    loop:    micro-batches → Σ∇nll, Σ nll, Σ valid → clip → AdamW → metrics.jsonl
             → validation, orbax checkpoints (+ Grain iterator state), PEFT adapter
    finish:  final validation, loss curve, doctor, tuned-vs-base evaluation, summary

The step itself (pure functions, optimizer, ahead-of-time compilation) is `jaxsft.step`; which
batch shapes the run uses and what they cost is `jaxsft.collation`; what the run writes is
`jaxsft.run_files`. What stays fixed after setup is one frozen `Run`; everything the loop changes
lives in one `RunState`.

    command.py      `main`: the command line, its arguments read before the trainer is imported
    recipe.py       `train`: setup → loop → finish; `run_command`, the command line's run
    startup.py      `Run`, `setup` and everything before step 1: data, model, adapters, warm-up, resume
    loop.py         `run_loop`: steps, late metrics, validation, checkpoints, `end_of_run`
    report.py       `finish` (curve, doctor, evaluation, summary), `ProgressBar`, the stderr log
    data_plan.py    records, the held-out split, `DataPlan`: one tokenization, the collation's batch shapes
    prefetch.py     `DevicePrefetch`: batches put on the devices while a step runs
    checkpoints.py  `Checkpoints`: orbax saves with the Grain position, damaged ones set aside
    preemption.py   `StopSignals`: SIGTERM / SIGINT finish the step, save a checkpoint and stop
    finished.py     a `--resume` of a run with nothing left to train: its summary shown, nothing redone
    state.py        `RunState`, `TrainingError`, `RunResult`

The package exports the entry points and what `train` returns, each imported on first use (so
`python -m jaxsft.train --help` loads no JAX); the parts are imported from the module that
defines them.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"main": "jaxsft.train.command", "train": "jaxsft.train.recipe", "RunResult": "jaxsft.train.state"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
  if name in _EXPORTS:
    return getattr(importlib.import_module(_EXPORTS[name]), name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
