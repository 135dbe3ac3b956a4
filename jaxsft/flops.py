"""Model FLOPs of a training step, counted from the shapes, and model FLOPs utilization (MFU).

The count is of *model* FLOPs (PaLM's convention, Chowdhery et al. 2022, appendix B): the
multiply-adds the step's math needs, 2 FLOPs each, matmuls only (norms, softmax, RoPE and the
optimizer are a few FLOPs per element and left out), with no recompute: the backward pass's
rematerialization (`model.remat`) and FlashAttention's recomputed scores are hardware work, not
model work, so MFU does not rise when a run trades memory for recompute.

Per token, for a projection y = x W, W: (i, o), and a LoRA branch x A B of rank r:

    forward                        2·i·o                 + 2·r·(i + o)
    input gradient  ∂x = g Wᵀ      2·i·o  (frozen too)   + 2·r·(i + o)   (g Bᵀ, then (g Bᵀ) Aᵀ)
    weight gradient ∂W = xᵀ g      2·i·o  (W trained)    + 2·r·(i + o)   (∂A, ∂B: LoRA trained)

so a frozen projection costs 4·i·o and a trained one 6·i·o (the 6N rule for its N = i·o
params). Input gradients are counted for every layer alike: the layers run as one scanned body,
which computes them for the first layer too.

Attention (per layer and sequence of length T; N query heads of size D): QKᵀ and PV cost
2·D FLOPs per (query, key) pair and head each, forward 4·N·D·P; the backward pass's dV = Pᵀ dO,
dP = dO Vᵀ, dQ = dS K, dK = dSᵀ Q double that, 8·N·D·P. P counts the pairs the causal mask
keeps, P = T (T + 1) / 2 (with a sliding window W < T: W (W + 1) / 2 + (T - W) W): the masked
upper triangle is work a causal kernel skips, so it is not counted, whether or not the
executable computes it (on a CPU, for T ≤ 64, one query block computes all T² pairs).

LM head (hidden H, vocabulary V): only at trained positions (the loss skips the others,
`jaxsft.loss.trained_cross_entropy_sum`): 2·H·V forward and 2·H·V for ∂hidden per trained
position, plus 2·H·V for ∂E when the output embedding is trained.

Every padded position of a (B, T) batch runs through the layers, so the layers are counted over
B·T positions: padding is work the device does (its share is the record's `padding_fraction`).

MFU = model FLOPs / (step seconds · devices · peak FLOP/s per device), the peak from
`PEAK_FLOPS` by the device's kind and the compute dtype (or the user's `logging.peak_flops`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from flax import nnx

from jaxsft.models.linear import Linear

# Dense (not 2:4 sparse) peaks per chip, FLOP/s, (bfloat16, float32) by the vendors' data sheets.
# float32 is the rate XLA's default matmul precision runs float32 matmuls at: TF32 tensor cores on
# NVIDIA Ampere and later, one bfloat16 pass on a TPU's MXU. Under
# `jax.default_matmul_precision("highest")` float32 is slower (H100 SXM: 67 TFLOP/s on CUDA cores).
# Matched in order against `jax.Device.device_kind`, lower-cased.
PEAK_FLOPS: tuple[tuple[str, str, float, float], ...] = (
    # (pattern, name, bfloat16, float32)
    (r"h100.*pcie", "NVIDIA H100 PCIe", 756e12, 378e12),
    (r"h200", "NVIDIA H200 SXM", 989e12, 494e12),
    (r"h100", "NVIDIA H100 SXM", 989e12, 494e12),
    (r"a100", "NVIDIA A100", 312e12, 156e12),
    (r"\bl4\b", "NVIDIA L4", 121e12, 60e12),
    (r"tpu v4$", "TPU v4", 275e12, 275e12),
    (r"tpu v5 ?(lite|e)", "TPU v5e", 197e12, 197e12),
    (r"tpu v5p?$", "TPU v5p", 459e12, 459e12),
    (r"tpu v6 ?(lite|e)", "TPU v6e", 918e12, 918e12),
)


def peak_flops(device_kind: str, dtype: str) -> tuple[str, float] | None:
  """(accelerator name, peak FLOP/s per device) for a `device_kind` and compute dtype
  ("bfloat16" or "float32"); None when the device is not in `PEAK_FLOPS` (a CPU, say)."""
  kind = device_kind.strip().lower()
  for pattern, name, bf16, fp32 in PEAK_FLOPS:
    if re.search(pattern, kind):
      return name, (bf16 if dtype in ("bfloat16", "float16") else fp32)
  return None


@dataclasses.dataclass(frozen=True)
class Projection:
  """One projection of every decoder layer (layers are stacked: all alike)."""

  name: str
  fan_in: int
  fan_out: int
  weight_trained: bool
  lora_rank: int = 0  # 0: no LoRA branch
  lora_trained: bool = False

  def per_token(self) -> tuple[int, int]:
    """(forward, backward) FLOPs per token, as in the module docstring."""
    dense, low_rank = 2 * self.fan_in * self.fan_out, 2 * self.lora_rank * (self.fan_in + self.fan_out)
    forward = dense + low_rank
    backward = dense + low_rank  # input gradients
    backward += dense if self.weight_trained else 0
    backward += low_rank if self.lora_trained else 0
    return forward, backward


def causal_pairs(length: int, window: int | None) -> int:
  """(query, key) pairs a causal mask keeps in a sequence of `length` (within `window`)."""
  if window is None or window >= length:
    return length * (length + 1) // 2
  return window * (window + 1) // 2 + (length - window) * window


@dataclasses.dataclass(frozen=True)
class StepFlops:
  """What the count needs of a model: its layers' projections, attention and LM head."""

  num_layers: int
  num_heads: int
  head_dim: int
  hidden_size: int
  vocab_size: int
  layer_windows: tuple[int | None, ...]
  projections: tuple[Projection, ...]
  head_trained: bool

  @classmethod
  def from_model(cls, model, trainable) -> StepFlops:
    """From a `CausalLM` (LoRA applied or not) and the nnx filter of its trained params."""
    is_trained = nnx.filterlib.to_predicate(trainable)
    trained = {".".join(map(str, path)) for path, value in nnx.iter_graph(model)
               if isinstance(value, nnx.Variable) and is_trained(path, value)}
    projections = []
    for path, module in nnx.iter_graph(model.layers):
      if not isinstance(module, Linear):
        continue
      prefix = ".".join(["layers", *map(str, path)])
      _, fan_in, fan_out = module.kernel.shape
      rank = 0 if module.lora_a is None else int(module.lora_a.shape[-1])
      projections.append(Projection(str(path[-1]), int(fan_in), int(fan_out), f"{prefix}.kernel" in trained,
                                    rank, f"{prefix}.lora_a" in trained))
    config = model.config
    head = "embed_tokens" if model.lm_head is None else "lm_head"
    return cls(config.num_layers, config.num_heads, config.head_dim, config.hidden_size, config.vocab_size,
               tuple(config.layer_windows()), tuple(projections), head in trained)

  def layers(self, batch: int, length: int) -> int:
    """Forward + backward FLOPs of the decoder layers on a (batch, length) batch."""
    per_token = sum(sum(p.per_token()) for p in self.projections) * self.num_layers
    attention = sum(12 * self.num_heads * self.head_dim * causal_pairs(length, w) for w in self.layer_windows)
    return batch * (length * per_token + attention)

  def lm_head(self, trained_positions: int) -> int:
    """Forward + backward FLOPs of the LM head at `trained_positions` positions."""
    return trained_positions * 2 * self.hidden_size * self.vocab_size * (3 if self.head_trained else 2)

  def step(self, shapes: Sequence[tuple[int, int]], trained_positions: int) -> int:
    """One optimizer step: its micro-batches' (B, T) shapes and their trained positions in all."""
    return sum(self.layers(b, t) for b, t in shapes) + self.lm_head(trained_positions)


