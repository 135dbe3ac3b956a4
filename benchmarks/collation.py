"""Compile-friendly collation study: padding waste against the number of compiled shapes.

    python -m benchmarks.collation [--quick] [--model smollm2-shaped-4l] [--examples 256]

On each shared data file (`alpaca_en_demo.json`, `chat_multiturn_demo.json`,
`oasst_top_paths.jsonl`) and on jaxsft's built-in task set, a fixed subset of `--examples`
records (the first ones of a seeded permutation) goes through jaxsft's real pipeline
(`jaxsft.collation.make_batches`, SmolLM2-135M-Instruct's tokenizer, max_length 1024, batch size 8)
once per collation mode:

  static            T = max_length
  dynamic x8        T = batch maximum rounded up to a multiple of 8
  bucketed pow2     T = the smallest of 32, 64, ..., max_length that fits
  bucketed K=k      `collation.buckets.choose_buckets`' k boundaries (exact DP over the subset's lengths),
                    k = 2, 4, 8, 16
  packed            first-fit packing into rows of max_length (segment ids, restarted positions)
  bucketed_packed   packed rows of at most 4 widths (`jaxsft.data.rows.WidthPacker`; the
                    pipeline's widths under the default cost)
  auto              what `batching: auto` chooses (`jaxsft.collation.plans.choose_collation`) under
                    the cost model fitted to this study's per-shape timings

and reports distinct batch shapes (= compiles), padded / real / trained tokens and waste, each
mode's composed end-to-end time, and beside it the trainer's prediction of the same (`predicted`:
`jaxsft.collation.cost.plan_seconds`, which prices a packed batch as a padded one of its shape).

Timing. The step is jaxsft's train step (`benchmarks.common.JaxsftStep`: the trainer's
`make_step_functions` + `CompiledSteps`, LoRA r 8 on q/v, clip + AdamW). On a CPU, running every batch
of every mode of every file through even a small model takes far longer than the ~10 minutes this
study gets (the static mode alone is 256 x 1024 tokens per file), so the default run measures the
step's two costs per shape and composes each mode's end-to-end time from them:

  end_to_end(mode) = pipeline seconds + compile(zeros, apply)
                     + sum over the shapes (B, T) it compiles of compile_seconds(B, T)
                     + sum over its batches of step_seconds(B, T) + h * trained tokens

step_seconds(B, T) is the step with no label trained and h the extra seconds per trained token
(the LM head and loss run only on trained positions; both timed per shape, as the trainer's probe
does), so a mode is charged for the labels the data trains, not for every position.

compile_seconds and step_seconds are measured at B = batch size and T on a grid (32, 64, ...,
max_length; a fresh AOT compile each, the median of `--reps` steps) and priced, at every shape, by
the trainer's own cost model fitted to them (`jaxsft.collation.cost.fit_step_cost`: a + b·B·T +
c·B·T² per step, h per trained token, p + q·T per compile, each times its measured correction
r(T), so every grid width costs what it measured and r is linear between them; a step's cost
depends only on its shape, not on the token values). Packed rows (segment ids) are measured
separately at (B, max_length), and charged the measured packed / padded ratio there. A mode compiles what jaxsft's trainer
compiles before step 1: every shape `batch_shapes` lists (for dynamic, the widths of the batches
the run reads, `dynamic_batch_shapes`: here, the epoch's).
`--validate DATASET:MODE ...` runs modes for real as the trainer would (fresh compiles, then every
batch) and puts the measured time beside the composed one. Steady-state tokens/s = tokens / sum of step seconds
(compiles excluded); "real" counts attention_mask tokens, "trained" counts labels != -100.

Writes benchmarks/results/collation{suffix}.json, .md and .png (waste % against shapes: the
Pareto front of the study) and collation{suffix}_k.png (end to end against K, auto's choice
marked). `--model smollm2-135m-instruct` times the real model.
"""

from __future__ import annotations

import argparse
import collections
import math
import sys
import time

import numpy as np

from benchmarks import common

MODES = ("static", "dynamic x8", "bucketed pow2", "bucketed K=2", "bucketed K=4", "bucketed K=8",
         "bucketed K=16", "packed", "bucketed_packed", "auto")
PACKED_MODES = ("packed", "bucketed_packed")


def pow2_buckets(max_length: int, smallest: int = 32) -> list[int]:
  """32, 64, ... up to the first power of two >= max_length, the last replaced by max_length."""
  out, b = [], smallest
  while b < max_length:
    out.append(b)
    b *= 2
  return out + [max_length]


