"""What a run pays to compile, counted from JAX's own events, and what it is predicted to pay.

Counting (`CompileLedger`). Every program JAX builds emits a trace, a lowering and a backend
event; with a persistent compilation cache the backend event wraps the cache lookup, and a hit
also emits '/jax/compilation_cache/cache_hits' (a miss '/cache_misses'). A program's compile
seconds are

    seconds = trace + lowering + backend      (backend: XLA's compile, or the cache read on a hit)

so a warm cache still pays the trace and lowering of every program: only XLA's part is saved, and
only for the programs JAX writes to the cache (those that took at least
`jax_persistent_cache_min_compile_time_secs` to compile; the miss event marks the write). The backend
seconds of the written programs are what a warm cache saves. `CompileTally` holds the sums (and
counts) at one moment; the difference of two is a phase's.

Predicting (`predict_compiles`). The programs a run compiles are, per shape s of the probes and the
plan, the train step (and the evaluation when there is held-out data), priced together as

    cold(s) = p + q·T_s                          (fitted to cold compiles timed on this machine)
    warm(s) = w · cold(s)                        (w: the share of trace + lowering in a cold compile,
                                                  or fitted to warm compiles where some were timed)

plus the generation's programs (one per padded prompt width: base and tuned share them, the same graph
with the LoRA zeroed) and the run's other programs (optimizer init, copies), priced from the last run
on this machine in the same cache state; warm where no warm run was seen, as the cold run's seconds
less the XLA seconds of those it wrote to the cache. A program is
predicted warm where this machine's calibration remembers compiling it into the same cache folder,
cold otherwise:

    predicted = Σ_{programs P} (warm(P) if P was cached before else cold(P)).

The calibration (`Calibration`) is a JSON file under jaxsft's cache, one per CPU model and matrix
flags, jax version, model config and dtype (`calibration_key`): the cold and warm samples of every
run, written whole (atomically) after the warm-up.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import pathlib
from typing import Iterable, Sequence

import numpy as np

log = logging.getLogger("jaxsft.compiles")

TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
BACKEND_EVENT = "/jax/core/compile/backend_compile_duration"
HIT_EVENT = "/jax/compilation_cache/cache_hits"
MISS_EVENT = "/jax/compilation_cache/cache_misses"


@dataclasses.dataclass(frozen=True)
class CompileTally:
  """Sums at one moment: `programs` lowered, of them `cache_hits` / `cache_misses` in the persistent
  cache (both 0 without one), `seconds` of trace + lowering + backend, `front_seconds` of trace +
  lowering alone (what a cache hit still pays), `written_backend_seconds` the backend seconds of the
  programs written to the persistent cache (`cache_misses`: what a warm cache saves of them)."""

  programs: int = 0
  cache_hits: int = 0
  cache_misses: int = 0
  seconds: float = 0.0
  front_seconds: float = 0.0
  written_backend_seconds: float = 0.0

  def __sub__(self, earlier: CompileTally) -> CompileTally:
    return CompileTally(*(getattr(self, f.name) - getattr(earlier, f.name) for f in dataclasses.fields(self)))

  def __add__(self, other: CompileTally) -> CompileTally:
    return CompileTally(*(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)))

  @property
  def cache_state(self) -> str:
    """'none' (nothing compiled), 'cold' (no program found in the persistent cache, or no cache),
    'warm' (every program found) or 'partial'."""
    if self.programs == 0:
      return "none"
    if self.cache_hits == 0:
      return "cold"
    return "warm" if self.cache_misses == 0 else "partial"

  def to_dict(self) -> dict:
    return {"programs": self.programs, "cache_hits": self.cache_hits, "cache_misses": self.cache_misses,
            "seconds": round(self.seconds, 3), "cache_state": self.cache_state}


class CompileLedger:
  """Listens to JAX's compile events for the life of the process (listeners cannot be removed, so
  there is one: `ledger()`)."""

  def __init__(self):
    import jax

    self._sums = {"programs": 0, "cache_hits": 0, "cache_misses": 0, "seconds": 0.0, "front_seconds": 0.0,
                  "written_backend_seconds": 0.0}
    # JAX records a program's cache write (the miss event) inside its backend step, before that step's
    # duration: the duration that follows a write is the written program's.
    self._writing = False
    jax.monitoring.register_event_duration_secs_listener(self._on_duration)
    jax.monitoring.register_event_listener(self._on_event)

  def _on_duration(self, event: str, duration: float, **kwargs):
    if event in (TRACE_EVENT, LOWER_EVENT):
      self._sums["seconds"] += duration
      self._sums["front_seconds"] += duration
    elif event == BACKEND_EVENT:
      self._sums["programs"] += 1
      self._sums["seconds"] += duration
      if self._writing:
        self._sums["written_backend_seconds"] += duration
      self._writing = False

  def _on_event(self, event: str, **kwargs):
    if event == HIT_EVENT:
      self._sums["cache_hits"] += 1
    elif event == MISS_EVENT:
      self._sums["cache_misses"] += 1
      self._writing = True

  def tally(self) -> CompileTally:
    return CompileTally(**self._sums)


_LEDGER: CompileLedger | None = None


def ledger() -> CompileLedger:
  global _LEDGER
  if _LEDGER is None:
    _LEDGER = CompileLedger()
  return _LEDGER


# ---------------------------------------------------------------------------------------------
# The calibration: this machine's compile seconds, kept between runs.


def machine_description() -> dict:
  """What a compile's seconds depend on besides the program: the CPU (model name and matrix
  flags), the JAX version and the device kind."""
  import jax

  from jaxsft.matmul import cpu_features

  try:
    cpuinfo = pathlib.Path("/proc/cpuinfo").read_text()
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), "")
  except OSError:
    cpu = ""
  return {"cpu": cpu, "cpu_flags": list(cpu_features()), "jax": jax.__version__,
          "device": jax.devices()[0].device_kind}


def calibration_key(machine: dict, program_config: dict) -> str:
  """sha256 (16 hex digits) of the machine and of the config that shapes the programs (model, dtype,
  adapters, optimizer, mode, mesh)."""
  text = json.dumps({"machine": machine, "program": program_config}, sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclasses.dataclass
class Calibration:
  """Compile seconds seen on this machine for this model and config.

  `cold` / `warm`: (B, T, seconds) of a shape's train step and evaluation, compiled with no program
  found in the persistent cache / every program found; `front_share`: trace + lowering over the whole
  of the cold compiles (the part a hit still pays); `generate`: (rows, P, seconds) of a generation
  program, cold; `fixed`: {"cold": s, "warm": s} of the run's other programs (optimizer init,
  copies, eager ops), the last run of each, and "saved_by_cache": the XLA seconds of the cold run's
  that were written to the persistent cache; `cached`: per persistent cache folder, the programs
  compiled into it (`signature`)."""

  cold: list = dataclasses.field(default_factory=list)
  warm: list = dataclasses.field(default_factory=list)
  front_share: float | None = None
  generate: list = dataclasses.field(default_factory=list)
  fixed: dict = dataclasses.field(default_factory=dict)
  cached: dict = dataclasses.field(default_factory=dict)

  @staticmethod
  def path(root: pathlib.Path, key: str) -> pathlib.Path:
    return root / "compile_calibration" / f"{key}.json"

  @classmethod
  def load(cls, path: pathlib.Path) -> Calibration:
    """The file's calibration; an empty one where there is none or it does not read."""
    try:
      data = json.loads(path.read_text())
      return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})
    except (OSError, ValueError, TypeError) as e:
      if path.exists():
        log.warning("compile calibration %s not read (%s): starting a new one", path, e)
      return cls()

  def save(self, path: pathlib.Path) -> None:
    from jaxsft import io

    path.parent.mkdir(parents=True, exist_ok=True)
    io.write_json(path, dataclasses.asdict(self))


