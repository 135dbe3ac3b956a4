"""The trainers users would otherwise run, as `benchmarks.vs_torch` workers: TRL's `SFTTrainer`
and Tunix's `PeftTrainer`, each on the same weights, initial LoRA factors and batches as jaxsft.

  trl_sft     `trl.SFTTrainer` on transformers + peft: the batches as a pre-tokenized dataset
              (`skip_prepare_dataset`, sequential sampler, a collator that stacks the rows as they
              are), LoRA r 8 / alpha 16 on q_proj, v_proj loaded from the shared adapter, loss
              Σ nll / Σ trained tokens (TRL's default), AdamW lr 1e-3 constant, clip 1.0.
  tunix_peft  `tunix.sft.peft_trainer.PeftTrainer` on Tunix's Llama-3 model loaded from the same
              safetensors, LoRA by `qwix` (r 8 / alpha 16 on q_proj, v_proj; A and B copied from
              the shared adapter), Tunix's default loss (Σ nll over `input_mask` / its sum) with
              `input_mask` = the trained tokens, optax `clip_by_global_norm(1)` + `adamw`.

Step time is measured the way each trainer runs: TRL between `on_step_begin` and `on_step_end`
(the loss is read every step, `logging_steps=1`), Tunix between consecutive batches handed to
its loop with one step in flight (`max_inflight_computations=1`), so each interval holds one
whole step. Neither peer is in the `test` extra: `pip install -e ".[bench]"` brings them.
"""

from __future__ import annotations

import pathlib
import time

import numpy as np



class _StepClock:
  """Wall and CPU times between marks: `begin()` then `end()` per step."""

  def __init__(self):
    self.times, self.cpu_times, self._t, self._c = [], [], None, None

  def begin(self):
    self._t, self._c = time.perf_counter(), time.process_time()

  def end(self):
    self.times.append(time.perf_counter() - self._t)
    self.cpu_times.append(time.process_time() - self._c)


# --------------------------------------------------------------------------- TRL
def trl_worker(batches: list[dict], meta: dict, *, steps: int, dtype: str, device: str, threads: int,
               lr: float, memory) -> dict:
  """`steps` optimizer steps of `trl.SFTTrainer`, one batch each, in the order given."""
  import datasets
  import peft
  import torch
  import transformers
  import trl
  from safetensors.torch import load_file

  torch.set_num_threads(threads)
  torch.manual_seed(0)
  t0 = time.perf_counter()
  torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
  model = transformers.AutoModelForCausalLM.from_pretrained(meta["hf_dir"], dtype=torch_dtype).to(device)
  lora = meta["lora"]
  model = peft.get_peft_model(model, peft.LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=0.0,
                                                     target_modules=list(lora["targets"]), task_type="CAUSAL_LM"))
  result = peft.set_peft_model_state_dict(model, load_file(str(pathlib.Path(meta["adapter"]) / "adapter_model.safetensors")))
  if result.unexpected_keys:
    raise RuntimeError(f"adapter keys peft did not expect: {result.unexpected_keys[:4]}")
  batches = [batches[i % len(batches)] for i in range(steps)]
  b, t = batches[0]["input_ids"].shape
  rows = {k: [row.tolist() for batch in batches for row in batch[k]] for k in ("input_ids", "attention_mask", "labels")}

  def stack(features):  # the rows are already padded to the shape: keep them as they are
    return {k: torch.tensor([f[k] for f in features], dtype=torch.long) for k in ("input_ids", "attention_mask", "labels")}

  clock, losses = _StepClock(), []

  class Timing(transformers.TrainerCallback):
    def on_step_begin(self, args, state, control, **kw):
      clock.begin()

    def on_step_end(self, args, state, control, **kw):
      if device != "cpu":
        torch.cuda.synchronize()
      clock.end()

    def on_log(self, args, state, control, logs=None, **kw):
      if logs and "loss" in logs:
        losses.append(float(logs["loss"]))

  import tempfile

  with tempfile.TemporaryDirectory(prefix="jaxsft_trl_") as out_dir:
    config = trl.SFTConfig(
        output_dir=out_dir, max_steps=steps, per_device_train_batch_size=b, gradient_accumulation_steps=1,
        learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, optim="adamw_torch", logging_steps=1,
        save_strategy="no", report_to=[], seed=0, max_length=t, train_sampling_strategy="sequential",
        dataloader_num_workers=0, dataset_kwargs={"skip_prepare_dataset": True}, remove_unused_columns=False,
        bf16=False, fp16=False, use_cpu=device == "cpu", disable_tqdm=True, gradient_checkpointing=False)
    trainer = trl.SFTTrainer(model=model, args=config, train_dataset=datasets.Dataset.from_dict(rows),
                             data_collator=stack, callbacks=[Timing()])
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    trainer.train()
    total_s = time.perf_counter() - t0
  if len(losses) != steps:
    raise RuntimeError(f"TRL logged {len(losses)} losses for {steps} steps")
  return {"load_s": load_s, "first_step_s": clock.times[0], "train_call_s": total_s, "step_times": clock.times[1:],
          "step_cpu_times": clock.cpu_times[1:], "losses": losses, "threads": torch.get_num_threads(),
          "trl": trl.__version__, "torch": torch.__version__, **memory("torch", device)}


