"""The entry point of the collation decision: `plan` resolves the run's batching (buckets, packing
widths or, with `batching: auto`, the mode) from its token lengths, probing the step's cost first
where the choice needs seconds, and returns it with what the probes compiled (`Collation`)."""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from typing import Any

import numpy as np

from jaxsft import config as config_lib
from jaxsft.collation import choice as choice_lib
from jaxsft.collation import compiles as compiles_lib
from jaxsft.collation import probe as probe_lib
from jaxsft.data.collate import round_up

log = logging.getLogger("jaxsft.train")  # the trainer's log: part of its setup


@dataclasses.dataclass(frozen=True)
class Collation:
  """The plan and what deciding it compiled.

  `batching`: make_batches' batching arguments, buckets resolved (`max_length` lowered to the
  longest example where the shapes were chosen from the lengths); `choice`: what was chosen from
  the lengths, under which cost (None where the config fixed it); `train_lengths`: the training
  lengths plans are priced over (`choice.priced_lengths`); `probes`: what auto's probes compiled and
  timed (None where nothing was probed); `calibration`: this machine's compile seconds for the run's
  programs as found before the run, and the file it is kept in."""

  batching: dict[str, Any]
  choice: choice_lib.Choice | None
  train_lengths: np.ndarray
  probes: probe_lib.Probes | None = None
  calibration: compiles_lib.Calibration = dataclasses.field(default_factory=compiles_lib.Calibration)
  calibration_path: pathlib.Path | None = None


def program_config(cfg: config_lib.TrainConfig) -> dict:
  """The config that shapes the compiled programs (with the batch shape and keys): the model, its
  dtype and quantization, the adapters, the optimizer, what trains and the mesh."""
  return {"model": dataclasses.asdict(cfg.model), "lora": dataclasses.asdict(cfg.lora) if cfg.mode == "lora" else None,
          "optim": dataclasses.asdict(cfg.optim), "mode": cfg.mode, "trainable": cfg.trainable,
          "mesh": dataclasses.asdict(cfg.mesh)}


def load_calibration(cfg: config_lib.TrainConfig) -> tuple[compiles_lib.Calibration, pathlib.Path]:
  """(this machine's compile calibration for the run's programs, its file)."""
  from jaxsft.models.hub import jaxsft_cache

  path = compiles_lib.Calibration.path(jaxsft_cache(), compiles_lib.calibration_key(
      compiles_lib.machine_description(), program_config(cfg)))
  return compiles_lib.Calibration.load(path), path


def base_batching(d: config_lib.DataConfig, batch_multiple_of: int) -> dict[str, Any]:
  """make_batches' batching arguments as the config sets them (buckets not resolved yet)."""
  return dict(max_length=d.max_length, batching=d.batching, bucket_lengths=list(d.bucket_lengths) if d.bucket_lengths else None,
              num_buckets=d.num_buckets, batch_size=d.batch_size, tokens_per_batch=d.tokens_per_batch,
              pad_to_multiple_of=d.pad_to_multiple_of, batch_multiple_of=batch_multiple_of, train_on=d.train_on)


RESOLVED_KEYS = ("batching", "bucket_lengths", "max_length")
"""The keys of a resolved batching that decide its batches from the config's batch sizes (what a
run records at its start, `resolved`, and a resumed run keeps)."""


def resolved(batching: dict[str, Any]) -> dict[str, Any]:
  """The collation a run's batches come from: `batching`'s RESOLVED_KEYS."""
  return {key: batching[key] for key in RESOLVED_KEYS}


def plan(cfg: config_lib.TrainConfig, train_tokens, val_tokens, *, batch_multiple_of: int,
         target: probe_lib.ProbeTarget | None = None, train_lengths: np.ndarray | None = None,
         resumed: dict[str, Any] | None = None) -> Collation:
  """The run's collation over its tokenized splits (`TokenizedRecords`).

  Where the config leaves the shapes to the lengths (bucketed or bucketed packing without
  `bucket_lengths`, or auto), one set of boundaries serves train and validation (the evaluation
  reuses the train shapes) and the largest is the longest example, so no bucket is compiled that no
  batch would use. With `batching: auto` or `num_buckets: auto` and a `target`, the probes compile
  and time three shapes first and the choice is priced with their fit; otherwise with the default
  cost. With a `target` (the trainer's plan), this machine's compile calibration is loaded too.
  `train_lengths`: the lengths one training epoch reads, in its order, where the caller knows them
  better than the configured batching's order of `train_tokens` (a `data.mix` epoch).

  `resumed`: the collation (`resolved`) of the run a checkpoint continues. Its data position belongs
  to those batches, so where the config leaves the collation to the lengths or timings, it is kept,
  not chosen again (a choice made over another max_steps, or on other timings, could differ); a
  config that fixes another collation is refused.
  """
  d = cfg.data
  calibration, path = load_calibration(cfg) if target is not None else (compiles_lib.Calibration(), None)
  batching = base_batching(d, batch_multiple_of)
  if train_lengths is None:
    train_lengths = choice_lib.priced_lengths(d.batching, train_tokens, seed=d.seed)
  if resumed is not None:
    return Collation(keep_resumed(d, batching, resumed), None, train_lengths, None, calibration, path)
  if d.batching not in choice_lib.CHOOSES_FROM_LENGTHS or d.bucket_lengths:
    return Collation(batching, None, train_lengths, None, calibration, path)
  lengths = np.concatenate([train_lengths, val_tokens.lengths])
  batching["max_length"] = min(d.max_length, round_up(int(lengths.max()), d.pad_to_multiple_of))
  probes = None
  if target is not None and probe_lib.chosen_on_timings(d):
    probes = probe_lib.probe(cfg, target, batching["max_length"], calibration)
  choice = choice_lib.choose(cfg, lengths, num_train=len(train_lengths), max_length=batching["max_length"],
                             batch_size_for=choice_lib.batch_size_rule(d, batch_multiple_of),
                             cost=probes.cost if probes else None)
  batching.update(choice.batching)
  return Collation(batching, choice, train_lengths, probes, calibration, path)


def keep_resumed(d: config_lib.DataConfig, batching: dict[str, Any], resumed: dict[str, Any]) -> dict[str, Any]:
  """`batching` with the resumed run's collation (see `plan`); a `ConfigError` where the config fixes
  another one."""
  if d.batching in choice_lib.CHOOSES_FROM_LENGTHS and not d.bucket_lengths and resumed["max_length"] <= d.max_length:
    log.info("collation: %s %s, as this run chose at its start (a resumed run does not choose again: "
             "its checkpoint's data position belongs to those batches)", resumed["batching"],
             resumed["bucket_lengths"] or "")
    return {**batching, **resumed}
  if resolved(batching) != resumed:  # another fixed collation, or examples cut shorter than the run's
    raise config_lib.ConfigError(
        f"--resume: the checkpoints' data position belongs to the batches of {_described(resumed)}, the "
        f"collation this run started with; this config gives {_described(resolved(batching))}. Resume "
        f"with the data settings the run started with (data.batching, data.bucket_lengths, data.max_length).")
  return batching


def _described(collation: dict[str, Any]) -> str:
  buckets = f" {collation['bucket_lengths']}" if collation["bucket_lengths"] else ""
  return f"{collation['batching']}{buckets} at max_length {collation['max_length']}"