def merge_samples(old: Iterable, new: Iterable) -> list:
  """(B, T, seconds) samples: the new ones, and the old ones of shapes the new do not time."""
  new = [list(s) for s in new]
  seen = {(s[0], s[1]) for s in new}
  return sorted([list(s) for s in old if (s[0], s[1]) not in seen] + new)


def signature(kind: str, shape: Sequence[int], extra: str = "") -> str:
  """A program's name in `Calibration.cached`: its kind, shape and what else selects it."""
  return f"{kind}:{int(shape[0])}x{int(shape[1])}:{extra}"


# ---------------------------------------------------------------------------------------------
# The prediction: pure functions of numbers.


def fit_linear_in_width(samples: Sequence[Sequence[float]]) -> tuple[float, float] | None:
  """(p, q) of seconds = p + q·T, non-negative least squares over (B, T, seconds); p alone with one
  distinct width; None without samples."""
  if not samples:
    return None
  widths = np.array([float(s[1]) for s in samples])
  seconds = np.array([float(s[2]) for s in samples])
  if len(set(widths.tolist())) < 2:
    return float(seconds.mean()), 0.0
  from scipy.optimize import nnls

  design = np.stack([np.ones_like(widths), widths], axis=1)
  scale = np.linalg.norm(design, axis=0)
  x, _ = nnls(design / scale, seconds)
  return tuple(float(v) for v in x / scale)