# --------------------------------------------------------------------------- Tunix
def rope_theta(hf_config: dict) -> float:
  """The RoPE base of a config.json: top-level in transformers 4, in `rope_parameters` in 5."""
  return hf_config.get("rope_theta") or (hf_config.get("rope_parameters") or {}).get("rope_theta", 10000.0)


def tunix_model_config(hf_config: dict):
  """Tunix's `llama3.ModelConfig` for a transformers Llama config.json (no Llama-3.1 frequency
  scaling in Tunix: the step's work is the same, the values differ from transformers')."""
  from tunix.models.llama3 import model as llama3

  return llama3.ModelConfig(
      num_layers=hf_config["num_hidden_layers"], vocab_size=hf_config["vocab_size"],
      embed_dim=hf_config["hidden_size"], hidden_dim=hf_config["intermediate_size"],
      num_heads=hf_config["num_attention_heads"],
      head_dim=hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"],
      num_kv_heads=hf_config["num_key_value_heads"], rope_theta=int(rope_theta(hf_config)),
      norm_eps=hf_config["rms_norm_eps"], weight_tying=bool(hf_config.get("tie_word_embeddings", False)))


def _copy_peft_factors(model, adapter_dir: str, targets) -> int:
  """Writes the PEFT adapter's A (r, in) and B (out, r) into qwix's `*_lora_a` (in..., r) and
  `*_lora_b` (r, out...) of every targeted projection (Tunix's attention projections are einsums
  over (heads, head_dim), its MLP ones plain kernels; both flatten row-major like transformers');
  returns how many tensors it set."""
  import jax.numpy as jnp
  from safetensors.numpy import load_file

  tensors = load_file(str(pathlib.Path(adapter_dir) / "adapter_model.safetensors"))
  count = 0
  for i, layer in enumerate(model.layers):
    for name in targets:
      group, hf_group = ("attn", "self_attn") if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else ("mlp", "mlp")
      proj = getattr(getattr(layer, group), name)
      prefix = f"base_model.model.model.layers.{i}.{hf_group}.{name}"
      a, b = tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"]
      param = "w" if hasattr(proj, "w_lora_a") else "kernel"
      lora_a, lora_b = getattr(proj, f"{param}_lora_a"), getattr(proj, f"{param}_lora_b")
      lora_a[...] = jnp.asarray(a.T, lora_a[...].dtype).reshape(lora_a[...].shape)
      lora_b[...] = jnp.asarray(b.T, lora_b[...].dtype).reshape(lora_b[...].shape)
      count += 2
  return count


def _rotate_with_the_configs_rope_base(rope_theta) -> None:
  """Tunix 0.1.7's attention calls `apply_rope` without the config's `rope_theta`, so it rotates
  with the default base 1e6 (SmolLM2's is 1e5: 6e-3 apart in the first loss on its shapes). Its
  module-level `apply_rope` is given the config's base: the same work, transformers' values."""
  import functools

  from tunix.models.llama3 import model as llama3

  original = getattr(llama3.apply_rope, "func", llama3.apply_rope)
  llama3.apply_rope = functools.partial(original, rope_theta=rope_theta)


