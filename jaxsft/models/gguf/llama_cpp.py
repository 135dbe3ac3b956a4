"""What llama.cpp does per GGUF architecture that no GGUF key says, stated once for reading a file
and for writing one: the tensor layout its converter writes (q/k rows permuted, Gemma's 1 + w
norms), the archs it builds with bias tensors, and the settings `src/llama-model.cpp` hard-codes
(Gemma 3's sliding pattern, local RoPE base and attention scale, SmolLM3's NoPE step). Both
directions refuse against these: reading a file whose keys say otherwise
(`jaxsft.models.gguf.read`), writing a model that differs (`jaxsft.models.gguf.write`)."""

from __future__ import annotations

import numpy as np

# llama.cpp's converter permutes q/k rows for the archs it runs with "normal" (interleaved-pair)
# RoPE: LlamaModel and its subclass SmolLM3Model (`undo_permute = True`); the others are rotate-half.
GGUF_PERMUTED_QK_ARCHS = ("llama", "smollm3")
# Gemma's converters store every `*norm.weight` as 1 + w (llama.cpp multiplies by the weight).
GGUF_NORM_PLUS_ONE_ARCHS = ("gemma3",)
# The archs llama.cpp builds with q/k/v (and other) bias tensors; the others have none.
GGUF_BIAS_ARCHS = ("llama", "qwen2")
# Fixed by llama.cpp for these archs (src/llama-model.cpp, no GGUF key): Gemma 3's sliding
# pattern (layer i slides iff i % 6 < 5) and sliding-layer RoPE base; SmolLM3's NoPE step.
GEMMA3_SLIDING_PERIOD = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
SMOLLM3_NO_ROPE_STEP = 4


def hidden_act(arch: str) -> str:
  """The MLP activation llama.cpp's `arch` graph uses (no GGUF key sets it)."""
  return "gelu_pytorch_tanh" if arch == "gemma3" else "silu"


def gemma3_sliding_layers(num_layers: int, period: int = GEMMA3_SLIDING_PERIOD) -> tuple[bool, ...]:
  """Which layers llama.cpp's `set_swa_pattern(period)` makes sliding (all but every period-th)."""
  return tuple(i % period < period - 1 for i in range(num_layers))


def smollm3_rope_layers(num_layers: int) -> tuple[bool, ...]:
  """Which layers llama.cpp's smollm3 graph rotates (`(il + 1) % n_no_rope_layer_step != 0`)."""
  return tuple((i + 1) % SMOLLM3_NO_ROPE_STEP != 0 for i in range(num_layers))


def gemma3_query_pre_attn_scalar(num_layers: int, hidden: int, num_heads: int, head_dim: int) -> int:
  """The attention scale llama.cpp's gemma3 uses, as a query_pre_attn_scalar: head_dim, except
  hidden / heads for the 62-layer Gemma 3 27B."""
  return hidden // num_heads if num_layers == 62 else head_dim


def permute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
  """llama.cpp's `permute` of q/k rows (rotate-half halves -> interleaved RoPE pairs).

  Rows of each head are reshaped as (2, d/2) and transposed to (d/2, 2); `unpermute_qk` is its
  inverse.
  """
  w = weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
  return w.swapaxes(1, 2).reshape(weight.shape)


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
  """Undo llama.cpp's `permute` of q/k rows (interleaved RoPE pairs -> rotate-half halves).

  llama.cpp's convert script reshapes rows as (n_head, 2, d/2) and swaps the last two axes; the
  inverse reshapes as (n_head, d/2, 2) and swaps back.
  """
  rows = weight.shape[0]
  w = weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
  return w.swapaxes(1, 2).reshape(weight.shape)
