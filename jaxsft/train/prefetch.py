"""`DevicePrefetch`: the thread that pulls the next batches from the Grain pipeline and puts them
on the devices while the current step runs, each with the iterator's position after it."""

from __future__ import annotations

import dataclasses
import queue
import threading

from jaxsft import data as data_lib
from jaxsft import step as step_lib


class DevicePrefetch:
  """Pulls batches on a thread and puts them on the devices while the current step runs.

  Each item is (device batch, host facts, Grain state *after* that batch), so a checkpoint saves
  the position of the last consumed batch, not of the prefetched ones.
  """

  def __init__(self, iterator, put_on_device, size: int = 2, stats: data_lib.PipelineStats | None = None):
    self._queue: queue.Queue = queue.Queue(maxsize=size)
    self._iterator = iterator
    self._put = put_on_device
    self._stats = stats
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()

  def _run(self):
    try:
      for batch in self._iterator:
        if self._stop.is_set():
          return
        state = self._iterator.get_state()
        host = {"epoch": int(batch.get("epoch", 0)), "real_tokens": int(batch["attention_mask"].sum()),
                "shape": tuple(batch["input_ids"].shape)}
        if self._stats is not None:  # the pipeline's counts as of this batch (for the checkpoint)
          host["data_stats"] = dataclasses.asdict(self._stats)
        self._queue.put((self._put({k: batch[k] for k in step_lib.BATCH_KEYS if k in batch}), host, state))
      self._queue.put(StopIteration)
    except BaseException as e:  # surfaced in the training thread
      self._queue.put(e)

  def __iter__(self):
    return self

  def __next__(self):
    item = self._queue.get()
    if item is StopIteration:
      raise StopIteration
    if isinstance(item, BaseException):
      raise item
    return item

  def close(self):
    self._stop.set()
    try:
      while True:
        self._queue.get_nowait()
    except queue.Empty:
      pass