def mode_config(mode: str, *, max_length: int, batch_size: int, auto: dict | None = None) -> dict:
  """`make_batches` / `batch_shapes` keyword arguments of a collation mode (`auto`: the batching
  arguments `choose_collation` picked)."""
  cfg = dict(max_length=max_length, batch_size=batch_size, pad_to_multiple_of=8)
  if mode == "auto":
    if auto is None:
      raise ValueError("mode auto needs the chosen batching (choose_collation's first candidate)")
    return dict(cfg, **{k: v for k, v in auto.items() if v is not None})
  if mode == "bucketed_packed":
    return dict(cfg, batching="bucketed_packed", num_buckets=4)
  if mode == "static":
    return dict(cfg, batching="static")
  if mode == "dynamic x8":
    return dict(cfg, batching="dynamic")
  if mode == "packed":
    return dict(cfg, batching="packed")
  if mode == "bucketed pow2":
    return dict(cfg, batching="bucketed", bucket_lengths=pow2_buckets(max_length))
  if mode.startswith("bucketed K="):
    return dict(cfg, batching="bucketed", num_buckets=int(mode.split("=")[1]))
  raise ValueError(f"unknown mode {mode!r}; choose from {MODES}")


# --------------------------------------------------------------------------- counting
def count_mode(records, tokenizer, mode: str, *, max_length: int, batch_size: int, seed: int = 0, tokenized=None,
               auto: dict | None = None):
  """One epoch of the real pipeline (from `tokenized`, a `TokenizedRecords`, when given):
  (summary, list of (shape, packed) per batch)."""
  from jaxsft.collation.batches import batch_shapes, make_batches
  from jaxsft.data import PipelineStats

  config = dict(mode_config(mode, max_length=max_length, batch_size=batch_size, auto=auto), tokenized=tokenized)
  stats = PipelineStats()
  start = time.perf_counter()
  shapes = [tuple(b["input_ids"].shape)
            for b in make_batches(records, tokenizer, seed=seed, num_epochs=1, stats=stats, **config)]
  pipeline_s = time.perf_counter() - start
  listed = batch_shapes(records, tokenizer, **config)
  distinct = sorted(set(shapes))
  # What a run compiles: every listed shape, as jaxsft's trainer does before step 1 (for dynamic,
  # the widths of the epoch's batches, `dynamic_batch_shapes`).
  compiled = distinct if config["batching"] == "dynamic" else sorted(set(distinct) | set(listed))
  summary = {
      "batches": stats.batches, "fill_rows": stats.fill_rows, "padded": stats.padded_tokens,
      "real": stats.real_tokens, "trained": stats.label_tokens, "waste_pct": 100 * stats.waste_frac,
      "shapes": len(distinct), "listed_shapes": len(listed), "distinct_shapes": distinct, "compiled_shapes": compiled,
      "truncated": stats.truncated, "dropped": stats.dropped, "pipeline_s": pipeline_s,
  }
  summary["batching"] = config["batching"]
  if config["batching"] in ("bucketed", "bucketed_packed"):
    summary["buckets"] = [t for _, t in listed]
  return summary, shapes


# --------------------------------------------------------------------------- per-shape costs
def fake_batch(shape, *, packed: bool, rng, vocab_size: int) -> dict:
  """A batch of the given shape (token values don't change the cost: every op is dense)."""
  b, t = shape
  ids = rng.integers(3, vocab_size, shape).astype(np.int32)
  batch = {"input_ids": ids, "attention_mask": np.ones(shape, np.int32), "labels": ids.copy()}
  if packed:  # two segments per row
    half = t // 2
    batch["segment_ids"] = np.where(np.arange(t) < half, 1, 2).astype(np.int32)[None].repeat(b, 0)
    batch["positions"] = np.where(np.arange(t) < half, np.arange(t), np.arange(t) - half).astype(np.int32)[None].repeat(b, 0)
    batch["labels"][:, half] = -100
  return batch


def calibrate(model, cfg, *, batch_size: int, lengths, max_length: int, reps: int, log=print) -> dict:
  """Fresh compile seconds and median step seconds of jaxsft's step at (batch_size, T) for T in
  `lengths`, and at (batch_size, max_length) with packed inputs; each shape timed with no label
  trained and with every label trained, as the trainer's own probe does (the LM head and loss run
  only on trained positions, so a step's cost depends on how many the data trains).
  `per_trained_token_s`: the mean of (trained - untrained) / (B·T) over the padded shapes."""
  step = common.JaxsftStep(model, cfg)
  fixed = step.warm_up([])  # zeros + the optimizer update: once per run whatever the shapes
  rng = np.random.default_rng(0)
  points = []
  for packed, t in [(False, t) for t in lengths] + [(True, max_length)]:
    shape = (batch_size, t)
    compiled = step.warm_up([shape], packed=packed)
    batch = fake_batch(shape, packed=packed, rng=rng, vocab_size=model.config.vocab_size)
    untrained = dict(batch, labels=np.full(shape, -100, np.int32))
    times, untrained_times = [], []
    for _ in range(reps):  # interleaved, so a slow moment of the machine hits both alike
      for b, out in ((batch, times), (untrained, untrained_times)):
        t0 = time.perf_counter()
        step.step(b)
        out.append(time.perf_counter() - t0)
    points.append({"shape": list(shape), "packed": packed, "compile_s": compiled["seconds"],
                   "xla_compile_s": compiled["xla_seconds"], "compiles": compiled["compiles"],
                   "step_s": float(np.median(times)), "step_times": times,
                   "untrained_step_s": float(np.median(untrained_times)), "untrained_step_times": untrained_times})
    log(f"  calibrate {'packed ' if packed else ''}{shape}: compile {compiled['seconds']:.1f}s, "
        f"step {np.median(times):.3f}s every label trained, {np.median(untrained_times):.3f}s none ({reps} reps)")
  if step.recompiles:
    raise RuntimeError(f"calibration recompiled {step.recompiles} times after warm-up: {step.steps.unexpected_shapes}")
  padded = [p for p in points if not p["packed"]]
  per_trained = float(np.mean([(p["step_s"] - p["untrained_step_s"]) / (p["shape"][0] * p["shape"][1]) for p in padded]))
  return {"fixed_compile_s": fixed["seconds"], "fixed_compiles": fixed["compiles"], "points": points,
          "per_trained_token_s": max(per_trained, 0.0)}


