"""What a run pays to compile (jaxsft.collation.compiles): counted from JAX's events, cold and warm persistent
cache, and predicted per program from this machine's calibration."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import pytest

from jaxsft.collation import compiles
from jaxsft.collation.compiles import Calibration, CompilePrices, CompileTally, predict_compiles, signature

ROOT = pathlib.Path(__file__).resolve().parents[1]


def fresh_program():
  """A new function object each call (no in-process cache hit), the same program every time (the
  persistent cache's key)."""
  import jax
  import jax.numpy as jnp

  def program(x):
    return jnp.tanh(x @ x.T).sum(axis=0) * 3.0

  return jax.jit(program), jnp.ones((48, 48))


def test_the_ledger_tells_a_cold_compile_from_a_persistent_cache_hit(tmp_path, no_compile_cache):
  import jax
  from jax.experimental.compilation_cache import compilation_cache

  saved = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "xla"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_enable_compilation_cache", True)
  compilation_cache.reset_cache()
  try:
    ledger = compiles.ledger()
    fn, x = fresh_program()
    before = ledger.tally()
    fn.lower(x).compile()
    cold = ledger.tally() - before
    fn, x = fresh_program()
    before = ledger.tally()
    fn.lower(x).compile()
    warm = ledger.tally() - before
    # A program that compiles faster than the cache's threshold is neither written nor read.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
    fn, y = fresh_program()
    y = y[:40]  # another shape: a new cache key
    before = ledger.tally()
    fn.lower(y).compile()
    unwritten = ledger.tally() - before
  finally:
    jax.config.update("jax_compilation_cache_dir", saved[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[1])
  assert (cold.programs, cold.cache_hits, cold.cache_misses, cold.cache_state) == (1, 0, 1, "cold")
  # A hit still traces and lowers (and JAX times the cache read as its backend step): counted.
  assert (warm.programs, warm.cache_hits, warm.cache_misses, warm.cache_state) == (1, 1, 0, "warm")
  assert cold.seconds > 0 and 0 < warm.front_seconds <= warm.seconds
  # What the cache saves: the written program's XLA seconds, the whole of its time less its front end.
  assert cold.written_backend_seconds == pytest.approx(cold.seconds - cold.front_seconds) and cold.written_backend_seconds > 0
  assert warm.written_backend_seconds == 0
  assert (unwritten.programs, unwritten.cache_misses, unwritten.written_backend_seconds) == (1, 0, 0)


def test_tallies_subtract_and_name_the_cache_state():
  a = CompileTally(programs=5, cache_hits=2, cache_misses=1, seconds=3.0, front_seconds=1.0)
  b = CompileTally(programs=2, cache_hits=2, cache_misses=0, seconds=1.0, front_seconds=0.5)
  assert (a - b) == CompileTally(3, 0, 1, 2.0, 0.5) and (a - b).cache_state == "cold"
  assert b.cache_state == "warm" and a.cache_state == "partial" and CompileTally().cache_state == "none"
  assert (a - b) + b == a


PRICES = CompilePrices(cold=(2.0, 0.01), warm=None, front_share=0.25, generate=3.0,
                       fixed={"cold": 1.5, "warm": 0.5}, source="test")


def test_a_cold_run_pays_every_program_it_compiles_probes_and_generation_included():
  extra = "ids:fused:eval"
  programs = [((16, 128), extra), ((8, 256), extra), ((4, 512), extra),  # the probes
              ((4, 512), extra), ((4, 512), "packed:fused:eval")]  # the plan: one width again, packed
  generation = [signature("generate", (8, 128), "new:16"), signature("generate", (8, 256), "new:16")]
  forecast = predict_compiles(PRICES, programs, with_eval=True, generation_programs=generation, cached=set())
  # Four distinct programs (the probe's 512 serves the plan's unpacked 512): (2 + 0.01·T) each.
  shapes = (2 + 1.28) + (2 + 2.56) + 2 * (2 + 5.12)
  assert forecast.seconds == pytest.approx(shapes + 2 * 3.0 + 1.5)
  assert forecast.programs == {"train_step": 4, "evaluate": 4, "generate": 2}
  assert (forecast.cached, forecast.cache_state) == (0, "cold")


def test_a_warm_run_pays_the_front_end_of_what_is_cached_and_the_whole_of_what_is_not():
  extra = "ids:fused:eval"
  generate_128, generate_256 = signature("generate", (8, 128), "new:16"), signature("generate", (8, 256), "new:16")
  cached = {signature("train", (16, 128), extra), generate_128, "other"}
  programs = [((16, 128), extra), ((4, 512), extra)]
  forecast = predict_compiles(PRICES, programs, with_eval=False, generation_programs=[generate_128], cached=cached)
  assert forecast.seconds == pytest.approx(0.25 * 3.28 + 7.12 + 0.25 * 3.0 + 0.5)
  assert (forecast.cached, forecast.cache_state, forecast.programs["evaluate"]) == (2, "partial", 0)
  # A prompt width no earlier run generated at compiles cold.
  wider = predict_compiles(PRICES, programs, with_eval=False, generation_programs=[generate_256], cached=cached)
  assert wider.seconds == pytest.approx(forecast.seconds - 0.25 * 3.0 + 3.0) and wider.cached == 1
  everything = cached | {signature("train", (4, 512), extra)}
  assert predict_compiles(PRICES, programs, with_eval=False, generation_programs=[generate_128], cached=everything
                          ).cache_state == "warm"
  # Without a persistent cache nothing is found, whatever the calibration remembers.
  off = predict_compiles(PRICES, programs, with_eval=False, generation_programs=[generate_128], cached=everything,
                         cache_enabled=False)
  assert off.cache_state == "cold" and off.seconds == pytest.approx(3.28 + 7.12 + 3.0 + 1.5)


def test_prices_come_from_the_calibration_and_grow_with_width_as_measured():
  cal = Calibration(cold=[[16, 128, 3.0], [8, 256, 4.0], [4, 512, 6.0]], front_share=0.2,
                    warm=[[16, 128, 0.5], [4, 512, 0.9]], generate=[[8, 0, 2.5]], fixed={"cold": 1.0})
  p = compiles.prices(cal, fallback_cold=(99.0, 0.0))
  assert p.cold == pytest.approx((2.0, 1 / 128))  # exact line through the three
  assert p.shape_seconds(1024, cached=False) == pytest.approx(10.0)
  assert p.shape_seconds(128, cached=True) == pytest.approx(0.5)  # the warm fit, not the share
  # The other programs, warm and never seen warm: what they cost cold, less the XLA seconds of those
  # the cold run wrote to the cache; once a warm run was seen, what it paid.
  assert (p.generate, p.generate_seconds(True), p.fixed_seconds(True)) == pytest.approx((2.5, 0.5, 1.0))
  saving = compiles.prices(dataclasses.replace(cal, fixed={"cold": 5.9, "saved_by_cache": 4.2}), (99.0, 0.0))
  assert (saving.fixed_seconds(False), saving.fixed_seconds(True)) == pytest.approx((5.9, 1.7))
  seen = compiles.prices(dataclasses.replace(cal, fixed={"cold": 5.9, "saved_by_cache": 4.2, "warm": 1.5}), (99.0, 0.0))
  assert seen.fixed_seconds(True) == pytest.approx(1.5) and "other programs: cold, warm timed here" in seen.source
  empty = compiles.prices(Calibration(), fallback_cold=(2.25, 1e-3))
  assert empty.cold == (2.25, 1e-3) and "cold: default" in empty.source
  assert empty.generate == pytest.approx(2.25 + 0.128)


def test_generation_widths_follow_generate_s_chunks():
  # Sorted, 8 at a time, each chunk's longest rounded up to 128 (in the given order the chunks
  # would be 384 and 256 wide).
  lengths = [300] + [40] * 7 + [130, 20]
  assert compiles.generation_widths(lengths, batch_size=8, prompt_multiple=128) == [128, 384]
  assert compiles.generation_widths([5] * 16, batch_size=8, prompt_multiple=128) == [128]


def test_the_calibration_survives_a_round_trip_and_a_broken_file(tmp_path):
  path = Calibration.path(tmp_path, "k")
  assert Calibration.load(path) == Calibration()
  cal = Calibration(cold=[[4, 512, 6.0]], front_share=0.3, fixed={"cold": 1.0}, cached={"/x": ["other"]})
  cal.save(path)
  assert Calibration.load(path) == cal
  path.write_text("{not json")
  assert Calibration.load(path) == Calibration()
  assert compiles.merge_samples([[4, 512, 6.0], [8, 256, 4.0]], [[4, 512, 7.0]]) == [[4, 512, 7.0], [8, 256, 4.0]]


def test_the_calibration_key_changes_with_the_machine_the_jax_version_and_the_model():
  machine = compiles.machine_description()
  assert machine["jax"] and "cpu_flags" in machine
  key = compiles.calibration_key(machine, {"model": "a", "dtype": "float32"})
  assert key == compiles.calibration_key(dict(machine), {"model": "a", "dtype": "float32"})
  assert key != compiles.calibration_key({**machine, "jax": "0.0.1"}, {"model": "a", "dtype": "float32"})
  assert key != compiles.calibration_key({**machine, "cpu": "another"}, {"model": "a", "dtype": "float32"})
  assert key != compiles.calibration_key(machine, {"model": "a", "dtype": "bfloat16"})


def test_a_packed_plan_recompiling_a_probe_width_keeps_the_probe_s_seconds():
  from jaxsft.collation.account import compiled_by_phase

  probe_seconds, shapes, compile_seconds = {(16, 128): 3.0, (4, 512): 6.0}, [(4, 512)], {(16, 128): 3.0, (4, 512): 7.5}
  assert compiled_by_phase(probe_seconds, "ids", shapes, compile_seconds, "packed") == {
      "probe": {(16, 128): 3.0, (4, 512): 6.0}, "warm_up": {(4, 512): 7.5}}
  assert compiled_by_phase(probe_seconds, "ids", shapes, compile_seconds, "ids") == {
      "probe": {(16, 128): 3.0, (4, 512): 6.0}, "warm_up": {}}


def train_in_subprocess(args, xla_cache: pathlib.Path, jaxsft_cache: pathlib.Path):
  env = dict(os.environ, HF_HUB_OFFLINE="1", JAX_COMPILATION_CACHE_DIR=str(xla_cache), JAXSFT_CACHE=str(jaxsft_cache),
             JAX_ENABLE_COMPILATION_CACHE="true", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  r = subprocess.run([sys.executable, "-m", "jaxsft.train", *map(str, args)], cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=600)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.mark.slow
def test_a_run_predicts_and_reports_its_compiles_cold_then_warm(tiny_dir, small_data, tmp_path):
  """Two runs in one fresh persistent cache: the first compiles everything (predicted and measured
  cold), the second finds every program (predicted warm from the calibration the first left, and
  measured warm); the measured compiles are the programs' own seconds, not the probes' timing calls."""
  args = ["--model", tiny_dir, "--data", small_data, "data.batching=auto", "max_steps=2", "data.batch_size=8",
          "data.tokens_per_batch=none", "data.max_val_examples=8", "eval.num_prompts=4", "eval.max_new_tokens=4",
          "--no-progress", "--quiet"]
  xla, cache = tmp_path / "xla", tmp_path / "jaxsft"
  train_in_subprocess([*args, "--output-dir", tmp_path / "cold"], xla, cache)
  # Every program is written to the cache here (threshold 0): the cold run's other programs leave
  # the XLA seconds a warm run will not pay.
  (calibration,) = (cache / "compile_calibration").glob("*.json")
  fixed = json.loads(calibration.read_text())["fixed"]
  assert set(fixed) == {"cold", "saved_by_cache"} and 0 < fixed["saved_by_cache"] < fixed["cold"]
  train_in_subprocess([*args, "--output-dir", tmp_path / "warm"], xla, cache)
  cold, warm = (json.loads((tmp_path / name / "summary.json").read_text())["collation"] for name in ("cold", "warm"))
  assert cold["cache"] == {"folder": str(xla), "predicted": "cold", "measured": "cold"}
  assert warm["cache"] == {"folder": str(xla), "predicted": "warm", "measured": "warm"}
  for c in (cold, warm):
    predicted, measured = c["compiles"]["predicted"], c["compiles"]["measured"]
    assert predicted["programs"]["generate"] >= 1 and predicted["programs"]["evaluate"] >= 1
    assert predicted["programs"]["train_step"] >= len(c["candidates"][0]["shapes"])
    assert c["measured_seconds"]["compiles"] == measured["seconds"]
    phases = measured["phases"]
    assert set(phases) == {"probe", "warm_up", "generate", "other"}
    assert sum(p["programs"] for p in phases.values()) == measured["programs"]
  # The second run's programs are cache reads: it pays less, and was predicted to.
  assert warm["measured_seconds"]["compiles"] < cold["measured_seconds"]["compiles"]
  assert warm["predicted_seconds"]["compiles"] < cold["predicted_seconds"]["compiles"]
  # auto's record: its choice heads the priced candidates, chosen with the probes' measured cost,
  # and every shape of the chosen plan was compiled before step 1.
  names = [c["name"] for c in cold["candidates"]]
  assert cold["choice"] == names[0] and len(names) >= 6
  assert cold["cost"]["source"].startswith("measured") and cold["chosen_with"]["source"] == "measured: 3 shapes"
  for key in ("predicted_seconds", "measured_seconds"):
    assert set(cold[key]) == {"steps", "compiles"} and cold[key]["steps"] > 0 and cold[key]["compiles"] > 0
  assert json.loads((tmp_path / "cold" / "summary.json").read_text())["recompiles"] == 0
  config = json.loads((tmp_path / "cold" / "metrics.jsonl").read_text().splitlines()[0])
  assert {tuple(s) for s in config["batch_shapes"]} >= {tuple(s) for s in cold["candidates"][0]["shapes"]}


def test_auto_chooses_at_cold_compile_prices_when_its_probes_were_cache_reads():
  from jaxsft.collation import probe
  from jaxsft.collation.cost import StepCost

  probed = StepCost(a=0.1, b=1e-4, c=0.0, compile_base=0.2, compile_per_width=1e-4, compile_ratios=((128, 1.1), (512, 0.9)))
  cal = Calibration(cold=[[16, 128, 3.0], [4, 512, 6.0]])
  warm_probes = CompileTally(programs=6, cache_hits=6, seconds=1.0)
  chosen = probe.with_cold_compiles(probed, cal, warm_probes)
  assert (chosen.compile_base, chosen.compile_per_width) == pytest.approx((2.0, 1 / 128))
  assert chosen.compile_ratios == () and (chosen.a, chosen.b) == (probed.a, probed.b)
  # Cold probes timed real compiles: kept; so is a warm probe with no cold compile ever timed here.
  assert probe.with_cold_compiles(probed, cal, CompileTally(programs=6, cache_misses=6, seconds=9.0)) == probed
  assert probe.with_cold_compiles(probed, Calibration(), warm_probes) == probed


def test_only_programs_jax_writes_to_the_persistent_cache_are_remembered_as_cached(tmp_path):
  import jax

  from jaxsft.collation import account

  saved = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  try:
    assert account.written_to_cache(1.5) and not account.written_to_cache(0.4)
    probe_seconds = {(16, 128): 0.6, (4, 512): 5.0}
    saved_dir, enabled = jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    jax.config.update("jax_enable_compilation_cache", True)
    try:
      phase = account.compiled_by_phase(probe_seconds, "ids", [(4, 512)], dict(probe_seconds), "ids")["probe"]
      cal = account.learn_from_compiles(Calibration(), phase, CompileTally(programs=4, cache_misses=4, seconds=5.6),
                                        "ids")
    finally:
      jax.config.update("jax_compilation_cache_dir", saved_dir)
      jax.config.update("jax_enable_compilation_cache", enabled)
  finally:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", saved)
  # 0.6 s for train step and evaluation together: each under JAX's 1 s, neither written.
  assert cal.cached == {str(tmp_path): [signature("train", (4, 512), "ids")]}
  assert sorted(map(tuple, cal.cold)) == [(4, 512, 5.0), (16, 128, 0.6)]
