"""Records of tabular data files, read through pyarrow: a parquet or Arrow file, a folder of
parquet shards or written by `datasets`' `save_to_disk`, and CSV/TSV files under a header line.
Each reader yields `(where, raw_record)` as `records.iter_raw` does ("row i", "SHARD row i")."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Iterator

from jaxsft.data.records import DataError, no_such_data
from jaxsft.errors import one_line

ARROW_SUFFIXES = (".parquet", ".arrow")
DELIMITED_SUFFIXES = {".csv": ",", ".csv.gz": ",", ".tsv": "\t", ".tsv.gz": "\t"}


def arrow_files(path: str) -> list[str]:
  """The Arrow/parquet files of a path, in order (see the module docstring)."""
  if not os.path.isdir(path):
    if not os.path.isfile(path):
      raise no_such_data(path)
    return [path]
  if os.path.isfile(os.path.join(path, "dataset_dict.json")):
    with open(os.path.join(path, "dataset_dict.json")) as f:
      splits = json.load(f).get("splits", [])
    split = "train" if "train" in splits else (splits[0] if len(splits) == 1 else None)
    if split is None:
      raise DataError(f"a DatasetDict folder without a 'train' split (splits: {splits}); pass the split's folder",
                      path=path)
    return arrow_files(os.path.join(path, split))
  if os.path.isfile(os.path.join(path, "state.json")):
    with open(os.path.join(path, "state.json")) as f:
      return [os.path.join(path, d["filename"]) for d in json.load(f)["_data_files"]]
  for suffix in ARROW_SUFFIXES:
    files = sorted(str(p) for p in pathlib.Path(path).rglob(f"*{suffix}"))
    if files:
      return files
  raise DataError("a folder without state.json, dataset_dict.json, parquet or arrow files", path=path)


def read_arrow(path: str) -> Iterator[tuple[str, Any]]:
  try:
    import pyarrow as pa
    import pyarrow.parquet as pq
  except ImportError:
    raise DataError("reading parquet/Arrow data needs pyarrow (pip install pyarrow)", path=path) from None
  files = arrow_files(path)
  for file in files:
    name = f"{os.path.relpath(file, path)} " if len(files) > 1 else ""
    try:
      if file.endswith(".parquet"):
        batches = pq.ParquetFile(file).iter_batches(batch_size=1024)
      else:
        source = pa.memory_map(file)
        try:
          batches = iter(pa.ipc.open_stream(source))
        except pa.ArrowInvalid:
          reader = pa.ipc.open_file(source)
          batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
      row = 0
      for batch in batches:
        for raw in batch.to_pylist():
          yield f"{name}row {row}", raw
          row += 1
    except (OSError, pa.ArrowException) as e:
      raise DataError(f"cannot read {file}: {one_line(e)}", path=path) from None


def read_delimited(path: str, delimiter: str) -> Iterator[tuple[str, Any]]:
  """`("row i", {column: text})` per row of a CSV or TSV file under a header line (`.gz` too): every
  cell is read as text, as written (an answer column of numbers stays "42", an empty cell ""), and a
  quoted cell may span lines. A row that does not parse stops the file, as in a JSON array."""
  try:
    import pyarrow as pa
    import pyarrow.csv as csv
  except ImportError:
    raise DataError("reading CSV/TSV data needs pyarrow (pip install pyarrow)", path=path) from None
  if not os.path.isfile(path):
    raise no_such_data(path)
  parse = csv.ParseOptions(delimiter=delimiter, newlines_in_values=True)

  def reader(column_types=None):
    return csv.open_csv(pa.input_stream(path, compression="detect"), parse_options=parse,
                        convert_options=csv.ConvertOptions(column_types=column_types, strings_can_be_null=False,
                                                           quoted_strings_can_be_null=False))

  row = 0
  try:
    names = reader().schema.names  # the header; the cells are then read as text, not inferred types
    for batch in reader({name: pa.string() for name in names}):
      for raw in batch.to_pylist():
        yield f"row {row}", raw
        row += 1
  except (OSError, EOFError, pa.ArrowException) as e:  # pyarrow's message quotes the row it stopped at
    raise DataError(f"cannot read: {one_line(e)}", path=path) from None