def shape_cost(cost, calibration: dict, shape, *, packed: bool) -> tuple[float, float]:
  """(compile seconds, step seconds with no label trained) of one (B, T) under `cost`, the trainer's
  cost model fitted to the calibration (`fit_cost`: every timed width costs what it measured, its
  correction linear between them; `compose` adds the trained tokens' share).

  Packed rows are calibrated at one width W (max_length) and cost what was measured there; a packed
  row of another width T (auto packs into the longest example rounded up, not max_length) costs the
  padded row of width T times the packed / padded ratio at W: the two run the same ops on the same
  shape, the packed one masking by segment."""
  b, t = shape
  if packed:
    (point,) = [p for p in calibration["points"] if p["packed"]]
    if list(shape) == point["shape"]:
      return point["compile_s"], point["untrained_step_s"]
    compile_s, step_s = shape_cost(cost, calibration, shape, packed=False)
    padded_compile_s, padded_step_s = shape_cost(cost, calibration, point["shape"], packed=False)
    return compile_s * point["compile_s"] / padded_compile_s, step_s * point["untrained_step_s"] / padded_step_s
  return float(cost.compile_seconds(b, t)), float(cost.step_seconds(b, t))


def compose(summary: dict, shapes, calibration: dict, cost, *, packed: bool) -> dict:
  """A mode's costs from its shapes and batches (see the module docstring): each batch's step with
  no label trained, plus the cost's seconds per trained token times the epoch's trained tokens
  (the same in every mode)."""
  compile_s = sum(shape_cost(cost, calibration, s, packed=packed)[0] for s in summary["compiled_shapes"])
  step_s = sum(shape_cost(cost, calibration, s, packed=packed)[1] for s in shapes)
  step_s += cost.per_trained_token * summary["trained"]
  return {
      "compiles": calibration["fixed_compiles"] + len(summary["compiled_shapes"]),
      "compile_s": calibration["fixed_compile_s"] + compile_s,
      "step_s": step_s,
      "padded_tokens_per_s": summary["padded"] / step_s,
      "real_tokens_per_s": summary["real"] / step_s,
      "trained_tokens_per_s": summary["trained"] / step_s,
      "end_to_end_s": summary["pipeline_s"] + calibration["fixed_compile_s"] + compile_s + step_s,
  }


def measure(model, cfg, records, tokenizer, mode: str, *, max_length: int, batch_size: int, seed: int = 0,
            tokenized=None, auto: dict | None = None) -> dict:
  """A real run of one epoch, as the trainer does it: pipeline, AOT compile of every shape the
  epoch emits (all listed shapes; for dynamic, as jaxsft's trainer, only the widths that occur),
  then every batch."""
  from jaxsft.collation.batches import batch_shapes, make_batches

  config = dict(mode_config(mode, max_length=max_length, batch_size=batch_size, auto=auto), tokenized=tokenized)
  start = time.perf_counter()
  step = common.JaxsftStep(model, cfg)
  batches = list(make_batches(records, tokenizer, seed=seed, num_epochs=1, **config))
  shapes = sorted({tuple(b["input_ids"].shape) for b in batches})
  if config["batching"] != "dynamic":  # as count_mode's compiled_shapes
    shapes = sorted(set(shapes) | set(batch_shapes(records, tokenizer, **config)))
  warm = step.warm_up(shapes, packed=config["batching"] in PACKED_MODES)
  t_steps = time.perf_counter()
  losses = [step.step(b) for b in batches]
  end = time.perf_counter()
  return {"end_to_end_s": end - start, "compile_s": warm["seconds"], "compiles": warm["compiles"],
          "step_s": end - t_steps, "batches": len(batches), "recompiles": step.recompiles,
          "first_loss": losses[0], "last_loss": losses[-1]}


def fit_cost(calibration: dict):
  """The trainer's cost model (`jaxsft.collation.cost.StepCost`) fitted to the padded calibration
  points as the trainer fits it: step seconds a + b·B·T + c·B·T² with no label trained, h per
  trained token, compile seconds p + q·T, each times its measured correction r(T)."""
  from jaxsft.collation.cost import fit_step_cost

  points = [p for p in calibration["points"] if not p["packed"]]
  return fit_step_cost([(*p["shape"], p["untrained_step_s"]) for p in points],
                       [(*p["shape"], p["compile_s"]) for p in points],
                       [(*p["shape"], p["step_s"]) for p in points])


