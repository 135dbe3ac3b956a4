"""Instruction data: loading, chat-template masking, padding, Grain batches.

records.py (files -> chat records; json_array.py streams JSON arrays), template.py (chat templates:
rendering, the trained reply spans), tokenize.py (records -> token ids and labels), examples.py
(`TokenizedRecords`, in memory or from a store), collate.py (padding), bucketing.py
(length-grouped batching, bucketed packing), packing.py (packed modes; rows.py the rows of bucketed packing),
pipeline.py (the Grain chain and its entry points; pipeline_stats.py its counters), mix.py (several
sources drawn by weight: `data.mix`), store.py
(a file tokenized once into a memory-mapped token store), stats.py (token length statistics).
Which buckets, widths or mode a plan uses, and what it costs, is `jaxsft.collation`, the layer above:
nothing here imports it. Bucketed batching takes its boundaries as `bucket_lengths` (or a
`choose_shapes` that chooses them); `jaxsft.collation.make_batches` chooses them from the lengths.
"""

from jaxsft.config_checks import BATCHING
from jaxsft.data.collate import PaddingCost, bucket_index, collate, padding_cost, round_up, target_length
from jaxsft.data.examples import TokenizedRecords
from jaxsft.data.pipeline_stats import PipelineStats
from jaxsft.data.records import (FORMATS, ON_ERROR, DataError, Record, SkipReport, iter_records, load_records,
                                 normalize_record)
from jaxsft.data.store import StoreError, TokenStore, open_or_build
from jaxsft.data.template import PLAIN_CHAT_TEMPLATE, TRAIN_ON, SpanRenderer, render_with_spans
from jaxsft.data.tokenize import encode_batches, tokenize_example, tokenize_file, tokenize_records
from jaxsft.labels import IGNORE_INDEX  # re-exported: jaxsft.data.IGNORE_INDEX

# Grain imports jax as it loads, so the batching (bucketing.py, pipeline.py: Grain's datasets) is
# imported on first use of its names: reading, templates, tokenizing and the token store (and
# `python -m jaxsft.data build`) run without jax.
_BUCKETING = ("BatchPlan", "BucketBatchIterDataset")
_PIPELINE = ("batch_shapes", "count_batches", "dynamic_batch_shapes", "epoch_lengths", "make_batches")


def __getattr__(name: str):
  if name in _BUCKETING:
    from jaxsft.data import bucketing

    return getattr(bucketing, name)
  if name in _PIPELINE:
    from jaxsft.data import pipeline

    return getattr(pipeline, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BATCHING", "BatchPlan", "BucketBatchIterDataset", "DataError", "FORMATS", "IGNORE_INDEX", "ON_ERROR",
    "PLAIN_CHAT_TEMPLATE", "PaddingCost", "PipelineStats", "Record", "SkipReport", "SpanRenderer", "StoreError",
    "TRAIN_ON", "TokenStore", "TokenizedRecords", "batch_shapes", "bucket_index", "collate",
    "count_batches", "dynamic_batch_shapes", "epoch_lengths", "encode_batches", "iter_records", "load_records",
    "make_batches", "normalize_record",
    "open_or_build", "padding_cost", "render_with_spans", "round_up", "target_length", "tokenize_example",
    "tokenize_file", "tokenize_records",
]
