"""`python -m jaxsft.train`: LoRA supervised fine-tuning, the recipe read top to bottom.

    setup:   config → records → tokenized once → bucket shapes → model + LoRA → warm-up compiles
             → resume from the newest checkpoint that restores whole
    loop:    micro-batches → Σ∇nll, Σ nll, Σ valid → clip → AdamW → metrics.jsonl
             → validation, orbax checkpoints (+ Grain iterator state), PEFT adapter
    finish:  final validation, loss curve, doctor, tuned-vs-base evaluation, summary

The step itself (pure functions, optimizer, ahead-of-time compilation) is `jaxsft.step`; what
the run writes is `jaxsft.run_files`. Everything the loop changes lives in one `RunState`.

    recipe.py       `train`: setup → loop → finish, `main` (the command line)
    startup.py      `Run`, `setup` and everything before step 1: data, model, adapters, warm-up, resume
    loop.py         `run_loop`: steps, late metrics, validation, checkpoints, `end_of_run`
    report.py       `finish` (curve, doctor, evaluation, summary), `ProgressBar`, the stderr log
    data_plan.py    records, the held-out split, `DataPlan`: one tokenization, the batch shapes
    prefetch.py     `DevicePrefetch`: batches put on the devices while a step runs
    checkpoints.py  `Checkpoints`: orbax saves with the Grain position, damaged ones set aside
    preemption.py   `StopSignals`: SIGTERM / SIGINT finish the step, save a checkpoint and stop
    state.py        `RunState`, `TrainingError`, `RunResult`
"""

from __future__ import annotations

from jaxsft.train.state import RunState, TrainingError
from jaxsft.train.data_plan import DataPlan, load_data, load_file, plan_data
from jaxsft.train.prefetch import DevicePrefetch
from jaxsft.train.checkpoints import Checkpoints, SavedIteratorState
from jaxsft.train.startup import (Run, account_collation, build_steps, param_paths, probe_step_cost, resolve_peak_flops,
                                setup, start_or_resume, trainable_filter, warm_up)
from jaxsft.train.preemption import NoStopSignals, StopSignals
from jaxsft.train.report import ProgressBar, finish, finish_stopped, summary_text
from jaxsft.train.loop import (StepDuties, account_step, all_finite, discard_poisoned_checkpoint, end_of_run,
                               finish_record, record_validation, run_loop, save_checkpoint, save_full_model, save_on_signal,
                               save_tuned, train_step, validate, validate_base)
from jaxsft.train.recipe import RunResult, main, train, train_and_finish

__all__ = [
    "Checkpoints", "DataPlan", "DevicePrefetch", "NoStopSignals", "ProgressBar", "Run", "RunResult", "RunState",
    "SavedIteratorState", "StepDuties", "StopSignals", "TrainingError", "account_collation", "account_step", "all_finite", "build_steps",
    "discard_poisoned_checkpoint", "end_of_run", "finish", "finish_record", "finish_stopped", "load_data", "load_file", "main", "param_paths",
    "plan_data", "probe_step_cost", "record_validation", "resolve_peak_flops", "run_loop", "save_checkpoint",
    "save_full_model", "save_on_signal", "save_tuned", "setup", "start_or_resume", "summary_text", "train", "train_and_finish",
    "train_step", "trainable_filter", "validate", "validate_base", "warm_up",
]