def choose_auto(tokenized, cost, *, max_length: int, batch_size: int, trained: int, seed: int = 0) -> dict:
  """What `batching: auto` picks for one epoch of these examples under `cost`, with the runners-up.
  As the trainer does, max_length becomes the longest example rounded up to 8 (the widest bucket)
  and the lengths are taken in the epoch's order (`seed`, as `count_mode`'s)."""
  from jaxsft.collation.plans import choose_collation
  from jaxsft.data import epoch_lengths, round_up

  max_length = min(max_length, round_up(int(tokenized.lengths.max()), 8))
  candidates = choose_collation(epoch_lengths(tokenized, seed=seed), cost=cost, max_length=max_length, batch_size_for=lambda t: batch_size,
                                epochs=1.0, trained_tokens=trained)
  best = candidates[0]
  return {"name": best.name, "batching": best.batching, "max_length": max_length,
          "candidates": [{"name": c.name, "predicted_s": c.predicted.total} for c in candidates]}


def predict(summary: dict, shapes, cost, calibration: dict) -> dict:
  """The cost model's end to end of a mode: its batches' steps and its compiled shapes priced by
  `cost`, plus the same pipeline and one-off compile seconds as the composed figure."""
  from jaxsft.collation.cost import plan_seconds

  seconds = plan_seconds(cost, collections.Counter(map(tuple, shapes)), [tuple(s) for s in summary["compiled_shapes"]],
                         trained_tokens=summary["trained"])
  return {"step_s": seconds.steps, "compile_s": calibration["fixed_compile_s"] + seconds.compiles,
          "end_to_end_s": summary["pipeline_s"] + calibration["fixed_compile_s"] + seconds.total}


