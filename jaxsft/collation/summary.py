"""summary.json's "collation" at the end of a run: the account made at warm-up (the choice, its
predicted seconds and compiles) beside what the run measured, and the calibration with what the
run's generation and other programs cost learned (docs/collation_cost.md)."""

from __future__ import annotations

import dataclasses

from jaxsft.collation import compiles as compiles_lib
from jaxsft.collation.account import CollationAccount, cache_folder, save_calibration, written_to_cache


def summary(account: CollationAccount, *, step_seconds: float, generate: compiles_lib.CompileTally | None,
            writer: bool) -> dict:
  """summary.json's "collation": the choice, its predicted seconds and the measured ones. Measured
  steps are the `step_seconds` this process ran; measured compiles are every program the run built
  (trace, lowering and XLA's compile or the persistent cache's read), from setup to now, JAX's own
  events counting them; `compiles` says which programs were predicted and which cache state, beside
  what happened (per phase: the account's, `generate`'s where the evaluation generated, the rest)."""
  total = compiles_lib.ledger().tally() - account.compile_start
  tallies = dict(account.phases)
  if generate is not None:
    tallies["generate"] = generate
  phases = {name: tally.to_dict() for name, tally in tallies.items()}
  other = total
  for tally in tallies.values():
    other = other - tally
  phases["other"] = other.to_dict()
  learn_from_run(account, generate, total, other, writer)
  predicted = account.compiles_predicted
  collation = dict(account.record)
  collation["measured_seconds"] = {"steps": round(step_seconds, 3), "compiles": round(total.seconds, 3)}
  collation["cache"] = {"folder": cache_folder(), "predicted": predicted["cache_state"], "measured": total.cache_state}
  collation["compiles"] = {"predicted": predicted, "measured": {**total.to_dict(), "phases": phases}}
  return collation


def learn_from_run(account: CollationAccount, generated: compiles_lib.CompileTally | None,
                   total: compiles_lib.CompileTally, other: compiles_lib.CompileTally, writer: bool) -> None:
  """Saves the calibration with what generation compiled (cold: seconds per program) and the run's
  other programs' seconds, for the next run's prediction."""
  cal = account.calibration
  learned = {}
  programs = list(account.generation_signatures) if generated is not None else []
  if programs and generated.cache_state == "cold":
    learned["generate"] = [[8, 0, generated.seconds / len(programs)]]
  # The other programs are priced by the state of the run they were in; of a cold run's, the XLA
  # seconds of those written to the persistent cache are what a warm run will not pay.
  if total.cache_hits:
    learned["fixed"] = {**cal.fixed, "warm": other.seconds}
  else:
    learned["fixed"] = {**cal.fixed, "cold": other.seconds, "saved_by_cache": other.written_backend_seconds}
  folder = cache_folder()
  if folder:
    cold_seconds = generated.seconds / len(programs) if programs else 0.0
    found = not programs or generated.cache_state == "warm" or written_to_cache(cold_seconds)
    learned["cached"] = {**cal.cached, folder: sorted(set(cal.cached.get(folder, [])) | {"other"}
                                                       | (set(programs) if found else set()))}
  save_calibration(dataclasses.replace(cal, **learned), account.calibration_path, writer)
