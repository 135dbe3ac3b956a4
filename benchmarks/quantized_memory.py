"""What a quantized frozen base (model.quantize) costs and saves: bytes, an 8B LoRA step on a CPU, speed.

  python benchmarks/quantized_memory.py sizes            # bytes of the frozen base, every format
  python benchmarks/quantized_memory.py plan8b           # XLA's memory plan of that step, compiled, not run
  python benchmarks/quantized_memory.py step8b           # one NF4 LoRA step of Llama-3.1-8B's shapes, 1x256
  python benchmarks/quantized_memory.py step8b --quantize-embeddings  # the same, embeddings and LM head NF4 too
  python benchmarks/quantized_memory.py speed [--reps 3] # the real SmolLM2 at 8x128: float32 vs quantized
  python benchmarks/quantized_memory.py error            # rounding error per format, block size and scale dtype

`sizes`: bytes of the frozen base as stored (projection kernels: codes + float16 block scales;
embeddings, LM head and norms in bfloat16, or the embeddings and LM head quantized too:
model.quantize_embeddings), for the real configs in configs/models, read off the arrays' shapes
and dtypes (`nnx.eval_shape` of the same draw `step8b` runs, nothing allocated), and for the
real SmolLM2 GGUF with model.quantize=gguf (its Q4_1 blocks and its Q8_0 token embeddings, loaded).

`step8b`: a random-weight model of Llama-3.1-8B's real config with its kernels drawn directly as
NF4 codes (a float32 copy would not fit in 24 GB), bfloat16 embeddings, LM head (or NF4 ones,
`--quantize-embeddings`) and compute; the trainer's compiled step (`benchmarks.common.JaxsftStep`: LoRA r 8 on q_proj, v_proj, AdamW)
on one 1x256 batch. Peak RSS is the process's VmHWM (/proc/self/status), i.e. everything: the
drawn weights, XLA's compile, the step.

`speed`: the real SmolLM2-135M-Instruct at 8x128, float32 base against int8 / nf4 / int4 / gguf
(float32 compute), and nf4 with its embeddings and LM head quantized too, steps interleaved
round-robin; the difference is the cost of dequantizing every kernel in the forward pass and
again in the rematerialized backward pass (and the whole LM head once a step).

`error`: relative RMS error ‖ŵ - w‖ / ‖w‖ of quantize → dequantize over all projection kernels
of the real SmolLM2-135M-Instruct (its GGUF's Q4_1 blocks read as float32) and of Gaussian
kernels of the same shapes and per-kernel spread, for each format at blocks of 32 and 64 with
float16 and float32 scales: what a block size or a scale dtype costs in the weights, apart from
training noise.

Results: benchmarks/results/quantized_memory.{json,md} (each section updates its own part and
records its own machine and load).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402

CONFIGS = {"smollm2-135m": "configs/models/smollm2-135m.json", "llama-3.2-1b": "configs/models/llama-3.2-1b.json",
           "llama-3.1-8b": "configs/models/llama-3.1-8b.json"}
FORMATS = ("int8", "nf4", "int4")
RESULTS_STEM = "quantized_memory"


def vm_hwm_mib() -> float:
  """Peak resident set size of this process (VmHWM), MiB."""
  for line in pathlib.Path("/proc/self/status").read_text().splitlines():
    if line.startswith("VmHWM:"):
      return int(line.split()[1]) / 1024
  return common.peak_rss_mib()


def load_config(name: str):
  from jaxsft.models import from_hf_config

  return from_hf_config(json.loads((ROOT / CONFIGS[name]).read_text()))


def base_bytes(config, fmt: str, dtype: str = "bfloat16", embeddings: bool = False) -> dict[str, int]:
  """{"kernels", "other", "total"}: bytes of the frozen base as stored, from shapes only."""
  from flax import nnx

  from jaxsft.models import quantized
  from jaxsft.models.decoder import CausalLM

  if fmt == "none":
    model = nnx.eval_shape(lambda: CausalLM(config, dtype=dtype, rngs=nnx.Rngs(0)))
  else:
    model = quantized.init_random_quantized(config, fmt, dtype=dtype, abstract=True, embeddings=embeddings)
  return split_bytes(model)


def split_bytes(model) -> dict[str, int]:
  from flax import nnx

  from jaxsft import quant

  kernels = quant.tree_bytes([proj.kernel.get_value() for _, proj in quant.model.projections(model)])
  total = quant.tree_bytes(nnx.state(model))
  return {"kernels": kernels, "other": total - kernels, "total": total}


def sizes() -> dict:
  rows = []
  for name in CONFIGS:
    config = load_config(name)
    bf16 = base_bytes(config, "none")
    for fmt in ("none", *FORMATS):
      b = bf16 if fmt == "none" else base_bytes(config, fmt)
      tables = bf16 if fmt == "none" else base_bytes(config, fmt, embeddings=True)
      rows.append({"model": name, "format": "bfloat16" if fmt == "none" else fmt, **b,
                   "kernels_vs_bf16": b["kernels"] / bf16["kernels"], "total_vs_bf16": b["total"] / bf16["total"],
                   "total_embeddings_quantized": tables["total"],
                   "total_embeddings_quantized_vs_bf16": tables["total"] / bf16["total"]})
  rows.append(gguf_row())
  return {"rows": rows, "machine": common.machine_info()}


def gguf_row() -> dict:
  """The real SmolLM2 GGUF loaded with model.quantize=gguf (its own Q4_1 blocks), bfloat16 rest,
  or its own Q8_0 token embeddings too."""
  from jaxsft.models import load_causal_lm

  model = load_causal_lm("smollm2-135m-instruct", dtype="bfloat16", quantize="gguf")
  bf16 = base_bytes(model.config, "none")
  b = split_bytes(model)
  del model
  tables = split_bytes(load_causal_lm("smollm2-135m-instruct", dtype="bfloat16", quantize="gguf",
                                      quantize_embeddings=True))
  return {"model": "smollm2-135m (real GGUF)", "format": "gguf (Q4_1; embeddings Q8_0)", **b,
          "kernels_vs_bf16": b["kernels"] / bf16["kernels"], "total_vs_bf16": b["total"] / bf16["total"],
          "total_embeddings_quantized": tables["total"],
          "total_embeddings_quantized_vs_bf16": tables["total"] / bf16["total"]}


def step8b(batch: int = 1, length: int = 256, embeddings: bool = False) -> dict:
  import numpy as np
  from flax import nnx

  from jaxsft import quant
  from jaxsft.models import quantized

  machine = common.machine_info()
  config = load_config("llama-3.1-8b")
  t0 = time.perf_counter()
  model = quantized.init_random_quantized(config, "nf4", dtype="bfloat16", embeddings=embeddings)
  draw_s = time.perf_counter() - t0
  stored = quant.tree_bytes(nnx.state(model))
  rss_after_draw = vm_hwm_mib()
  print(f"drawn in {draw_s:.0f} s, {stored / 1e9:.2f} GB stored, peak RSS {rss_after_draw:.0f} MiB", flush=True)
  step = common.JaxsftStep(model, common.train_config())
  del model
  compile_info = step.warm_up([(batch, length)])
  print(f"compiled in {compile_info['seconds']:.0f} s, peak RSS {vm_hwm_mib():.0f} MiB", flush=True)
  rng = np.random.default_rng(0)
  ids = rng.integers(0, config.vocab_size, (batch, length)).astype(np.int32)
  labels = ids.copy()
  labels[:, : length // 2] = -100
  batch_arrays = {"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": labels}
  t0 = time.perf_counter()
  loss = step.step(batch_arrays)
  step_s = time.perf_counter() - t0
  return {"model": "llama-3.1-8b (random weights, real config)", "format": "nf4", "block": 64, "dtype": "bfloat16",
          "embeddings_quantized": embeddings, "machine_at_start": machine,
          "batch": [batch, length], "base_param_bytes": stored, "draw_seconds": round(draw_s, 1),
          "peak_rss_after_draw_mib": round(rss_after_draw), "compile": compile_info, "step_seconds": round(step_s, 1),
          "loss": loss, "finite": bool(np.isfinite(loss)), "peak_rss_mib": round(vm_hwm_mib()),
          "recompiles": step.recompiles}


def plan8b(batch: int = 1, length: int = 256, embeddings: bool = False) -> dict:
  """XLA's memory plan of the trainer's compiled step for the 8B NF4 base (`compiled.memory_analysis()`),
  compiled on the arrays' shapes alone: arguments (the stored base, LoRA, optimizer state, batch),
  temporaries (activations, the dequantized kernels in flight) and outputs."""
  import jax
  from flax import nnx

  from jaxsft import lora as lora_lib
  from jaxsft import quant, sharding
  from jaxsft.models import quantized
  from jaxsft import step as step_lib

  machine = common.machine_info()
  config = load_config("llama-3.1-8b")
  model = quantized.init_random_quantized(config, "nf4", dtype="bfloat16", abstract=True, embeddings=embeddings)
  cfg = common.train_config()
  lora_lib.apply_lora(model, r=cfg.lora.r, alpha=cfg.lora.alpha, target_modules=cfg.lora.target_modules)
  graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
  schedule = step_lib.make_schedule(cfg.optim, 10_000)
  tx = step_lib.make_optimizer(cfg.optim, schedule)
  opt_state = jax.jit(tx.init)(lora)
  steps = step_lib.CompiledSteps(step_lib.make_step_functions(graphdef, cfg), lora, opt_state, frozen,
                                 sharding.make_mesh_context(cfg.mesh), schedule)
  t0 = time.perf_counter()
  steps.warm_up([(batch, length)], ("input_ids", "attention_mask", "labels"), with_eval=False, fused=True)
  compile_s = time.perf_counter() - t0
  m = steps.compiled("train_step", (batch, length)).memory_analysis()
  plan = {k: int(getattr(m, k)) for k in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                                          "alias_size_in_bytes", "generated_code_size_in_bytes")}
  plan["peak_bytes"] = (plan["argument_size_in_bytes"] + plan["output_size_in_bytes"] + plan["temp_size_in_bytes"]
                        - plan["alias_size_in_bytes"])
  return {"model": "llama-3.1-8b (real config)", "format": "nf4", "block": 64, "dtype": "bfloat16",
          "embeddings_quantized": embeddings, "machine_at_start": machine, "batch": [batch, length], "base_param_bytes": quant.tree_bytes(frozen), "compile_seconds": round(compile_s, 1),
          "xla_memory_plan": plan, "process_peak_rss_mib": round(vm_hwm_mib())}


SPEED_BASES = {"none": ("none", False), "int8": ("int8", False), "nf4": ("nf4", False),
               "nf4_embeddings": ("nf4", True), "int4": ("int4", False), "gguf": ("gguf", False)}
"""`speed`'s bases: name -> (model.quantize, model.quantize_embeddings)."""