# --------------------------------------------------------------------------- the study
def run_study(*, datasets, model_name: str, examples: int, max_length: int, batch_size: int, grid, reps: int,
              validate=(), dtype: str = "float32", seed: int = 0, log=print, earlier: dict | None = None) -> dict:
  """Counts for every dataset x mode, per-shape calibration, composed costs, optional real runs.

  `earlier`: a result of this study on the same model and machine whose calibration is reused
  (no shape is timed again) and whose real runs are kept, but for the pairs `validate` runs anew."""
  import jax

  tokenizer = common.load_tokenizer()
  result = {"machine": common.machine_info(), "model": model_name, "model_description": common.describe_model(model_name),
            "dtype": dtype, "examples": examples, "max_length": max_length, "batch_size": batch_size,
            "grid": list(grid), "reps": reps, "datasets": {}}
  log(f"machine: {common.machine_line(result['machine'])}")
  records_of, tokenized_of = {}, {}
  for name in datasets:
    records = common.dataset_records(name, limit=examples, seed=seed)
    records_of[name] = records
    from jaxsft.data import tokenize_records

    t0 = time.perf_counter()
    tokenized_of[name] = tokenize_records(tokenizer, records, max_length=max_length)  # once, for every mode
    lengths = tokenized_of[name].lengths
    floor = -(-lengths // 8) * 8  # each example alone, padded to a multiple of 8: no batching effects
    per = {"records": len(records), "tokenize_s": time.perf_counter() - t0, "modes": {}, "shapes_of": {},
           "per_example_floor_waste_pct": 100 * (1 - lengths.sum() / floor.sum()),
           "length_p50_p90_max": [float(np.percentile(lengths, 50)), float(np.percentile(lengths, 90)), int(lengths.max())]}
    for mode in (m for m in MODES if m != "auto"):  # auto needs the fitted cost: counted after calibration
      summary, shapes = count_mode(records, tokenizer, mode, max_length=max_length, batch_size=batch_size, seed=seed,
                                   tokenized=tokenized_of[name])
      per["modes"][mode] = summary
      per["shapes_of"][mode] = shapes
      log(f"{name:28} {mode:14} shapes {summary['shapes']:3} batches {summary['batches']:3} "
          f"padded {summary['padded']:8,} waste {summary['waste_pct']:5.1f}%")
    result["datasets"][name] = per

  log(f"timed model: {result['model_description']} ({jax.default_backend()}, {dtype})")
  model = common.load_jax_model(model_name, dtype=dtype, seed=seed)
  cfg = common.train_config()
  if earlier is not None:
    calibration = earlier["calibration"]
    result["calibration_from"] = {"load_average_at_start": earlier["machine"].get("load_average"),
                                  "seconds": earlier.get("seconds")}
    log(f"calibration reused ({len(calibration['points'])} shapes)")
  else:
    t0 = time.perf_counter()
    calibration = calibrate(model, cfg, batch_size=batch_size, lengths=grid, max_length=max_length, reps=reps, log=log)
    calibration["seconds"] = time.perf_counter() - t0
  result["calibration"] = calibration
  cost = fit_cost(calibration)
  result["cost"] = cost.to_dict()
  for name, per in result["datasets"].items():
    per["auto"] = choose_auto(tokenized_of[name], cost, max_length=max_length, batch_size=batch_size,
                              trained=per["modes"]["static"]["trained"], seed=seed)
    auto_max = per["auto"]["max_length"]
    summary, shapes = count_mode(records_of[name], tokenizer, "auto", max_length=auto_max, batch_size=batch_size,
                                 seed=seed, tokenized=tokenized_of[name].with_max_length(auto_max),
                                 auto=per["auto"]["batching"])
    per["modes"]["auto"], per["shapes_of"]["auto"] = summary, shapes
    log(f"{name:28} auto -> {per['auto']['name']} {per['auto']['batching'].get('bucket_lengths') or ''}")
    for mode, summary in per["modes"].items():
      # Packed rows cost what padded rows of their shape do (the calibration's packed point), so
      # bucketed packing's narrower widths are priced from the padded points.
      summary["composed"] = compose(summary, per["shapes_of"][mode], calibration, cost,
                                    packed=summary["batching"] == "packed")
      summary["predicted"] = predict(summary, per["shapes_of"][mode], cost, calibration)
    del per["shapes_of"]
    for summary in per["modes"].values():
      summary["distinct_shapes"] = [list(s) for s in summary["distinct_shapes"]]
      summary["compiled_shapes"] = [list(s) for s in summary["compiled_shapes"]]

  rerun = {tuple(item.rsplit(":", 1)) for item in validate}
  result["validation"] = [dict(v, run="earlier") for v in (earlier or {}).get("validation", [])
                          if (v["dataset"], v["mode"]) not in rerun]
  for item in validate:
    name, mode = item.rsplit(":", 1)
    if name not in records_of or mode not in MODES:
      raise SystemExit(f"--validate {item!r}: dataset must be one of {list(records_of)} and mode one of {MODES}")
    jax.clear_caches()
    load = [round(x, 2) for x in __import__("os").getloadavg()]  # another process beside a run inflates it
    auto = result["datasets"][name]["auto"]
    length = auto["max_length"] if mode == "auto" else max_length
    measured = measure(model, cfg, records_of[name], tokenizer, mode, max_length=length, batch_size=batch_size,
                       seed=seed, tokenized=tokenized_of[name].with_max_length(length), auto=auto["batching"])
    summary = result["datasets"][name]["modes"][mode]
    result["validation"].append({"dataset": name, "mode": mode, "measured": measured, "load_average_at_start": load,
                                 "composed_end_to_end_s": summary["composed"]["end_to_end_s"],
                                 "predicted_end_to_end_s": summary["predicted"]["end_to_end_s"],
                                 "predicted_compile_s": summary["predicted"]["compile_s"],
                                 "predicted_step_s": summary["predicted"]["step_s"]})
    log(f"validate {name} {mode}: measured {measured['end_to_end_s']:.1f}s, composed "
        f"{summary['composed']['end_to_end_s']:.1f}s, predicted {summary['predicted']['end_to_end_s']:.1f}s")
  result["findings"] = findings(result)
  return result


def findings(result: dict) -> dict:
  """Per dataset: the fewest chosen buckets within 2 points of dynamic's waste (or below it), the
  fastest mode end to end, and the K = 8 target (below static and dynamic)."""
  out = {}
  for name, per in result["datasets"].items():
    modes = per["modes"]
    dyn = modes["dynamic x8"]["waste_pct"]
    close = [int(m.split("=")[1]) for m in MODES if m.startswith("bucketed K=") and modes[m]["waste_pct"] <= dyn + 2]
    e2e = {m: s["composed"]["end_to_end_s"] for m, s in modes.items()}
    k8 = e2e["bucketed K=8"]
    buckets = {m: modes[m]["waste_pct"] for m in MODES if m.startswith("bucketed")}
    fixed = {m: e for m, e in e2e.items() if m != "auto"}
    best_fixed = min(fixed, key=fixed.get)
    out[name] = {"auto_choice": per["auto"]["name"], "best_fixed": best_fixed,
                 "auto_over_best_fixed": e2e["auto"] / fixed[best_fixed],
                 "predicted_over_composed": {m: s["predicted"]["end_to_end_s"] / s["composed"]["end_to_end_s"]
                                             for m, s in modes.items()},
                 "fewest_buckets_within_2_points_of_dynamic": min(close) if close else None,
                 "lowest_waste_bucketed": min(buckets, key=buckets.get),
                 "fastest_end_to_end": min(e2e, key=e2e.get),
                 "k8_over_static": k8 / e2e["static"], "k8_over_dynamic": k8 / e2e["dynamic x8"],
                 "k8_beats_static_and_dynamic": k8 < e2e["static"] and k8 < e2e["dynamic x8"],
                 "bucketed_packing_widths": len(modes["bucketed_packed"]["buckets"]),
                 "bucketed_packing_waste_over_packing_points": (modes["bucketed_packed"]["waste_pct"]
                                                                - modes["packed"]["waste_pct"]),
                 "bucketed_packing_over_packing_end_to_end": e2e["bucketed_packed"] / e2e["packed"]}
  return out


# --------------------------------------------------------------------------- output
def markdown(result: dict, command: str) -> str:
  cal = result["calibration"]
  lines = [
      "# Collation study: padding waste against compiled shapes", "",
      f"`{command}`", "",
      f"Machine: {common.machine_line(result['machine'])}.", "",
      f"Pipeline: jaxsft's `make_batches` with SmolLM2-135M-Instruct's tokenizer, max_length {result['max_length']}, "
      f"batch size {result['batch_size']}, one epoch over the first {result['examples']} records of a seeded "
      "permutation of each file (all of them when fewer). Timed step: jaxsft's train step (`make_step_functions` + "
      f"`CompiledSteps`: LoRA r 8 on q/v, clip + AdamW) on {result['model_description']}, {result['dtype']}, "
      f"{result['machine']['backend']}.", "",
      "Columns: *shapes* = distinct (B, T) the epoch emits, and in brackets the shapes `batch_shapes` lists "
      "(jaxsft's trainer compiles every listed shape before step 1; for dynamic, only the widths of the batches "
      "it reads); *compiles* = the shapes compiled, plus the run's one-off "
      "compiles (see Per-shape costs); *waste* = "
      "padding tokens / padded tokens (B x T summed, fill rows included); *tok/s* = real (attention-mask) and "
      "trained (label) tokens per second of step time, compiles excluded; *end to end* = pipeline + compiles "
      "+ steps for the epoch, composed from the per-shape costs below (see `benchmarks/collation.py`).", "",
  ]
  for name, per in result["datasets"].items():
    p50, p90, longest = per["length_p50_p90_max"]
    lines += [f"## {name} ({per['records']} records; tokenizing them once: {per['tokenize_s']:.1f} s)", "",
              f"Tokens per example (after truncation): p50 {p50:.0f}, p90 {p90:.0f}, max {longest}. Padding floor "
              f"(every example alone, rounded up to a multiple of 8): {per['per_example_floor_waste_pct']:.1f}% waste.", "",
              "| mode | shapes (listed) | batches | padded | real | trained | waste % | compiles | compile s | "
              "real tok/s | trained tok/s | end to end s | predicted s |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for mode, s in per["modes"].items():
      c = s["composed"]
      lines.append(f"| {mode} | {s['shapes']} ({s['listed_shapes']}) | {s['batches']} | {s['padded']:,} | "
                   f"{s['real']:,} | {s['trained']:,} | {s['waste_pct']:.1f} | {c['compiles']} | "
                   f"{c['compile_s']:.1f} | {c['real_tokens_per_s']:,.0f} | {c['trained_tokens_per_s']:,.0f} | "
                   f"{c['end_to_end_s']:.1f} | {s['predicted']['end_to_end_s']:.1f} |")
    buckets = {m: s["buckets"] for m, s in per["modes"].items() if "buckets" in s}
    runners = ", ".join(f"{c['name']} {c['predicted_s']:.1f} s" for c in per["auto"]["candidates"][1:4])
    lines += [""] + [f"- {m} boundaries: {b}" for m, b in buckets.items()]
    lines += [f"- auto chose {per['auto']['name']} (predicted steps + compiles; runners-up: {runners})", ""]
  lines += ["## auto against the grid", "",
            "*auto / best fixed*: auto's composed end to end over the best other mode's; *predicted / composed*: "
            "the cost model's end to end over the composed one, the worst mode of the file.", "",
            "| data | auto chose | best fixed | auto / best fixed | predicted / composed, worst mode |",
            "| --- | --- | --- | ---: | ---: |"]
  for name, f in result["findings"].items():
    worst = max(f["predicted_over_composed"], key=lambda m: abs(f["predicted_over_composed"][m] - 1))
    lines.append(f"| {name} | {f['auto_choice']} | {f['best_fixed']} | {f['auto_over_best_fixed']:.2f} | "
                 f"{f['predicted_over_composed'][worst]:.2f} ({worst}) |")
  lines += ["", "## Findings", "",
            "| data | fewest chosen buckets within 2 points of dynamic's waste | lowest-waste bucketing | "
            "fastest end to end | K=8 / static (end to end) | K=8 / dynamic | K=8 below both |",
            "| --- | ---: | --- | --- | ---: | ---: | --- |"]
  for name, f in result["findings"].items():
    lines.append(f"| {name} | {f['fewest_buckets_within_2_points_of_dynamic']} | {f['lowest_waste_bucketed']} | "
                 f"{f['fastest_end_to_end']} | "
                 f"{f['k8_over_static']:.2f} | {f['k8_over_dynamic']:.2f} | "
                 f"{'yes' if f['k8_beats_static_and_dynamic'] else 'NO'} |")
  lines += ["", "## Bucketed packing against packing into one width", "",
            "*widths*: the widths bucketed packing chose; *waste*: its waste minus packing's, in points; *end to end*: "
            "its composed end to end over packing's.", "",
            "| data | widths | waste, points over packing | end to end / packing |", "| --- | ---: | ---: | ---: |"]
  for name, f in result["findings"].items():
    lines.append(f"| {name} | {f['bucketed_packing_widths']} | {f['bucketed_packing_waste_over_packing_points']:+.1f} | "
                 f"{f['bucketed_packing_over_packing_end_to_end']:.2f} |")
  reused = (f"; reused from an earlier run of this command that took {result['calibration_from']['seconds']:.0f} s "
            f"in all, load at its start {result['calibration_from']['load_average_at_start']}"
            if "calibration_from" in result else "")
  lines += ["", f"## Per-shape costs (B = {result['batch_size']}; calibration took {cal['seconds']:.0f} s{reused})", "",
            f"Compiling `zeros` + the optimizer update once per run: {cal['fixed_compile_s']:.1f} s "
            f"({cal['fixed_compiles']} compiles).", "",
            f"Seconds per trained token (the LM head and loss, which run only where a label is trained; "
            f"mean of (every label - none) / (B·T) over the padded shapes): {cal['per_trained_token_s'] * 1e6:.1f} µs.", "",
            "| T | inputs | compile s (wall) | XLA compile s | step s, every label trained (median of "
            f"{result['reps']}) | step s, none trained | padded tok/s (every label) |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
  for p in cal["points"]:
    b, t = p["shape"]
    lines.append(f"| {t} | {'packed (segment ids)' if p['packed'] else 'padded'} | {p['compile_s']:.1f} | "
                 f"{p['xla_compile_s']:.1f} | {p['step_s']:.3f} | {p['untrained_step_s']:.3f} | "
                 f"{b * t / p['step_s']:,.0f} |")
  if result["validation"]:
    lines += ["", "## Composed against measured (real runs: pipeline, compiles, every batch)", "",
              "| data | mode | load at start (1/5/15 min) | batches | compiles | measured end to end s | composed s | "
              "measured / composed | predicted s | predicted / measured |",
              "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for v in result["validation"]:
      m = v["measured"]
      load = "/".join(f"{x:.1f}" for x in v["load_average_at_start"]) if "load_average_at_start" in v else "not recorded"
      lines.append(f"| {v['dataset']} | {v['mode']} | {load} | {m['batches']} | {m['compiles']} | {m['end_to_end_s']:.1f} | "
                   f"{v['composed_end_to_end_s']:.1f} | {m['end_to_end_s'] / v['composed_end_to_end_s']:.2f} | "
                   f"{v['predicted_end_to_end_s']:.1f} | {v['predicted_end_to_end_s'] / m['end_to_end_s']:.2f} |")
    split = [v for v in result["validation"] if "predicted_compile_s" in v]  # runs recorded before the split lack it
    if split:
      lines += ["", "Compiles and steps apart: the cost model's prediction against the same real runs (compiles: "
                "fresh AOT compiles of every shape, trace and lowering included; steps: every batch).", "",
                "| data | mode | compiles | compile s measured | predicted | predicted / measured | step s measured | "
                "predicted | predicted / measured |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
      for v in split:
        m = v["measured"]
        lines.append(f"| {v['dataset']} | {v['mode']} | {m['compiles']} | {m['compile_s']:.1f} | "
                     f"{v['predicted_compile_s']:.1f} | {v['predicted_compile_s'] / m['compile_s']:.2f} | "
                     f"{m['step_s']:.1f} | {v['predicted_step_s']:.1f} | {v['predicted_step_s'] / m['step_s']:.2f} |")
  return "\n".join(lines) + "\n"


def plot(result: dict, path) -> None:
  """Waste % against distinct shapes per dataset; the bucketed K series drawn as a line."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(8, 5))
  markers = {"static": "s", "dynamic x8": "D", "bucketed pow2": "^", "packed": "*"}
  for (name, per), color in zip(result["datasets"].items(), plt.rcParams["axes.prop_cycle"].by_key()["color"]):
    modes = per["modes"]
    ks = [m for m in MODES if m.startswith("bucketed K=")]
    ax.plot([modes[m]["shapes"] for m in ks], [modes[m]["waste_pct"] for m in ks], "o-", color=color, label=name)
    for m in ks:
      ax.annotate(m.split(" ")[1], (modes[m]["shapes"], modes[m]["waste_pct"]), fontsize=7, color=color,
                  xytext=(3, 3), textcoords="offset points")
    for m, marker in markers.items():
      ax.plot(modes[m]["shapes"], modes[m]["waste_pct"], marker, color=color, markersize=8, fillstyle="none")
  for m, marker in markers.items():
    ax.plot([], [], marker, color="gray", fillstyle="none", label=m)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("distinct batch shapes (= compiles of the train step)")
  ax.set_ylabel("padding waste % of computed tokens")
  ax.set_title(f"Padding waste vs compiled shapes (max_length {result['max_length']}, batch {result['batch_size']}, "
               f"{result['examples']} records per dataset)", fontsize=9)
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_k(result: dict, path) -> None:
  """End to end (composed) against the number of buckets K per dataset, auto's choice marked (a
  star at its number of compiled shapes), packing and bucketed packing as horizontal lines."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(8, 5))
  for (name, per), color in zip(result["datasets"].items(), plt.rcParams["axes.prop_cycle"].by_key()["color"]):
    modes = per["modes"]
    ks = [m for m in MODES if m.startswith("bucketed K=")]
    ax.plot([int(m.split("=")[1]) for m in ks], [modes[m]["composed"]["end_to_end_s"] for m in ks], "o-", color=color,
            label=name)
    auto = modes["auto"]
    ax.plot(max(len(auto["compiled_shapes"]), 1), auto["composed"]["end_to_end_s"], "*", color=color, markersize=14,
            markeredgecolor="black")
    ax.annotate(per["auto"]["name"], (max(len(auto["compiled_shapes"]), 1), auto["composed"]["end_to_end_s"]),
                fontsize=7, color=color, xytext=(5, -10), textcoords="offset points")
    for mode, style in (("packed", ":"), ("bucketed_packed", "--")):
      ax.axhline(modes[mode]["composed"]["end_to_end_s"], color=color, linestyle=style, linewidth=0.8)
  ax.plot([], [], "*", color="gray", markersize=12, markeredgecolor="black", label="auto's choice (x = its shapes)")
  ax.plot([], [], ":", color="gray", label="packed")
  ax.plot([], [], "--", color="gray", label="bucketed_packed")
  ax.set_xscale("log", base=2)
  ax.set_xlabel("buckets K (compiled shapes)")
  ax.set_ylabel("end to end s (pipeline + compiles + steps, one epoch)")
  ax.set_title(f"End to end against K ({result['model']}, max_length {result['max_length']}, batch "
               f"{result['batch_size']})", fontsize=9)
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="smollm2-shaped-4l",
                      help=f"timed model: {sorted(common.RANDOM_MODELS)} (random) or a model name/path, e.g. "
                           f"{common.REAL_MODEL} (default: %(default)s)")
  parser.add_argument("--dtype", default="float32")
  parser.add_argument("--examples", type=int, default=256, help="records per dataset (default: %(default)s)")
  parser.add_argument("--max-length", type=int, default=1024)
  parser.add_argument("--batch-size", type=int, default=8)
  parser.add_argument("--grid", type=int, nargs="+", default=None,
                      help="calibration widths T (default: 32, 64, ..., max_length plus 3/4 max_length)")
  parser.add_argument("--reps", type=int, default=2, help="timed steps per calibration shape (default: %(default)s)")
  parser.add_argument("--validate", nargs="*", default=None,
                      help="DATASET:MODE pairs to run for real (default: built-in dataset, dynamic and K=8)")
  parser.add_argument("--datasets", nargs="+", default=[*common.SHARED_FILES, common.BUILTIN])
  parser.add_argument("--quick", action="store_true", help="128 records, grid 64/256/max_length, 1 rep, no validation")
  parser.add_argument("--suffix", default="", help="result file suffix, e.g. _gpu")
  parser.add_argument("--calibration-from", default=None, metavar="RESULT_JSON",
                      help="reuse the per-shape timings (and keep the real runs) of an earlier result of the same "
                      "model and settings; only --validate's runs are timed (e.g. to re-run one on a quieter machine)")
  args = parser.parse_args(argv)
  earlier = None
  if args.calibration_from:
    import json

    earlier = json.loads(open(args.calibration_from).read())
    for key in ("model", "dtype", "examples", "max_length", "batch_size"):
      if earlier[key] != getattr(args, key):
        raise SystemExit(f"--calibration-from {args.calibration_from}: {key} is {earlier[key]!r} there, "
                         f"{getattr(args, key)!r} here")
  grid = args.grid
  if args.quick:
    args.examples, args.reps = min(args.examples, 128), 1
    grid = grid or [64, 256, args.max_length]
    if args.validate is None:
      args.validate = []
  grid = sorted(set(grid or pow2_buckets(args.max_length) + [args.max_length * 3 // 4]))
  if args.validate is None:
    args.validate = [f"{common.BUILTIN}:dynamic x8", f"{common.BUILTIN}:bucketed K=8"]
  start = time.perf_counter()
  result = run_study(datasets=args.datasets, model_name=args.model, examples=args.examples, max_length=args.max_length,
                     batch_size=args.batch_size, grid=grid, reps=args.reps, validate=args.validate, dtype=args.dtype,
                     log=lambda s: print(s, flush=True), earlier=earlier)
  result["seconds"] = time.perf_counter() - start
  result["load_average_at_end"] = list(__import__("os").getloadavg())
  command = "python -m benchmarks.collation " + " ".join(a if " " not in a else repr(a) for a in (argv or sys.argv[1:]))
  md = markdown(result, command.strip())
  common.write_results(f"collation{args.suffix}", result, md)
  plot(result, common.RESULTS / f"collation{args.suffix}.png")
  plot_k(result, common.RESULTS / f"collation{args.suffix}_k.png")
  print(md)
  print(f"total {result['seconds']:.0f} s; wrote {common.RESULTS}/collation{args.suffix}.{{json,md,png}} and _k.png")
  return 0


if __name__ == "__main__":
  sys.exit(main())
