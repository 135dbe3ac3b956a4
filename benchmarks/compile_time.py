"""Compile time of the trainer's step, per model family, at SmolLM2-135M's width and depth.

    python -m benchmarks.compile_time [--quick] [--shapes 8x128 4x512] [--reps 3] [--layers 30]

Every supported family (`jaxsft.models.families`) as a 30-layer model of SmolLM2-135M's width
(hidden 576, SwiGLU/GeGLU 1536, 9 heads / 3 KV heads of 64, vocab 49,152, tied embeddings), built
by `from_hf_config` from a `config.json` dict with the family's own layer pattern:

  llama        the reference (SmolLM2-135M itself)
  mistral      one sliding window (4,096, Mistral-7B-v0.1's) on every layer
  qwen2        q/k/v biases, no sliding layers (Qwen2.5's use_sliding_window false)
  qwen3        RMSNorm per head on q and k, no sliding layers (like Qwen3-0.6B)
  gemma3_text  5 sliding (window 512, RoPE base 1e4) : 1 full (RoPE base 1e6) layers, (1 + w) norms
               before and after attention and MLP, q/k norms, GeGLU, scaled embeddings
  smollm3      every 4th layer without RoPE (NoPE), as SmolLM3-3B
  phi3         fused qkv_proj and gate_up_proj, partial_rotary_factor 1.0, sliding window 2,047
               on every layer (Phi-3-mini-4k's)
  olmo2        norms after attention and MLP, q/k norms over the whole projection

LoRA r 16 / alpha 32 on all-linear (the trainer's default), float32 on a CPU. What is timed is
`benchmarks.common.JaxsftStep.warm_up` of one bucket shape: `jaxsft.step.CompiledSteps.warm_up`
(fused: one `train_step` executable, zeros -> accumulate -> apply, the trainer's path with
grad_accum 1), i.e. trace + lower + XLA compile of `make_step_functions`' step. JAX's own
compile events split it into tracing, lowering to MLIR and the XLA backend compile.

Every measurement is a fresh subprocess with the persistent compilation cache off
(JAX_COMPILATION_CACHE_DIR removed from its environment, JAX_ENABLE_COMPILATION_CACHE=false; the
worker checks that no cache directory is configured), so every compile is cold. Families are
interleaved (the order rotates every repetition), `--reps` repetitions; reported: median and
min seconds per family and shape, and their ratio to llama's. A depth check compiles one family
(`--depth-family`) at `--depth-layers` and `--layers` layers: the scanned stack should make
compile time flat in depth. Each run also counts the ops of the optimized HLO (whole module,
and inside the layer scans' while bodies, fusions included), to explain a family that compiles
slower.

Writes benchmarks/results/compile_time{suffix}.json and .md.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import time

from benchmarks import common

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "smollm3", "phi3", "olmo2")
REFERENCE = "llama"
TARGET_RATIO = 1.5
LORA_R, LORA_ALPHA = 16, 32.0


# --------------------------------------------------------------------------- the models
def hf_config(family: str, num_layers: int) -> dict:
  """A `config.json` dict of `family` at SmolLM2-135M's width with `num_layers` layers and the
  family's own per-layer pattern (see the module docstring)."""
  from jaxsft.models.families import SUPPORTED_MODEL_TYPES

  base = {"architectures": [SUPPORTED_MODEL_TYPES[family]], "model_type": family, "vocab_size": 49152,
          "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": num_layers,
          "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-5,
          "max_position_embeddings": 8192, "tie_word_embeddings": True, "hidden_act": "silu",
          "rope_theta": 100000.0, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
  if family == "mistral":
    base.update(rope_theta=10000.0, sliding_window=4096)
  elif family == "qwen2":
    base.update(rope_theta=1000000.0, use_sliding_window=False, sliding_window=4096, max_window_layers=num_layers)
  elif family == "qwen3":
    base.update(rope_theta=1000000.0, use_sliding_window=False, sliding_window=None, max_window_layers=num_layers,
                attention_bias=False)
  elif family == "gemma3_text":
    del base["hidden_act"]
    base.update(hidden_activation="gelu_pytorch_tanh", rope_theta=1000000.0, rope_local_base_freq=10000.0,
                sliding_window=512, sliding_window_pattern=6, query_pre_attn_scalar=64,
                final_logit_softcapping=None, attn_logit_softcapping=None, attention_bias=False, rms_norm_eps=1e-6)
  elif family == "smollm3":
    base.update(rope_theta=2000000.0, use_sliding_window=False, sliding_window=None,
                no_rope_layers=[int((i + 1) % 4 != 0) for i in range(num_layers)])
  elif family == "phi3":
    base.update(rope_theta=10000.0, sliding_window=2047, partial_rotary_factor=1.0, attention_bias=False)
  elif family == "olmo2":
    base.update(rope_theta=500000.0, attention_bias=False, rms_norm_eps=1e-6)
  return base


def model_config(family: str, num_layers: int):
  from jaxsft.models.families import from_hf_config

  return from_hf_config(hf_config(family, num_layers))


def describe_config(config) -> str:
  """The layer pattern `config` ended up with (what the scan indexes per layer)."""
  windows = config.layer_windows()
  kinds = config.layer_rope_kinds()
  parts = []
  if any(w is not None for w in windows):
    n = sum(w is not None for w in windows)
    parts.append(f"{n}/{config.num_layers} layers sliding ({config.sliding_window})")
  counts = collections.Counter(kinds)
  if len(counts) > 1 or "global" not in counts:
    parts.append("RoPE " + ", ".join(f"{k} x{v}" for k, v in counts.items()))
  switches = [s for s, on in (("q/k norm " + str(config.qk_norm), config.qk_norm), ("fused qkv/gate_up",
              config.fused_projections), ("qkv bias", config.qkv_bias), (f"{config.norm_placement}-norm",
              config.norm_placement != "pre"), ("GeGLU", config.hidden_act != "silu")) if on]
  return "; ".join(parts + switches) or "plain Llama"


# --------------------------------------------------------------------------- HLO op counts
_COMP_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][\w\-]*)\(")
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition|branch_computations|true_computation|"
                     r"false_computation)=(?:\{([^}]*)\}|%?([\w.\-]+))")
