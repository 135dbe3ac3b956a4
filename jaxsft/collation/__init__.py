"""Collation: which batch shapes a run uses and what they cost, decided in one place.

    plan(cfg, train_tokens, val_tokens, ...)  →  Collation: make_batches' batching arguments, buckets
        resolved, the choice and its cost, and what the probes compiled (the entry point)
    make_batches / batch_shapes / count_batches  →  jaxsft.data's, the buckets or packing widths
        chosen from the token lengths where none are given (`batches.py`)

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
    batches.py   the pipeline's entry points with the shapes chosen here (`choose_shapes`)
    compare.py   every batching mode run and priced: `python -m jaxsft.data stats`

This package sits above `jaxsft.data` (it counts and prices what the pipeline makes; the data layer
imports nothing from here). The entry points load on first use: `plan` imports the step, and the
pipeline's entry points Grain (and with it jax). Equations and the record in summary.json:
docs/collation_cost.md.
"""

_PLANNER = ("plan", "Collation", "resolved")
_BATCHES = ("make_batches", "batch_shapes", "count_batches")


def __getattr__(name: str):
  if name in _PLANNER:
    from jaxsft.collation import planner

    return getattr(planner, name)
  if name in _BATCHES:
    from jaxsft.collation import batches

    return getattr(batches, name)
  raise AttributeError(f"module 'jaxsft.collation' has no attribute {name!r}")