def speed(reps: int, bases=tuple(SPEED_BASES), batch: int = 8, length: int = 128) -> dict:
  import numpy as np

  from jaxsft.models import load_causal_lm

  machine = common.machine_info()
  rng = np.random.default_rng(0)
  ids = rng.integers(0, 49152, (batch, length)).astype(np.int32)
  labels = ids.copy()
  labels[:, :16] = -100
  arrays = {"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": labels}
  steps, compile_s = {}, {}
  for name in bases:
    fmt, embeddings = SPEED_BASES[name]
    model = load_causal_lm("smollm2-135m-instruct", dtype="float32", quantize=fmt, quantize_embeddings=embeddings)
    steps[name] = common.JaxsftStep(model, common.train_config())
    compile_s[name] = steps[name].warm_up([(batch, length)])["seconds"]
    steps[name].step(arrays)  # first call
  times = {name: [] for name in bases}
  for _ in range(reps):
    for name in bases:
      t0 = time.perf_counter()
      steps[name].step(arrays)
      times[name].append(time.perf_counter() - t0)
  return {"batch": [batch, length], "reps": reps, "machine_at_start": machine, "compile_seconds": compile_s,
          "step_seconds": {f: common.median(t) for f, t in times.items()}, "all_step_seconds": times}


def rounding_error() -> dict:
  import numpy as np

  from jaxsft import quant
  from jaxsft.models import load_causal_lm
  from jaxsft.quant import formats

  model = load_causal_lm("smollm2-135m-instruct", dtype="float32")
  real = [np.asarray(proj.kernel[...], np.float32) for _, proj in quant.model.projections(model)]
  del model
  rng = np.random.default_rng(0)
  gaussian = [(rng.standard_normal(k.shape, dtype=np.float32) * k.std()) for k in real]
  rows = []
  for weights, kernels in (("smollm2-135m (real)", real), ("gaussian, same shapes and spread", gaussian)):
    norm = sum(float(np.sum(np.square(k, dtype=np.float64))) for k in kernels)
    for fmt in ("int8", "nf4", "int4"):
      for block in (32, 64):
        for scale_dtype in ("float16", "float32"):
          err = 0.0
          for k in kernels:
            q = formats.quantize(k, fmt, block, scale_dtype=np.dtype(scale_dtype))
            back = formats.dequantize(q, np.float32, xp=np)
            err += float(np.sum(np.square(back - k, dtype=np.float64)))
          bits = {"int8": 8, "nf4": 4, "int4": 4}[fmt] + (16 if scale_dtype == "float16" else 32) / block
          rows.append({"weights": weights, "format": fmt, "block": block, "scale_dtype": scale_dtype,
                       "bits_per_weight": bits, "relative_rms_error": (err / norm) ** 0.5})
  return {"rows": rows}