_WHILE_BODY = re.compile(r"\swhile\(.*body=%?([\w.\-]+)")


_SHAPE = re.compile(r"\b(pred|[sufb]f?\d+)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8}


def _carried(header: str, num_layers: int | None) -> dict:
  """What a while body carries (its parameter tuple, from the computation's header): how many
  values, and how many of them are stacked per layer (leading dimension `num_layers`: the
  activations the forward scan saves for the backward one), with their size."""
  params = header.split(") -> ")[0]
  shapes = [(dt, [int(d) for d in dims.split(",") if d]) for dt, dims in _SHAPE.findall(params)]
  out = {"carried": len(shapes)}
  if num_layers:
    stacked = [(dt, dims) for dt, dims in shapes if dims and dims[0] == num_layers]
    size = lambda dt, dims: _BYTES.get(dt, 4) * math.prod(dims)  # noqa: E731
    out.update(stacked=len(stacked), stacked_mib=round(sum(size(*x) for x in stacked) / 2**20, 1),
               stacked_bool_mib=round(sum(size(*x) for x in stacked if x[0] == "pred") / 2**20, 1))
  return out


def hlo_op_counts(text: str, num_layers: int | None = None) -> dict:
  """Op counts of an optimized HLO module's text: every instruction of the module (fusion bodies
  included), and for each while loop (the layer scans, forward and backward, and any other loop)
  the instructions of its body with everything it calls, which ops dominate there, and what the
  loop carries (`_carried`: with `num_layers`, the values stacked per layer)."""
  comps: dict[str, list[str]] = {}
  headers: dict[str, str] = {}
  entry, current = None, None
  for line in text.splitlines():
    if current is None:
      m = _COMP_HEADER.match(line)
      if m and not line.startswith("HloModule"):
        current = m.group(2)
        comps[current] = []
        headers[current] = line
        if m.group(1):
          entry = current
      continue
    if line.strip() == "}":
      current = None
      continue
    comps[current].append(line)

  def ops(name):
    return [m.group(2) for line in comps.get(name, []) if (m := _INSTR.match(line))]

  def called(name):
    out = []
    for line in comps.get(name, []):
      for m in _CALLED.finditer(line):
        out += [c.strip().lstrip("%") for c in (m.group(1) or m.group(2)).split(",") if c.strip()]
    return out

  def closure(name, seen=None):
    seen = set() if seen is None else seen
    if name in seen or name not in comps:
      return seen
    seen.add(name)
    for c in called(name):
      closure(c, seen)
    return seen

  def count(names):
    return collections.Counter(op for n in names for op in ops(n))

  reachable = closure(entry) if entry else set(comps)
  total = count(reachable)
  loops = []
  for name in reachable:
    for line in comps[name]:
      m = _WHILE_BODY.search(line)
      if m:
        body = closure(m.group(1))
        c = count(body)
        loops.append({"body": m.group(1), "ops": sum(c.values()), "fusions": c.get("fusion", 0),
                      "top": dict(c.most_common(8)), **_carried(headers.get(m.group(1), ""), num_layers)})
  loops.sort(key=lambda x: -x["ops"])
  return {"module_ops": sum(total.values()), "module_fusions": total.get("fusion", 0),
          "module_top": dict(total.most_common(10)), "computations": len(reachable), "while_loops": loops[:6]}


# --------------------------------------------------------------------------- the worker (subprocess)
def train_config():
  """The trainer's config as the benchmark runs it: LoRA r 16 / alpha 32 on all-linear (the
  trainer's default.yaml), AdamW after global-norm clipping (`common.train_config`)."""
  from jaxsft import config as config_lib

  cfg = common.train_config()
  cfg.lora = config_lib.LoraConfig(r=LORA_R, alpha=LORA_ALPHA, dropout=0.0, target_modules=("all-linear",))
  return cfg


def worker(family: str, num_layers: int, shape: tuple[int, int], *, hlo: bool = True) -> dict:
  """Builds the model and the trainer's step, then times `warm_up` of `shape` (one cold compile)."""
  import jax

  jax.config.update("jax_enable_compilation_cache", False)
  if jax.config.jax_compilation_cache_dir:
    raise SystemExit(f"a persistent compilation cache is configured ({jax.config.jax_compilation_cache_dir}): "
                     "the compile would not be cold")
  events: dict[str, list[float]] = collections.defaultdict(list)
  jax.monitoring.register_event_duration_secs_listener(lambda e, d, **kw: events[e].append(d))
  cache_events: list[str] = []
  jax.monitoring.register_event_listener(lambda e, **kw: cache_events.append(e) if "cache" in e else None)

  from jaxsft.models import init_random

  t0 = time.perf_counter()
  config = model_config(family, num_layers)
  model = init_random(config, dtype="float32", seed=0)
  step = common.JaxsftStep(model, train_config())
  setup_s = time.perf_counter() - t0
  marks = {e: len(v) for e, v in events.items()}  # the optimizer init compiled above; count from here
  cpu0 = time.process_time()
  warm = step.warm_up([tuple(shape)])
  compile_cpu_s = time.process_time() - cpu0
  phase = {e: sum(v[marks.get(e, 0):]) for e, v in events.items()}
  out = {"family": family, "layers": num_layers, "shape": f"{shape[0]}x{shape[1]}", "pattern": describe_config(config),
         "compile_s": warm["seconds"], "xla_s": warm["xla_seconds"], "compiles": warm["compiles"],
         "compile_cpu_s": compile_cpu_s,
         "trace_s": phase.get("/jax/core/compile/jaxpr_trace_duration", 0.0),
         "lower_s": phase.get("/jax/core/compile/jaxpr_to_mlir_module_duration", 0.0),
         "setup_s": setup_s, "lora_params": int(sum(x.size for x in jax.tree.leaves(step.lora))),
         "cache_events": sorted(set(cache_events)), "backend": jax.default_backend(),
         "peak_rss_mib": common.peak_rss_mib()}
  compiled = step.steps.compiled("train_step", tuple(shape))
  memory = compiled.memory_analysis()
  if memory is not None:
    out["temp_mib"] = memory.temp_size_in_bytes / 2**20  # XLA's buffers for the step's intermediates
  if hlo:
    out["hlo"] = hlo_op_counts(compiled.as_text(), num_layers)
  return out


def cold_env() -> dict:
  """The worker's environment: CPU unless asked otherwise, no persistent compilation cache."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  env.update(JAX_ENABLE_COMPILATION_CACHE="false", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
             PYTHONPATH=str(common.ROOT))
  env.setdefault("JAX_PLATFORMS", "cpu")
  return env


def run_worker(family: str, num_layers: int, shape, *, hlo: bool, timeout: int, busy: float | None = None,
               log=print) -> dict:
  """One cold compile in a fresh process; `busy`: the cores other work kept busy just before."""
  cmd = [sys.executable, "-m", "benchmarks.compile_time", "--worker", family, "--worker-layers", str(num_layers),
         "--worker-shape", f"{shape[0]}x{shape[1]}"] + ([] if hlo else ["--no-hlo"])
  load = os.getloadavg()[0]
  t0 = time.perf_counter()
  try:
    proc = subprocess.run(cmd, cwd=common.ROOT, env=cold_env(), capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    log(f"  {family} {num_layers}L {shape}: no result within {timeout} s")
    return {"status": "timeout", "load_average_at_start": load}
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  if proc.returncode != 0 or not lines:
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
    log(f"  {family} {num_layers}L {shape}: failed (exit {proc.returncode}): {' | '.join(tail)}")
    return {"status": "failed", "returncode": proc.returncode, "error": "\n".join(tail), "load_average_at_start": load}
  out = json.loads(lines[-1][len("RESULT "):])
  out.update(status="ok", process_wall_s=time.perf_counter() - t0, load_average_at_start=load,
             busy_cores_at_start=busy, contended=busy is not None and busy > BUSY_LIMIT)
  loops = (out.get("hlo") or {}).get("while_loops") or []
  log(f"  {family:12} {num_layers:2}L {out['shape']:>6}: compile {out['compile_s']:6.2f} s (trace {out['trace_s']:.2f}, "
      f"lower {out['lower_s']:.2f}, XLA {out['xla_s']:.2f}; CPU {out['compile_cpu_s']:.2f}; {out['compiles']} compile(s)), "
      f"load {load:.2f}, other work {busy or 0:.2f} cores"
      + (f", HLO {out['hlo']['module_ops']} ops, biggest loop {loops[0]['ops']}, "
         f"{min(l.get('stacked', 0) for l in loops[:2])} per-layer values in the forward scan" if loops else ""))
  return out


BUSY_LIMIT = 0.3  # cores busy with other work (sampled while no worker runs) above which a run is contended


def busy_cores(seconds: float = 1.0) -> float:
  """Cores kept busy by other processes over `seconds` (from /proc/stat; this process only sleeps
  meanwhile and no worker runs). The 1-minute load average cannot tell: it still holds the
  previous worker's compile for a minute."""
  def sample():
    with open("/proc/stat") as f:
      fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields[:8]), idle
  try:
    total0, idle0 = sample()
    time.sleep(seconds)
    total1, idle1 = sample()
  except OSError:
    return 0.0
  return (os.cpu_count() or 1) * (1 - (idle1 - idle0) / max(total1 - total0, 1))


