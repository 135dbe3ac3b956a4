"""Collation: which batch shapes a run uses and what they cost, decided in one place.

    plan(cfg, train_tokens, val_tokens, ...)  →  Collation: make_batches' batching arguments, buckets
        resolved, the choice and its cost, and what the probes compiled (the entry point)

    cost.py      the cost model: step seconds a + b·B·T + c·B·T² (+ h per trained token), compile
                 seconds p + q·T, fitted to timings; a plan's predicted seconds    (numpy only)
    buckets.py   bucket boundaries: the exact DP over the token lengths             (numpy only)
    plans.py     each mode's batches per shape, packing widths, `choose_collation` (every candidate priced)
    choice.py    the trainer's choice from its config (`num_buckets: auto`, `batching: auto`)
    probe.py     the step's cost from this run's timings: auto's probes, the warm-up's timed shapes
    compiles.py  what compiling costs: JAX's compile events counted, this machine's calibration,
                 the compile forecast
    planner.py   `plan` and `Collation`
    account.py   at warm-up: the cost fitted to the compiled shapes, predicted seconds and compiles
    summary.py   summary.json's "collation": predicted beside measured

The entry point loads on first use: `jaxsft.data` imports the numpy-only modules here (a pipeline
given no buckets chooses them), and `plan` imports `jaxsft.data` and the step in turn. Equations
and the record in summary.json: docs/collation_cost.md.
"""


def __getattr__(name: str):
  if name in ("plan", "Collation"):
    from jaxsft.collation import planner

    return getattr(planner, name)
  raise AttributeError(f"module 'jaxsft.collation' has no attribute {name!r}")