def section_machine(section: dict) -> str:
  info = section.get("machine_at_start") or section.get("machine")
  return f"Run on: {common.machine_line(info)}." if info else "Run on: not recorded (an earlier version)."


def markdown(result: dict) -> str:
  lines = ["# Quantized frozen base: memory and speed", ""]
  if "sizes" in result:
    lines += ["## Bytes of the frozen base as stored", "",
              "Projection kernels quantized (codes + a float16 scale per 32 inputs, the default block; GGUF: its "
              "own float16 d and m per 32); embeddings, LM head and norms in bfloat16, or (last two columns) the embeddings and LM head "
              "quantized too (`model.quantize_embeddings`; the GGUF: its own Q8_0 token embeddings). Norms stay "
              "bfloat16.", "",
              "| model | format | kernels (MB) | rest (MB) | total (MB) | kernels / bf16 | total / bf16 | "
              "total, embeddings quantized (MB) | its / bf16 |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["sizes"]["rows"]:
      tables = (f"{r['total_embeddings_quantized'] / 1e6:,.1f} | {r['total_embeddings_quantized_vs_bf16']:.3f}"
                if "total_embeddings_quantized" in r else "– | –")
      lines.append(f"| {r['model']} | {r['format']} | {r['kernels'] / 1e6:,.1f} | {r['other'] / 1e6:,.1f} | "
                   f"{r['total'] / 1e6:,.1f} | {r['kernels_vs_bf16']:.3f} | {r['total_vs_bf16']:.3f} | {tables} |")
    lines += ["", "Shapes and dtypes only: the figures do not depend on the machine.", ""]
  for key in ("step8b", "step8b_embeddings"):
    if key not in result:
      continue
    s = result[key]
    tables = "NF4 embeddings and LM head" if s.get("embeddings_quantized") else "bfloat16 embeddings and LM head"
    lines += [f"## One LoRA step of Llama-3.1-8B's shapes on an NF4 base, {tables}", "",
              f"{s['model']}, NF4 kernels drawn directly, {tables}, bfloat16 compute, batch "
              f"{s['batch'][0]}x{s['batch'][1]}, LoRA r 8 on q_proj and v_proj: base "
              f"{s['base_param_bytes'] / 1e9:.2f} GB as stored (bfloat16: 16.1 GB); peak RSS "
              f"{s['peak_rss_mib'] / 1024:.2f} GiB ({s['peak_rss_after_draw_mib'] / 1024:.2f} GiB after the draw); "
              f"compile {s['compile']['seconds']:.0f} s, step {s['step_seconds']:.0f} s, loss {s['loss']:.3f}, "
              f"recompiles {s['recompiles']}.", "", section_machine(s), ""]
  for key in ("plan8b", "plan8b_embeddings"):
    if key not in result:
      continue
    p = result[key]
    plan = p["xla_memory_plan"]
    tables = "NF4" if p.get("embeddings_quantized") else "bfloat16"
    lines += [f"## XLA's memory plan of the trainer's step, Llama-3.1-8B's shapes, NF4 base, {tables} embeddings", "",
              f"Compiled for a {p['batch'][0]}x{p['batch'][1]} batch (LoRA r 8 on q_proj, v_proj; {tables} embeddings "
              f"and LM head, bfloat16 compute) from the arrays' shapes, not run: arguments "
              f"{plan['argument_size_in_bytes'] / 2**30:.2f} GiB (the base as stored: "
              f"{p['base_param_bytes'] / 2**30:.2f} GiB), temporaries {plan['temp_size_in_bytes'] / 2**30:.2f} GiB, "
              f"outputs {plan['output_size_in_bytes'] / 2**30:.3f} GiB, donated {plan['alias_size_in_bytes'] / 2**30:.3f} "
              f"GiB: {plan['peak_bytes'] / 2**30:.2f} GiB in all (compile {p['compile_seconds']:.0f} s).", "",
              section_machine(p), ""]
  if "speed" in result:
    sp = result["speed"]
    base = sp["step_seconds"]["none"]
    lines += [f"## Step time, real SmolLM2-135M-Instruct, {sp['batch'][0]}x{sp['batch'][1]}, float32 compute "
              f"(median of {sp['reps']} interleaved)", "",
              "| base | step (s) | vs float32 |", "| --- | ---: | ---: |"]
    names = {"none": "float32", "nf4_embeddings": "nf4, embeddings and LM head nf4 too"}
    for fmt, t in sp["step_seconds"].items():
      lines.append(f"| {names.get(fmt, fmt)} | {t:.2f} | {t / base:.2f}x |")
    lines += ["", section_machine(sp), ""]
  if "error" in result:
    lines += ["## Rounding error of the projection kernels, ‖ŵ - w‖ / ‖w‖", "",
              "| weights | format | block | scales | bits a weight | relative RMS error |",
              "| --- | --- | ---: | --- | ---: | ---: |"]
    for r in result["error"]["rows"]:
      lines.append(f"| {r['weights']} | {r['format']} | {r['block']} | {r['scale_dtype']} | "
                   f"{r['bits_per_weight']:.3f} | {r['relative_rms_error']:.4f} |")
    lines += ["", "Arithmetic on fixed weights: the figures do not depend on the machine.", ""]
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("section", choices=("sizes", "plan8b", "step8b", "speed", "error"))
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--quantize-embeddings", action="store_true",
                      help="plan8b/step8b: the embeddings and LM head drawn as NF4 too")
  args = parser.parse_args(argv)
  path = common.RESULTS / f"{RESULTS_STEM}.json"
  result = json.loads(path.read_text()) if path.is_file() else {}
  result.pop("machine", None)  # each section records its own
  suffix = "_embeddings" if args.quantize_embeddings else ""
  if args.section == "sizes":
    result["sizes"] = sizes()
  elif args.section == "plan8b":
    result["plan8b" + suffix] = plan8b(embeddings=args.quantize_embeddings)
  elif args.section == "step8b":
    result["step8b" + suffix] = step8b(embeddings=args.quantize_embeddings)
  elif args.section == "error":
    result["error"] = rounding_error()
  else:
    result["speed"] = speed(args.reps)
  common.write_results(RESULTS_STEM, result, markdown(result))
  print(markdown(result))
  return 0


if __name__ == "__main__":
  sys.exit(main())
