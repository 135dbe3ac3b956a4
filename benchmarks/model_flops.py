"""Model FLOPs of one LoRA training step, counted from the shapes, and the peak they are held to.

The count is the model's, not an implementation's: every framework gets the same number for the
same step, so `model_flops / step_s` over a peak (model FLOP utilization, MFU) compares them on
one scale. Matrix products only (2·m·k·n each); norms, softmax, rope and the optimizer are left
out. With N = B·T positions (padding included: every framework computes over the padded batch),
per decoder layer (L of them; the layer stack is a loop of L trips):

  frozen projections   F_proj = 2·N·h·(q + 2·kv + q) + 3 · 2·N·h·I       (q = heads·d, kv = kv_heads·d)
  attention            F_attn = 2 · 2·B·heads·T²·d                       (QKᵀ and PV, the full T×T)
  LoRA                 F_lora = Σ_targets 2·N·r·(in + out)

and the LM head over the positions the loss needs, N_trained (the tokens with a label):

  F_head = 2·N_trained·h·V

A step of a frozen base with LoRA is the forward, the input gradients through every frozen
product (dX = dY·Wᵀ: as many FLOPs as the forward; no weight gradients), the attention's four
backward products, and LoRA's input and weight gradients:

  step = L·(2·F_proj + 3·F_attn + 3·F_lora) + 2·F_head
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class StepShape:
  """What the count needs: the model's shapes, the batch's and LoRA's."""

  num_layers: int
  hidden_size: int
  intermediate_size: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  vocab_size: int
  batch: int
  length: int
  trained_tokens: float  # positions whose next token is a label (the loss's)
  lora_rank: int = 8
  lora_targets: tuple[str, ...] = ("q_proj", "v_proj")

  @classmethod
  def from_hf_config(cls, config: dict, *, batch: int, length: int, trained_tokens: float, **lora) -> "StepShape":
    heads = config["num_attention_heads"]
    return cls(num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
               intermediate_size=config["intermediate_size"], num_heads=heads,
               num_kv_heads=config.get("num_key_value_heads") or heads,
               head_dim=config.get("head_dim") or config["hidden_size"] // heads, vocab_size=config["vocab_size"],
               batch=batch, length=length, trained_tokens=trained_tokens, **lora)

  def projection_dims(self) -> dict[str, tuple[int, int]]:
    """(in, out) of each linear layer of a decoder layer, by its transformers name."""
    h, i, q, kv = self.hidden_size, self.intermediate_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def step_flops(s: StepShape) -> dict[str, float]:
  """The parts of one step's model FLOPs (forward parts and the step total); see the module doc."""
  n = s.batch * s.length
  dims = s.projection_dims()
  unknown = set(s.lora_targets) - set(dims)
  if unknown:
    raise ValueError(f"LoRA targets {sorted(unknown)} are not linear layers of a decoder layer ({sorted(dims)})")
  proj = sum(2.0 * n * i * o for i, o in dims.values())
  attn = 2 * 2.0 * s.batch * s.num_heads * s.length**2 * s.head_dim
  lora = sum(2.0 * n * s.lora_rank * (dims[t][0] + dims[t][1]) for t in s.lora_targets)
  head = 2.0 * s.trained_tokens * s.hidden_size * s.vocab_size
  total = s.num_layers * (2 * proj + 3 * attn + 3 * lora) + 2 * head
  return {"projections_forward": s.num_layers * proj, "attention_forward": s.num_layers * attn,
          "lora_forward": s.num_layers * lora, "lm_head_forward": head, "step": total}


def gpu_peak(device_name: str, dtype: str) -> float | None:
  """The data-sheet peak FLOP/s of an accelerator named like `device_name` (e.g. "NVIDIA H200") in
  `dtype`, or None: `jaxsft.flops.PEAK_FLOPS`, the trainer's MFU table. float32 is the TF32 rate,
  which both sides of a float32 GPU run use (XLA's default precision; torch's "high")."""
  from jaxsft import flops

  found = flops.peak_flops(device_name, dtype)
  return found[1] if found else None
