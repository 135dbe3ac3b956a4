"""Shared pieces of the benchmarks: paths, the machine, the models, data subsets, jaxsft's step.

The timed step is the trainer's own: `jaxsft.step.make_step_functions` (accumulate → apply: Σ grad
nll / Σ valid → clip → AdamW) compiled ahead of time per batch shape by `jaxsft.step.CompiledSteps`,
on the mesh the trainer builds (`jaxsft.sharding`). One benchmark step = one optimizer step with
one micro-batch, exactly what `python -m jaxsft.train` runs per step with `grad_accum=1`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
RESULTS = ROOT / "benchmarks" / "results"
SHARED_FILES = ("alpaca_en_demo.json", "chat_multiturn_demo.json", "oasst_top_paths.jsonl", "code_alpaca_2k.json",
                "gsm8k_test.jsonl")
# Files whose fields are not one of the formats `load_records` detects.
FIELD_MAPS = {"gsm8k_test.jsonl": {"instruction": "question", "output": "answer"}}
BUILTIN = "built-in (synthetic)"  # jaxsft's generated default dataset
REAL_MODEL = "smollm2-135m-instruct"


# --------------------------------------------------------------------------- machine
def read_cpuinfo() -> str:
  """/proc/cpuinfo's text ("" where there is none: not Linux)."""
  try:
    return pathlib.Path("/proc/cpuinfo").read_text()
  except OSError:
    return ""


def cpu_name(cpuinfo: str | None = None) -> str:
  """The CPU's model name, from `cpuinfo` (default: `read_cpuinfo()`)."""
  cpuinfo = read_cpuinfo() if cpuinfo is None else cpuinfo
  for line in cpuinfo.splitlines():
    if line.startswith("model name"):
      return line.split(":", 1)[1].strip()
  return platform.processor() or platform.machine()


def cpu_vector_isa(cpuinfo: str | None = None) -> str | None:
  """The widest x86 vector extension the CPU reports ("AVX-512", "AVX2", ...; from `cpuinfo`,
  default `read_cpuinfo()`), or None off Linux x86: the same model name can come with different
  kernels (XLA's and MKL's float32 and bfloat16 matmuls differ between AVX2 and AVX-512), so a
  figure names it."""
  cpuinfo = read_cpuinfo() if cpuinfo is None else cpuinfo
  flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
  names = [("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX"), ("sse4_2", "SSE4.2")]
  isa = next((name for flag, name in names if flag in flags), None)
  return f"{isa} + AMX" if isa and "amx_tile" in flags else isa


MATRIX_FLAGS = ("avx512f", "avx512_bf16", "amx_bf16")
"""The /proc/cpuinfo flags that decide which matmul kernels run: float32 on AVX-512, bfloat16 dot
products (avx512_bf16), and the AMX tiles (amx_bf16)."""


def cpu_matrix_flags(cpuinfo: str | None = None) -> tuple[str, ...]:
  """Which of `MATRIX_FLAGS` this CPU reports (from `cpuinfo`, default `read_cpuinfo()`)."""
  from jaxsft.matmul import cpu_features

  features = cpu_features(read_cpuinfo() if cpuinfo is None else cpuinfo)
  return tuple(f for f in MATRIX_FLAGS if f in features)


# Environment variables that change step times (compiler flags, the allocator, thread counts): a
# figure measured under any of them says so in its machine line. GLIBC_TUNABLES, for one, decides
# whether a step's large buffers are mapped and page-faulted afresh every step.
TIMING_ENVIRONMENT = ("XLA_FLAGS", "GLIBC_TUNABLES", "LD_PRELOAD", "MALLOC_ARENA_MAX", "OMP_NUM_THREADS",
                      "MKL_NUM_THREADS")


def timing_environment() -> dict[str, str]:
  """The `TIMING_ENVIRONMENT` variables set in this process (worker processes inherit them)."""
  return {name: os.environ[name] for name in TIMING_ENVIRONMENT if os.environ.get(name)}


