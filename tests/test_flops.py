"""Model FLOPs of a step: a hand count, XLA's own count of the compiled step, the peak table."""

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from jaxsft import config as config_lib
from jaxsft import flops, lora, models, sharding
from jaxsft import step as step_lib

# Small enough that a hand count is short; vocabulary 256 so the layers, not the LM head, dominate.
SMALL = models.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=16, rope_theta=1e4, tie_word_embeddings=True,
                           bos_token_id=1, eos_token_id=2, pad_token_id=2)


def lora_model(**kwargs):
  model = models.init_random(SMALL, seed=0, **kwargs)
  lora.apply_lora(model, r=4, alpha=8, target_modules=("q_proj", "v_proj"))
  return model


def test_step_flops_equal_a_hand_count():
  counted = flops.StepFlops.from_model(lora_model(), nnx.LoRAParam)
  # A (2, 32) batch with 40 trained positions. Per token and layer, forward + backward:
  #   frozen projection (i, o): 2io forward + 2io input gradient = 4io
  #   LoRA of rank 4 (trained): 2r(i+o) forward + 2r(i+o) input gradient + 2r(i+o) weight gradients
  q = 4 * 64 * 64 + 6 * 4 * (64 + 64)
  k = 4 * 64 * 32
  v = 4 * 64 * 32 + 6 * 4 * (64 + 32)
  o = 4 * 64 * 64
  mlp = 3 * 4 * 64 * 128  # gate, up, down
  layers = 2 * (2 * 32) * (q + k + v + o + mlp)
  # Attention: 32·33/2 causal pairs; QKᵀ and PV 2·16 FLOPs per pair and head each, backward twice
  # the forward: 12 · heads · head_dim · pairs per layer and sequence.
  attention = 2 * 2 * 12 * 4 * 16 * (32 * 33 // 2)
  # LM head (frozen, tied): logits and ∂hidden, 2·64·256 each, at the 40 trained positions only.
  head = 40 * 2 * (2 * 64 * 256)
  assert (q, k, v, o, mlp) == (19456, 8192, 10496, 16384, 98304)
  assert counted.step([(2, 32)], 40) == layers + attention + head == 23_805_952
  # Two micro-batches of an accumulated step add up; the head counts their trained positions in all.
  assert counted.step([(2, 32), (1, 16)], 50) == layers + attention + counted.layers(1, 16) + 50 * 2 * (2 * 64 * 256)

  # Full fine-tuning of down_proj and the (tied) embedding: their weight gradients are added.
  full = models.init_random(SMALL, seed=0)
  trained = flops.StepFlops.from_model(full, lambda path, value: isinstance(value, nnx.Param) and (
      "down_proj" in ".".join(map(str, path)) or path[0] == "embed_tokens"))
  plain = 4 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128)
  expected = (2 * 64 * (plain + 2 * 128 * 64) + attention + 40 * 3 * (2 * 64 * 256))
  assert trained.step([(2, 32)], 40) == expected


def test_sliding_windows_count_only_the_pairs_they_keep():
  assert flops.causal_pairs(10, None) == 55
  assert flops.causal_pairs(10, 4) == sum(min(t + 1, 4) for t in range(10)) == 34
  assert flops.causal_pairs(10, 16) == 55


@pytest.mark.slow
def test_counted_flops_agree_with_xla_cost_analysis_of_the_unrolled_step(monkeypatch):
  """XLA's count of the compiled train step (every matmul and elementwise op it runs) within 10%
  of the model count. Unrolled (no scan: XLA counts a loop body once) and without remat (XLA
  would count the recompute)."""
  monkeypatch.setattr(jax.lax, "scan", functools.partial(jax.lax.scan, unroll=True))
  model = lora_model(remat="none")
  cfg = config_lib.TrainConfig()
  graphdef, params, frozen = nnx.split(model, nnx.LoRAParam, ...)
  schedule = step_lib.make_schedule(cfg.optim, 10)
  tx = step_lib.make_optimizer(cfg.optim, schedule)
  mesh = sharding.make_mesh_context(cfg.mesh)
  steps = step_lib.CompiledSteps(step_lib.make_step_functions(graphdef, cfg), params,
                                 jax.jit(tx.init)(params), frozen, mesh, schedule)
  b, t = 2, 32
  steps.warm_up([(b, t)], ("input_ids", "attention_mask", "labels"), with_eval=False, fused=True)
  xla = steps.compiled("train_step", (b, t)).cost_analysis()["flops"]
  counted = flops.StepFlops.from_model(model, nnx.LoRAParam)
  # Every position trained: the loss's LM-head chunk then holds all B·(T-1) positions.
  model_flops = counted.step([(b, t)], b * (t - 1))
  # At T ≤ 64 the attention is one query block on a CPU: the executable computes the masked upper
  # triangle too, which the model count leaves out.
  upper = counted.num_layers * b * 12 * counted.num_heads * counted.head_dim * (t * t - flops.causal_pairs(t, None))
  assert xla == pytest.approx(model_flops + upper, rel=0.10)
  # The layers are what is compared (not a head-dominated total): over 80% of the count.
  assert counted.layers(b, t) > 0.8 * model_flops


def test_peaks_by_device_kind_and_dtype():
  assert flops.peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == ("NVIDIA H100 SXM", 989e12)
  assert flops.peak_flops("NVIDIA H100 PCIe", "bfloat16")[1] == 756e12
  assert flops.peak_flops("NVIDIA H200", "bfloat16")[1] == 989e12
  assert flops.peak_flops("NVIDIA A100-SXM4-80GB", "float32") == ("NVIDIA A100", 156e12)
  assert flops.peak_flops("NVIDIA L4", "bfloat16")[1] == 121e12
  assert flops.peak_flops("NVIDIA L40S", "bfloat16") is None
  assert flops.peak_flops("TPU v4", "bfloat16")[1] == 275e12
  assert flops.peak_flops("TPU v5 lite", "bfloat16")[1] == 197e12
  assert flops.peak_flops("TPU v5", "bfloat16")[1] == 459e12
  assert flops.peak_flops("TPU v6 lite", "bfloat16")[1] == 918e12
  assert flops.peak_flops("cpu", "float32") is None


def test_mfu_and_its_run_average():
  assert flops.utilization(2e12, 2.0, 4e12, 1) == {"flops_per_s": 1e12, "mfu": 0.25}
  assert flops.utilization(2e12, 2.0, None, 1) == {"flops_per_s": 1e12}
  assert flops.utilization(2e12, 2.0, 1e12, 4)["mfu"] == 0.25  # four devices share the step
  records = [{"step": 1, "flops": 4e12, "seconds": 1.0, "mfu": 0.4},
             {"step": 2, "flops": 4e12, "seconds": 3.0, "mfu": 0.1},
             {"step": 2, "flops": 4e12, "seconds": 2.0, "mfu": 0.2},  # a resumed run redid step 2
             {"step": 2, "epoch": 0, "epoch_loss": 1.0}]
  mean = flops.mean_utilization(records)
  assert mean["flops_per_s"] == pytest.approx(8e12 / 3.0, rel=1e-3)
  assert mean["mfu"] == pytest.approx((0.4 * 1 + 0.2 * 2) / 3, rel=1e-3)  # 4 significant digits
  assert mean["model_flops_per_step"] == 4e12
  assert "mfu" not in flops.mean_utilization([{"step": 1, "flops": 1.0, "seconds": 1.0}])
  assert np.isfinite(mean["flops_per_s"])