def utilization(flops: float, seconds: float, peak_per_device: float | None, devices: int) -> dict:
  """{"flops_per_s": achieved, "mfu": of the peak} (no "mfu" without a peak)."""
  achieved = flops / max(seconds, 1e-9)
  out = {"flops_per_s": float(f"{achieved:.4g}")}
  if peak_per_device:
    out["mfu"] = float(f"{achieved / (peak_per_device * devices):.4g}")
  return out


def mean_utilization(records: Sequence[dict]) -> dict:
  """Averages over a run's step records (the last record of a step wins, as for a resume):
  `flops_per_s` and `mfu` are Σ flops / Σ seconds (per step rates weighted by their time)."""
  steps = {r["step"]: r for r in records if "flops" in r and "seconds" in r}
  if not steps:
    return {}
  flops = sum(r["flops"] for r in steps.values())
  seconds = sum(r["seconds"] for r in steps.values())
  out = {"model_flops_per_step": round(flops / len(steps)), "flops_per_s": float(f"{flops / max(seconds, 1e-9):.4g}")}
  mfus = [(r["mfu"], r["seconds"]) for r in steps.values() if r.get("mfu") is not None]
  if len(mfus) == len(steps):
    out["mfu"] = float(f"{sum(m * s for m, s in mfus) / max(seconds, 1e-9):.4g}")
  return out