def machine_info() -> dict[str, Any]:
  """Where the figures came from: CPU, cores, load, JAX backend and device, library versions, and
  the environment that changes timing."""
  import jax

  cpuinfo = read_cpuinfo()
  info = {"cpu": cpu_name(cpuinfo), "vector_isa": cpu_vector_isa(cpuinfo), "cpu_flags": list(cpu_matrix_flags(cpuinfo)),
          "cpus": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()],
          "python": platform.python_version(), "jax": jax.__version__, "backend": jax.default_backend(),
          "device": str(jax.devices()[0].device_kind), "device_count": jax.device_count(),
          "environment": timing_environment()}
  try:
    import flax

    info["flax"] = flax.__version__
  except ImportError:
    pass
  return info


def machine_line(info: dict) -> str:
  device = "" if info["backend"] == "cpu" else f", {info['device_count']}× {info['device']} ({info['backend']})"
  environment = "".join(f"; {name}={value}" for name, value in info.get("environment", {}).items())
  isa = f" ({info['vector_isa']})" if info.get("vector_isa") else ""
  if "cpu_flags" in info:  # older result files lack it
    isa += f" [flags: {' '.join(info['cpu_flags']) or 'none of ' + ' '.join(MATRIX_FLAGS)}]"
  return (f"{info['cpu']}{isa}, {info['cpus']} cores{device}; JAX {info['jax']}; 1/5/15-minute load average at start "
          f"{'/'.join(f'{x:.1f}' for x in info['load_average'])}{environment}")


def peak_rss_mib() -> float:
  """This process's peak resident set size (Linux ru_maxrss is KiB)."""
  import resource

  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_results(stem: str, result: dict, markdown: str, *, results_dir: pathlib.Path | None = None) -> None:
  """`<stem>.json` and `<stem>.md` in `results_dir` (default: benchmarks/results)."""
  results_dir = RESULTS if results_dir is None else results_dir
  results_dir.mkdir(parents=True, exist_ok=True)
  (results_dir / f"{stem}.json").write_text(json.dumps(result, indent=2, default=_jsonable) + "\n")
  (results_dir / f"{stem}.md").write_text(markdown)


def _jsonable(x):
  import numpy as np

  if isinstance(x, np.generic):
    return x.item()
  if isinstance(x, np.ndarray):
    return x.tolist()
  if dataclasses.is_dataclass(x):
    return dataclasses.asdict(x)
  return str(x)


def kernel_benchmark_parser(doc: str, *, calls: int) -> argparse.ArgumentParser:
  """The arguments of a jax-against-torch kernel benchmark run by `alternate_workers`."""
  parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--threads", type=int, default=2)
  parser.add_argument("--calls", type=int, default=calls)
  parser.add_argument("--reps", type=int, default=2)
  parser.add_argument("--suffix", default="", help="appended to the result files' name")
  parser.add_argument("--worker", choices=["jax", "torch"], help=argparse.SUPPRESS)
  return parser


def alternate_workers(module: str, frameworks: Sequence[str], worker_args: Sequence[str], *, reps: int,
                      threads: int) -> dict[str, list[dict]]:
  """Run `python -m module --worker F *worker_args` for each framework F, alternated `reps` times,
  each in a fresh process; every run's JSON result (its stdout's last line) gets the 1-minute
  load average at its start. The "jax" worker is pinned to `threads` cores with `taskset` when
  the machine has more (PyTorch is given its thread count by the worker)."""
  cores = ",".join(str(c) for c in range(min(threads, os.cpu_count() or 1)))
  runs: dict[str, list[dict]] = {f: [] for f in frameworks}
  for _ in range(reps):
    for framework in frameworks:
      load = os.getloadavg()[0]
      cmd = [sys.executable, "-m", module, "--worker", framework, *worker_args]
      if framework == "jax" and threads < (os.cpu_count() or 1):
        cmd = ["taskset", "-c", cores, *cmd]
      out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
      runs[framework].append({**json.loads(out.stdout.strip().splitlines()[-1]), "load_at_start": round(load, 2)})
      print(framework, runs[framework][-1], flush=True)
  return runs


def median_call_seconds(f, calls: int) -> float:
  """Median wall time of `calls` calls of f (which must wait for its result), after two warm-up calls."""
  f(), f()
  times = []
  for _ in range(calls):
    start = time.perf_counter()
    f()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def median(xs: Sequence[float]) -> float | None:
  xs = [x for x in xs if x is not None]
  return statistics.median(xs) if xs else None