def tunix_worker(batches: list[dict], meta: dict, *, steps: int, dtype: str, device: str, lr: float,
                 memory) -> dict:
  """`steps` optimizer steps of Tunix's `PeftTrainer`, one batch each, in the order given."""
  import json

  import jax
  import jax.numpy as jnp
  import optax
  import qwix
  import tunix
  from tunix.models.llama3 import params as llama3_params
  from tunix.sft import peft_trainer
  from tunix.sft import utils as sft_utils

  t0 = time.perf_counter()
  hf_config = json.loads((pathlib.Path(meta["hf_dir"]) / "config.json").read_text())
  config = tunix_model_config(hf_config)
  _rotate_with_the_configs_rope_base(config.rope_theta)
  jdtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype]
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with mesh:
    base = llama3_params.create_model_from_safe_tensors(meta["hf_dir"], config, mesh, dtype=jdtype)
    lora = meta["lora"]
    provider = qwix.LoraProvider(module_path=".*(" + "|".join(lora["targets"]) + ")", rank=lora["r"],
                                 alpha=float(lora["alpha"]))
    b, t = batches[0]["input_ids"].shape
    dummy = {"input_tokens": jnp.ones((b, t), jnp.int32), "positions": jnp.zeros((b, t), jnp.int32), "cache": None,
             "attention_mask": jnp.ones((b, t, t), jnp.bool_)}
    model = qwix.apply_lora_to_model(base, provider, **dummy)
    copied = _copy_peft_factors(model, meta["adapter"], lora["targets"])

    def model_inputs(x):  # the trainer's batch → the loss function's arguments
      padding = x["attention_mask"]
      return {"input_tokens": x["input_tokens"], "input_mask": x["input_mask"],
              "positions": sft_utils.build_positions_from_mask(padding),
              "attention_mask": sft_utils.make_causal_attn_mask(padding)}

    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0))
    trainer = peft_trainer.PeftTrainer(model, optimizer, peft_trainer.TrainingConfig(
        eval_every_n_steps=10**9, max_steps=steps, max_inflight_computations=1, pbar_description=None))
    trainer = trainer.with_gen_model_input_fn(model_inputs)
    load_s = time.perf_counter() - t0
    marks = []  # (wall, CPU) each time the loop asks for a batch, and once more at the end

    def stream():
      for i in range(steps):
        marks.append((time.perf_counter(), time.process_time()))
        batch = batches[i % len(batches)]
        # labels mark the trained tokens at their own position (the loss shifts): Tunix's
        # input_mask[:, 1:] is then exactly labels[:, 1:] != -100.
        yield {"input_tokens": batch["input_ids"].astype(np.int32), "attention_mask": batch["attention_mask"].astype(bool),
               "input_mask": batch["labels"] != -100}
      marks.append((time.perf_counter(), time.process_time()))

    trainer.train(stream())
  # With one step in flight, the loop asks for batch i+1 once step i-1 has finished and step i is
  # dispatched: from the third mark on, each interval holds one whole step. The first two hold
  # the compile and step 1.
  times = [marks[i + 1][0] - marks[i][0] for i in range(2, len(marks) - 1)]
  cpu_times = [marks[i + 1][1] - marks[i][1] for i in range(2, len(marks) - 1)]
  losses = _tunix_losses(trainer, steps)
  return {"load_s": load_s, "first_step_s": marks[2][0] - marks[0][0], "step_times": times, "step_cpu_times": cpu_times,
          "losses": losses, "lora_tensors_copied": copied, "backend": jax.default_backend(),
          "tunix": getattr(tunix, "__version__", "?"), **memory("jaxsft", device)}


def _tunix_losses(trainer, steps: int) -> list[float]:
  history = trainer.metrics_logger.get_metric_history("", "loss", "train")
  losses = [float(x) for x in np.asarray(history).reshape(-1)]
  if len(losses) != steps:
    raise RuntimeError(f"Tunix logged {len(losses)} losses for {steps} steps")
  return losses