def wait_for_quiet(limit_s: float, log=print) -> float:
  """Waits (up to `limit_s`) until other work keeps at most `BUSY_LIMIT` cores busy; returns the
  last sample."""
  t0 = time.perf_counter()
  busy = busy_cores(1.0 if limit_s > 0 else 0.25)
  while busy > BUSY_LIMIT and time.perf_counter() - t0 < limit_s:
    time.sleep(4)
    busy = busy_cores()
  if time.perf_counter() - t0 > 2:
    log(f"  waited {time.perf_counter() - t0:.0f} s for other work to stop ({busy:.2f} cores busy)")
  return busy


# --------------------------------------------------------------------------- the study
def _stats(runs: list[dict]) -> dict:
  ok = [r for r in runs if r.get("status") == "ok"]
  if not ok:
    return {"status": runs[0].get("status", "not run") if runs else "not run", "runs": len(runs)}
  hlo = next((r["hlo"] for r in ok if r.get("hlo")), None)  # counted once (rep 1): load-independent
  quiet = [r for r in ok if not r.get("contended")]
  left_out = len(ok) - len(quiet) if quiet else 0  # contended runs count only when no quiet run exists
  ok = quiet or ok
  secs = [r["compile_s"] for r in ok]
  pick = lambda key: common.median([r[key] for r in ok])  # noqa: E731
  return {"status": "ok", "runs": len(ok), "median_s": common.median(secs), "min_s": min(secs), "all_s": secs,
          "xla_median_s": pick("xla_s"), "trace_median_s": pick("trace_s"), "lower_median_s": pick("lower_s"),
          "load_average_at_start": [round(r["load_average_at_start"], 2) for r in ok],
          "contended": not quiet, "contended_runs_left_out": left_out,
          "busy_cores_at_start": [None if r.get("busy_cores_at_start") is None else round(r["busy_cores_at_start"], 2)
                                  for r in ok],
          "compile_cpu_median_s": pick("compile_cpu_s"),
          "pattern": ok[0]["pattern"], "lora_params": ok[0]["lora_params"], "hlo": hlo,
          "temp_mib": ok[0].get("temp_mib")}