# --------------------------------------------------------------------------- models
def smollm2_shaped(num_layers: int):
  """SmolLM2-135M's architecture (vocab 49,152, hidden 576, 9 heads / 3 KV heads, SwiGLU 1536,
  tied embeddings) with `num_layers` decoder layers instead of 30: the same per-layer and LM-head
  shapes, so a CPU can time it in seconds."""
  from jaxsft.models import LlamaConfig

  return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=num_layers,
                     num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                     tie_word_embeddings=True, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
                     pad_token_id=2)


def tiny_config():
  """The test suite's tiny Llama (2 layers, hidden 64) with the real 49,152-token vocabulary."""
  from jaxsft.models import LlamaConfig

  return LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, rope_theta=100000.0, tie_word_embeddings=True,
                     bos_token_id=1, eos_token_id=2, pad_token_id=2)


RANDOM_MODELS = {
    "smollm2-shaped-4l": lambda: smollm2_shaped(4),
    "smollm2-shaped-2l": lambda: smollm2_shaped(2),
    "tiny": tiny_config,
}


# The real configurations in configs/models (SmolLM2-135M, Llama-3.2-1B, Llama-3.1-8B), by file
# stem: random weights of the real shapes, drawn at load (speed and memory don't depend on values).
CONFIG_MODELS = {p.stem: p for p in sorted((ROOT / "configs" / "models").glob("*.json"))}


def random_model_config(name: str, *, num_layers: int | None = None):
  """The `LlamaConfig` of a random-weight model: a `RANDOM_MODELS` name or a `CONFIG_MODELS` stem,
  with `num_layers` decoder layers instead of the config's where given."""
  from jaxsft.models import from_hf_config

  if name in RANDOM_MODELS:
    config = RANDOM_MODELS[name]()
  elif name in CONFIG_MODELS:
    config = from_hf_config(json.loads(CONFIG_MODELS[name].read_text()))
  else:
    raise ValueError(f"no random-weight model {name!r}: use one of {sorted(RANDOM_MODELS) + sorted(CONFIG_MODELS)}")
  return dataclasses.replace(config, num_layers=num_layers) if num_layers else config


def describe_model(name: str) -> str:
  if name in CONFIG_MODELS:
    return f"`{name}`: random weights, the real configuration `configs/models/{name}.json`"
  if name in RANDOM_MODELS:
    c = RANDOM_MODELS[name]()
    return (f"`{name}`: random weights, SmolLM2-135M-Instruct's shapes but {c.num_layers} layers "
            f"(hidden {c.hidden_size}, vocab {c.vocab_size:,})" if c.hidden_size == 576 else
            f"`{name}`: random weights, {c.num_layers} layers, hidden {c.hidden_size}, vocab {c.vocab_size:,}")
  return f"`{name}` (real weights)"


def load_jax_model(name: str, *, dtype: str = "float32", seed: int = 0, attention: str = "xla"):
  """A jaxsft `CausalLM`: a random config from `RANDOM_MODELS`, or real weights by name/path."""
  from jaxsft.models import init_random, load_causal_lm

  if name in RANDOM_MODELS:
    return init_random(RANDOM_MODELS[name](), dtype=dtype, seed=seed, attention=attention)
  return load_causal_lm(name, dtype=dtype, attention=attention)


# --------------------------------------------------------------------------- data
def load_tokenizer():
  from jaxsft.models.hub import load_tokenizer as load

  return load(REAL_MODEL)


def dataset_records(name: str, *, limit: int | None, seed: int = 0):
  """A fixed subset: the first `limit` records of a seeded permutation of the file (or of jaxsft's
  built-in task set of 1,200 records, the trainer's default data), as a list."""
  import numpy as np

  from jaxsft.data import load_records

  if name == BUILTIN:
    from jaxsft.data import synthetic

    records = synthetic.make_dataset(1200, seed=0)
  else:
    # The skip policy a user's run would need (code_alpaca_2k holds two empty replies); load_records
    # logs what it skipped.
    records = load_records(SHARED / name, field_map=FIELD_MAPS.get(name), on_error="skip")
  order = np.random.default_rng(seed).permutation(len(records))
  if limit is not None:
    order = order[:limit]
  return [records[i] for i in order]


