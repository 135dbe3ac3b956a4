"""Instruction data: loading, chat-template masking, collation, bucket choice, Grain batches."""

from jaxsft.data.collate import (IGNORE_INDEX, PaddingCost, choose_buckets, collate, padding_cost, round_up,
                                 target_length)
from jaxsft.data.pipeline import (BATCHING, BatchPlan, BucketBatchIterDataset, PipelineStats, batch_shapes,
                                  make_batches, tokenized)
from jaxsft.data.records import FORMATS, DataError, Records, SkipReport, load_records, normalize_record
from jaxsft.data.tokenize import PLAIN_CHAT_TEMPLATE, render_with_spans, tokenize_example, tokenize_records

__all__ = [
    "BATCHING", "BatchPlan", "BucketBatchIterDataset", "DataError", "FORMATS", "IGNORE_INDEX",
    "PLAIN_CHAT_TEMPLATE", "PaddingCost", "PipelineStats", "Records", "SkipReport", "batch_shapes",
    "choose_buckets", "collate", "load_records", "make_batches", "normalize_record", "padding_cost",
    "render_with_spans", "round_up", "target_length", "tokenize_example", "tokenize_records", "tokenized",
]