def summarize(runs: dict, families, shapes, num_layers: int) -> dict:
  out = {}
  for b, t in shapes:
    key = f"{b}x{t}"
    per = {f: _stats(runs.get((f, num_layers, key), [])) for f in families}
    ref = per.get(REFERENCE, {})
    for f, s in per.items():
      if s.get("status") == "ok" and ref.get("status") == "ok":
        s["ratio_median"] = s["median_s"] / ref["median_s"]
        s["ratio_min"] = s["min_s"] / ref["min_s"]
        s["within_target"] = s["ratio_median"] <= TARGET_RATIO
    out[key] = per
  return out


def run_study(*, families=FAMILIES, shapes=((8, 128), (4, 512)), num_layers: int = 30, reps: int = 3,
              depth_family: str | None = REFERENCE, depth_layers: int = 15, depth_shapes=None, hlo: bool = True,
              quiet_wait: float = 0.0, timeout: int = 900, log=print) -> dict:
  families, shapes = list(families), [tuple(s) for s in shapes]
  depth_shapes = [tuple(s) for s in (depth_shapes or shapes)]
  result = {"machine": common.machine_info(), "families": families, "layers": num_layers,
            "shapes": [f"{b}x{t}" for b, t in shapes], "reps": reps, "lora": {"r": LORA_R, "alpha": LORA_ALPHA,
            "target_modules": "all-linear"}, "dtype": "float32", "reference": REFERENCE, "target_ratio": TARGET_RATIO,
            "configs": {f: hf_config(f, num_layers) for f in families}}
  log(f"machine: {common.machine_line(result['machine'])}")
  runs: dict = collections.defaultdict(list)
  order = []
  for rep in range(reps):
    rotated = families[rep % len(families):] + families[:rep % len(families)]  # interleaved, rotating start
    for shape in shapes:
      order += [(rep, f, num_layers, shape) for f in rotated]
    if depth_family is not None and depth_layers != num_layers:
      # the depth check's shallow runs interleaved with the rest (its deep runs are the main runs)
      order += [(rep, depth_family, depth_layers, shape) for shape in depth_shapes]
  for i, (rep, family, layers, shape) in enumerate(order):
    log(f"[{i + 1}/{len(order)}] rep {rep + 1}/{reps} {family} {layers} layers {shape[0]}x{shape[1]}")
    busy = wait_for_quiet(quiet_wait, log=log)
    runs[(family, layers, f"{shape[0]}x{shape[1]}")].append(
        run_worker(family, layers, shape, hlo=hlo and rep == 0, timeout=timeout, busy=busy, log=log))
  result["runs"] = [{"family": f, "layers": n, "shape": s, "runs": r} for (f, n, s), r in runs.items()]
  result["summary"] = summarize(runs, families, shapes, num_layers)
  if depth_family is not None and depth_layers != num_layers:
    depth = {}
    for b, t in depth_shapes:
      key = f"{b}x{t}"
      shallow, deep = _stats(runs[(depth_family, depth_layers, key)]), _stats(runs[(depth_family, num_layers, key)])
      entry = {str(depth_layers): shallow, str(num_layers): deep}
      if shallow.get("status") == "ok" and deep.get("status") == "ok":
        entry["ratio_median"] = deep["median_s"] / shallow["median_s"]
      depth[key] = entry
    result["depth"] = {"family": depth_family, "layers": [depth_layers, num_layers], "shapes": depth}
  result["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
  result["targets"] = {key: {f: s.get("within_target") for f, s in per.items()} for key, per in result["summary"].items()}
  return result


def _hlo_rows(per: dict) -> list[str]:
  """The HLO table of one shape: module and layer-scan op counts against llama's, what the scans
  carry per layer, and XLA's temporary buffers."""
  ref = (per.get(REFERENCE) or {}).get("hlo")
  lines = ["| family | module ops (vs llama) | layer-scan ops, fwd + bwd (vs llama) | per-layer values the forward "
           "scan carries (MiB; boolean MiB) | XLA temp MiB |", "| --- | ---: | ---: | ---: | ---: |"]
  def scan_ops(h):
    return sum(l["ops"] for l in h["while_loops"][:2])
  for f, s in per.items():
    h = s.get("hlo") if s.get("status") == "ok" else None
    if not h or not h.get("while_loops"):
      continue
    vs = (lambda a, b: f" ({a / b:.2f}x)") if ref and ref.get("while_loops") else (lambda a, b: "")
    # the forward scan: of the two layer scans the one carrying fewer per-layer values (the backward
    # one also carries the per-layer gradients)
    fwd = min(h["while_loops"][:2], key=lambda l: l.get("stacked", 0))
    stacked = (f"{fwd['stacked']} ({fwd['stacked_mib']:,.0f}; {fwd['stacked_bool_mib']:,.0f})" if "stacked" in fwd else "")
    temp = f"{s['temp_mib']:,.0f}" if s.get("temp_mib") is not None else ""
    lines.append(f"| {f} | {h['module_ops']:,}{vs(h['module_ops'], ref['module_ops']) if ref else ''} | "
                 f"{scan_ops(h):,}{vs(scan_ops(h), scan_ops(ref)) if ref else ''} | {stacked} | {temp} |")
  return lines


def findings(result: dict) -> list[str]:
  """Computed from the summary: the slowest family per shape against the target, and the depth check."""
  out = []
  for key, per in result["summary"].items():
    ok = {f: s for f, s in per.items() if s.get("status") == "ok" and "ratio_median" in s}
    if not ok:
      continue
    worst = max(ok, key=lambda f: ok[f]["ratio_median"])
    missed = [f for f, s in ok.items() if not s["within_target"]]
    out.append(f"{key}: slowest {worst} at {ok[worst]['ratio_median']:.2f}x llama's median "
               f"({ok[worst]['median_s']:.2f} s against {per[REFERENCE]['median_s']:.2f} s); "
               + (f"over the {result['target_ratio']}x target: {', '.join(missed)}." if missed else
                  f"every family within the {result['target_ratio']}x target."))
  d = result.get("depth")
  if d:
    a, b = d["layers"]
    ratios = [f"{key} {e['ratio_median']:.2f}x" for key, e in d["shapes"].items() if "ratio_median" in e]
    if ratios:
      out.append(f"depth: {d['family']} at {b} layers against {a}: " + ", ".join(ratios) + " (median s).")
  return out


def markdown(result: dict, command: str) -> str:
  m = result["machine"]
  lines = ["# Compile time of the train step per model family", "", f"`{command}`", "",
           f"Machine: {common.machine_line(m)}; load average at the end "
           f"{'/'.join(f'{x:.1f}' for x in result['load_average_at_end'])}.", "",
           f"Model: {result['layers']} layers at SmolLM2-135M's width (hidden 576, MLP 1536, 9 / 3 KV heads of 64, vocab "
           f"49,152), random weights, {result['dtype']}, built by `from_hf_config` from each family's `config.json` "
           f"dict; LoRA r {result['lora']['r']} / alpha {result['lora']['alpha']:g} on all-linear. Timed: the "
           "trainer's `CompiledSteps.warm_up` of one shape (trace + lower + XLA compile of the fused `train_step`), "
           f"each run a fresh process without a persistent compilation cache; families interleaved over "
           f"{result['reps']} repetition(s). Target: every family within {result['target_ratio']}x of "
           f"{result['reference']}'s median.", ""]
  lines += [f"- {x}" for x in findings(result)] + [""]
  for key, per in result["summary"].items():
    lines += [f"## {key}", "", "| family | layer pattern | median s | min s | ratio vs llama (median, min) | "
              "XLA s | compile CPU s | trace s | lower s | load at start | other work at start (cores) |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for f, s in per.items():
      if s.get("status") != "ok":
        lines.append(f"| {f} | | {s.get('status')} | | | | | | | | |")
        continue
      ratio = f"{s['ratio_median']:.2f}x, {s['ratio_min']:.2f}x" if "ratio_median" in s else ""
      if "ratio_median" in s and not s["within_target"]:
        ratio = f"**{ratio}**"
      mark = " (contended)" if s["contended"] else ""
      busy = ", ".join("?" if x is None else f"{x:.2f}" for x in s["busy_cores_at_start"])
      if s["contended_runs_left_out"]:
        busy += f" ({s['contended_runs_left_out']} contended left out)"
      lines.append(f"| {f}{mark} | {s['pattern']} | {s['median_s']:.2f} | {s['min_s']:.2f} | {ratio} | "
                   f"{s['xla_median_s']:.2f} | {s['compile_cpu_median_s']:.2f} | {s['trace_median_s']:.2f} | "
                   f"{s['lower_median_s']:.2f} | {', '.join(f'{x:.1f}' for x in s['load_average_at_start'])} | "
                   f"{busy} |")
    hlo = _hlo_rows(per)
    if len(hlo) > 2:
      lines += ["", f"The compiled {key} step (optimized HLO, from the first repetition):", ""] + hlo
    lines.append("")
  if result.get("depth"):
    d = result["depth"]
    a, b = d["layers"]
    lines += [f"## Depth: {d['family']} at {a} and {b} layers", "",
              f"| shape | {a} layers median s (min) | {b} layers median s (min) | {b} / {a} |", "| --- | ---: | ---: | ---: |"]
    for key, entry in d["shapes"].items():
      cells = []
      for n in (a, b):
        s = entry[str(n)]
        cells.append(f"{s['median_s']:.2f} ({s['min_s']:.2f})" if s.get("status") == "ok" else s.get("status", ""))
      ratio = f"{entry['ratio_median']:.2f}" if "ratio_median" in entry else ""
      lines.append(f"| {key} | {cells[0]} | {cells[1]} | {ratio} |")
    lines.append("")
  lines += ["median / min over the repetitions of the wall seconds of `warm_up` (one train_step executable); ratio = "
            "this family's / llama's. XLA s = JAX's backend-compile event, trace s / lower s = jaxpr tracing and "
            "lowering to MLIR (medians). compile CPU s = the process's CPU seconds during the compile (above the wall "
            "seconds: XLA compiles on several threads, so other work on the cores slows it). Load at start = 1-minute "
            "load average when each repetition started (it still holds the previous run's compile for a minute); "
            "other work at start = cores busy with other processes in the second before the run (from /proc/stat); "
            f"above {BUSY_LIMIT} a run is contended and left out whenever a quiet run of the same cell exists.", "",
            "HLO: module ops = instructions of the optimized module, fusion bodies included; layer-scan ops = the two "
            "biggest while loops (the forward and the backward layer scan) with everything they call; per-layer values "
            "= the forward scan's loop-carried values with a leading layer axis: the stacked layer weights and LoRA "
            "factors it reads, and the activations it saves for the backward scan, including any per-layer copies "
            "of masks (boolean) or RoPE tables; XLA temp = the compiled step's temporary buffers "
            "(`memory_analysis`).", ""]
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
  parser.add_argument("--shapes", nargs="+", default=None,
                      help="B x T bucket shapes (default: 8x128 4x512; with --quick 4x64)")
  parser.add_argument("--layers", type=int, default=30, help="decoder layers (default: %(default)s)")
  parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions (default: %(default)s)")
  parser.add_argument("--depth-family", default=REFERENCE, choices=FAMILIES + ("none",),
                      help="family of the depth check, or none (default: %(default)s)")
  parser.add_argument("--depth-layers", type=int, default=15, help="the depth check's shallow depth (default: %(default)s)")
  parser.add_argument("--depth-shapes", nargs="+", default=None, help="shapes of the depth check (default: --shapes)")
  parser.add_argument("--quiet-wait", type=float, default=120.0,
                      help="seconds to wait before each run for other work to stop (at most BUSY_LIMIT cores busy) "
                           "(default: %(default)s)")
  parser.add_argument("--timeout", type=int, default=900, help="seconds per run")
  parser.add_argument("--no-hlo", action="store_true", help="skip the HLO op counts (also the worker's flag)")
  parser.add_argument("--quick", action="store_true",
                      help="smoke run: 2 layers, one shape (4x64 unless --shapes), one repetition, no depth check, no waiting")
  parser.add_argument("--suffix", default="", help="result file suffix, e.g. _quick")
  parser.add_argument("--results-dir", default=str(common.RESULTS), help="where to write the results (default: %(default)s)")
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  parser.add_argument("--worker-layers", type=int, help=argparse.SUPPRESS)
  parser.add_argument("--worker-shape", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker:
    shape = tuple(int(x) for x in args.worker_shape.split("x"))
    print("RESULT " + json.dumps(worker(args.worker, args.worker_layers, shape, hlo=not args.no_hlo)), flush=True)
    return 0
  if args.quick:
    args.layers, args.shapes, args.reps, args.depth_family = 2, (args.shapes or ["4x64"])[:1], 1, "none"
    args.quiet_wait = 0.0
  args.shapes = args.shapes or ["8x128", "4x512"]
  shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
  depth_shapes = None if args.depth_shapes is None else [tuple(int(x) for x in s.split("x")) for s in args.depth_shapes]
  start = time.perf_counter()
  result = run_study(families=args.families, shapes=shapes, num_layers=args.layers, reps=args.reps,
                     depth_family=None if args.depth_family == "none" else args.depth_family,
                     depth_layers=args.depth_layers, depth_shapes=depth_shapes, hlo=not args.no_hlo,
                     quiet_wait=args.quiet_wait, timeout=args.timeout, log=lambda s: print(s, flush=True))
  result["seconds"] = time.perf_counter() - start
  command = "python -m benchmarks.compile_time " + " ".join(argv if argv is not None else sys.argv[1:])
  md = markdown(result, command.strip())
  out = pathlib.Path(args.results_dir)
  out.mkdir(parents=True, exist_ok=True)
  (out / f"compile_time{args.suffix}.json").write_text(json.dumps(result, indent=2, default=common._jsonable) + "\n")
  (out / f"compile_time{args.suffix}.md").write_text(md)
  print(md)
  print(f"total {result['seconds']:.0f} s; wrote {out}/compile_time{args.suffix}.{{json,md}}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