# --------------------------------------------------------------------------- jaxsft's train step
def train_config(*, lr: float = 1e-3, max_grad_norm: float = 1.0, lora_r: int = 8, lora_alpha: float = 16.0,
                 lora_targets: Sequence[str] = ("q_proj", "v_proj")):
  """The trainer's config for the benchmarks: LoRA (default r 8 / alpha 16 on q_proj, v_proj), no dropout;
  AdamW (b1 0.9, b2 0.999, eps 1e-8, no weight decay) at a constant `lr` after clipping the global
  gradient norm to `max_grad_norm`."""
  from jaxsft import config as config_lib

  cfg = config_lib.TrainConfig()
  cfg.lora = config_lib.LoraConfig(r=lora_r, alpha=float(lora_alpha), dropout=0.0, target_modules=tuple(lora_targets))
  cfg.optim = config_lib.OptimConfig(lr=lr, weight_decay=0.0, schedule="constant", warmup_steps=0,
                                     max_grad_norm=max_grad_norm)
  return cfg


class JaxsftStep:
  """jaxsft's train step as the trainer runs it: `CompiledSteps` (AOT per shape) on its mesh.

  `warm_up(shapes)` compiles every shape up front, like the trainer before step 1 (the fused
  one-dispatch `train_step`: one micro-batch per optimizer step); `step(batch)` runs one
  optimizer step and returns the loss (a float: the host waits for the step; the trainer reads
  it one step late instead).
  """

  def __init__(self, model, cfg, *, total_steps: int = 10_000, adapter_dir=None, pack_frozen: bool = True):
    import jax
    from flax import nnx

    from jaxsft import lora as lora_lib
    from jaxsft import sharding
    from jaxsft import step as step_lib
    from jaxsft.models.decoder import with_layers_packed

    lora_lib.apply_lora(model, r=cfg.lora.r, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout,
                        target_modules=cfg.lora.target_modules, seed=cfg.seed)
    if adapter_dir is not None:  # start from given LoRA factors (the same ones another framework gets)
      lora_lib.load_adapter(model, adapter_dir)
    self.mesh = sharding.make_mesh_context(cfg.mesh)
    graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
    schedule = step_lib.make_schedule(cfg.optim, total_steps)
    tx = step_lib.make_optimizer(cfg.optim, schedule)
    self.lora = self.mesh.replicate(lora)
    self.frozen = self.mesh.shard_frozen(frozen)
    if pack_frozen:  # as the trainer holds it (`Run.frozen`); else each step packs it (`benchmarks.frozen_packing`)
      self.frozen = with_layers_packed(self.frozen)
    self.opt_state = jax.jit(tx.init, out_shardings=self.mesh.replicated)(self.lora)
    self.steps = step_lib.CompiledSteps(step_lib.make_step_functions(graphdef, cfg), self.lora,
                                        self.opt_state, self.frozen, self.mesh, schedule)
    self.counter = step_lib.compile_counter()
    self.index = 0
    self.packed_keys = ("input_ids", "attention_mask", "labels", "segment_ids", "positions")

  def warm_up(self, shapes, *, packed: bool = False) -> dict[str, float]:
    """Compiles `shapes`; returns {"compiles", "xla_seconds", "seconds"} (wall, tracing included)."""
    keys = self.packed_keys if packed else ("input_ids", "attention_mask", "labels")
    count0, secs0, t0 = self.counter.count, self.counter.seconds, time.perf_counter()
    self.steps.warm_up(sorted(shapes), keys, with_eval=False, fused=True)
    return {"compiles": self.counter.count - count0, "xla_seconds": self.counter.seconds - secs0,
            "seconds": time.perf_counter() - t0}

  def step(self, batch: dict) -> float:
    import numpy as np

    from jaxsft.step import BATCH_KEYS

    device_batch = self.mesh.put_batch({k: batch[k] for k in BATCH_KEYS if k in batch})
    self.lora, self.opt_state, out = self.steps.train_step(self.lora, self.opt_state, self.frozen, device_batch,
                                                           np.int32(self.index))
    self.index += 1
    return float(out["loss"])

  @property
  def recompiles(self) -> int:
    return self.steps.recompiles