@dataclasses.dataclass(frozen=True)
class CompilePrices:
  """cold(T) = p + q·T; warm(T) = warm fit where warm compiles were timed, else front_share·cold(T).
  `generate`: cold seconds of one generation program (its warm price: front_share of it); `fixed`:
  {"cold", "warm"} seconds of the run's other programs and, of the cold, "saved_by_cache": the XLA
  seconds of those written to the persistent cache. `source` says where each number came from."""

  cold: tuple[float, float]
  warm: tuple[float, float] | None
  front_share: float
  generate: float
  fixed: dict
  source: str

  def shape_seconds(self, width: int, cached: bool) -> float:
    if not cached:
      return self.cold[0] + self.cold[1] * width
    if self.warm is not None:
      return self.warm[0] + self.warm[1] * width
    return self.front_share * (self.cold[0] + self.cold[1] * width)

  def generate_seconds(self, cached: bool) -> float:
    return self.front_share * self.generate if cached else self.generate

  def fixed_seconds(self, cached: bool) -> float:
    """The other programs: as last seen in this cache state. Warm, unseen: the cold run's seconds
    less the XLA seconds of the programs it wrote to the cache (`saved_by_cache`). Most of these
    programs compile too fast to be written and cost a warm run what they cost a cold one; on a slow
    CPU a few take longer than the cache's threshold and are read instead."""
    cold = self.fixed.get("cold", 0.0)
    if not cached:
      return cold
    return self.fixed.get("warm", max(cold - self.fixed.get("saved_by_cache", 0.0), 0.0))


DEFAULT_FRONT_SHARE = 0.3
"""Trace + lowering over a whole cold compile where none was timed (jaxsft's train step on a CPU)."""


def prices(calibration: Calibration, fallback_cold: tuple[float, float]) -> CompilePrices:
  """This machine's prices from `calibration` (this run's samples merged in already); where it has
  no cold compile, `fallback_cold` (the default cost's p, q) prices the shapes and a generation
  program is priced as a shape of width 128."""
  cold = fit_linear_in_width(calibration.cold)
  sources = ["cold: " + (f"{len(calibration.cold)} shapes timed here" if cold else "default")]
  cold = cold or tuple(fallback_cold)
  warm = fit_linear_in_width(calibration.warm)
  if warm:
    sources.append(f"warm: {len(calibration.warm)} shapes timed here")
  share = calibration.front_share if calibration.front_share is not None else DEFAULT_FRONT_SHARE
  if calibration.generate:
    generate = float(np.mean([s[2] for s in calibration.generate]))
    sources.append("generate: timed here")
  else:
    generate = cold[0] + cold[1] * 128
    sources.append("generate: as a 128-wide shape")
  if calibration.fixed:
    sources.append("other programs: " + ", ".join(k for k in ("cold", "warm") if k in calibration.fixed) + " timed here")
  return CompilePrices(cold, warm, share, generate, dict(calibration.fixed), "; ".join(sources))


@dataclasses.dataclass(frozen=True)
class CompileForecast:
  """The predicted compile seconds, the programs counted (per kind) and the cache state foreseen."""

  seconds: float
  programs: dict
  cached: int
  cache_state: str

  def to_dict(self) -> dict:
    return {"seconds": round(self.seconds, 3), "programs": self.programs, "cached": self.cached,
            "cache_state": self.cache_state}


def predict_compiles(prices: CompilePrices, shape_programs: Sequence[tuple[tuple[int, int], str]], *,
                     with_eval: bool, generation_programs: Sequence[str] = (), cached: set,
                     cache_enabled: bool = True) -> CompileForecast:
  """Σ over the shapes compiled (probes and plan; `shape_programs`: (shape, what else selects the
  program), each distinct one compiled once) of cold or warm(s), + the generation programs (their
  signatures; each warm where cached) + the other programs. A program is cached where `cached`
  holds its signature; the other programs where 'other' is (a run with this cache folder before)."""
  cached = cached if cache_enabled else set()
  seconds, hits = 0.0, 0
  distinct = sorted({signature("train", shape, extra): int(shape[1]) for shape, extra in shape_programs}.items())
  for name, width in distinct:
    hit = name in cached
    hits += hit
    seconds += prices.shape_seconds(width, hit)
  generation = sorted(set(generation_programs))
  for name in generation:
    hit = name in cached
    hits += hit
    seconds += prices.generate_seconds(hit)
  seconds += prices.fixed_seconds("other" in cached)
  programs = {"train_step": len(distinct), "evaluate": len(distinct) if with_eval else 0,
              "generate": len(generation)}
  total = len(distinct) + len(generation)
  found = hits
  state = "cold" if found == 0 else ("warm" if found == total else "partial")
  return CompileForecast(seconds, programs, found, state)


def generation_widths(prompt_lengths: Sequence[int], *, batch_size: int, prompt_multiple: int) -> list[int]:
  """The padded prompt widths `generate` compiles for: prompts sorted by length, `batch_size` at a
  time, each chunk's longest rounded up to `prompt_multiple` (jaxsft.generate.generate's rule)."""
  ordered = sorted(prompt_lengths)
  widths = {-(-max(ordered[i:i + batch_size]) // prompt_multiple) * prompt_multiple
            for i in range(0, len(ordered), batch_size)}
  return sorted(widths)
