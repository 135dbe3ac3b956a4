"""Block-quantized weight formats: pure functions `quantize` (numpy, at load time) and
`dequantize` (jax or numpy, inside the jitted step), and the `QuantizedTensor` pytree that
holds one stacked kernel.

A kernel W (..., in, out) (y = x W) is cut into blocks of `block` consecutive input rows of one
output column (the contraction axis, as bitsandbytes blocks PyTorch's (out, in) rows and GGUF
its rows of ne[0] = in). Each block b has its own scale s_b (and, for q4_1, offset m_b):

  int8:  q = round(w / s) ∈ [-127, 127],  s = max|w| / 127,   ŵ = q · s
  int4:  q = round(w / s) ∈ [-7, 7],      s = max|w| / 7,     ŵ = (c - 8) · s,  c = q + 8 ∈ [1, 15]
  nf4:   c = argmin_k |NF4[k] - w / s|,    s = max|w|,         ŵ = NF4[c] · s
  q4_1:  c = round((w - m) / d) ∈ [0, 15], d = (max - min) / 15, m = min,  ŵ = c · d + m

NF4 is QLoRA's 4-bit NormalFloat code book (Dettmers et al. 2023, appendix E): the 16 quantiles
of N(0, 1), normalized to [-1, 1], with an exact 0. Worst-case error per element, from the
rounding: int8 s/2 = max|w|/254, int4 s/2 = max|w|/14, nf4 half the widest gap of the code
book times s (0.152 · max|w|, between -1 and -0.696), q4_1 d/2.

GGUF's own blocks map onto these with block 32: Q8_0 is int8 (ŵ = q · d), Q4_0 is int4
(ŵ = (c - 8) · d) and Q4_1 is q4_1, with d and m kept float16 (`jaxsft.quant.gguf`).

Storage: int8 codes are int8 (..., in, out); 4-bit codes are two per byte along the input axis,
uint8 (..., in/2, out) with row 2j in the low nibble and row 2j + 1 in the high one; scales and
offsets are float16 (..., in/block, out), as GGUF keeps its d and m. With 16-bit scales a block
of 32 costs 4.5 bits a 4-bit weight, what bitsandbytes' NF4 pays at block 64 with float32 ones.
Each scale is rounded up to float16 (an offset down) BEFORE the codes are chosen, so every
|w / ŝ| stays within the code range and the bounds below hold for the stored ŝ; a tensor with a
weight beyond float16's range (65504) keeps float32 scales. Every array keeps the leading layer axis, so
`jax.lax.scan` over the decoder hands each layer its own blocks and `dequantize` then
materializes one layer's float kernel at a time.

Why not qwix: its PTQ provider swaps weights for `QArray`s and intercepts the matmuls of
modules matched by path; it has NF4 and tiled scales, but not GGUF's min-offset Q4_1 blocks
nor a way to pin the op order that makes the GGUF path equal `gguf.quants.dequantize` bit for
bit, and its interception would have to reach inside the scanned, rematerialized layer body.
The few functions here give the stacked layout and the exactness directly.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxsft.config_checks import QUANT_BLOCK_SIZE

FORMATS = ("int8", "int4", "nf4", "q4_1")
FOUR_BIT = ("int4", "nf4", "q4_1")
DEFAULT_BLOCK = QUANT_BLOCK_SIZE  # `model.quant_block_size`'s default, kept with the config's other values

NF4_CODE = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0], np.float32)


@struct.dataclass
class QuantizedTensor:
  """A block-quantized kernel (..., in, out): codes, per-block scales (and offsets for q4_1)."""

  codes: Any
  scales: Any
  offsets: Any = None
  format: str = struct.field(pytree_node=False, default="nf4")
  block: int = struct.field(pytree_node=False, default=DEFAULT_BLOCK)

  @property
  def shape(self) -> tuple[int, ...]:
    """The logical kernel shape (..., in, out)."""
    *lead, rows, out = self.codes.shape
    return (*lead, rows * (2 if self.format in FOUR_BIT else 1), out)

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def nbytes(self) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(self))


def _blocks(w: np.ndarray, block: int) -> np.ndarray:
  """(..., in, out) -> (..., in/block, block, out)."""
  *lead, rows, out = w.shape
  if rows % block:
    raise ValueError(f"input size {rows} is not a multiple of the quantization block size {block}")
  return w.reshape(*lead, rows // block, block, out)


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
  """4-bit codes (..., in, out) in [0, 15] -> uint8 (..., in/2, out): row 2j low, 2j + 1 high."""
  codes = np.asarray(codes, np.uint8)
  return (codes[..., 0::2, :] | (codes[..., 1::2, :] << 4)).astype(np.uint8)


def unpack_nibbles(packed, xp=jnp, axis: int = -2):
  """The inverse of `pack_nibbles` (jax or numpy); `axis=-1`: of its transpose, (..., out, in/2)
  -> (..., out, in)."""
  low, high = packed & 0x0F, packed >> 4
  shape = list(packed.shape)
  shape[axis] *= 2
  return xp.stack([low, high], axis=axis).reshape(shape)


def _safe(scale: np.ndarray) -> np.ndarray:
  return np.where(scale == 0, np.float32(1), scale)


def _round_to(x: np.ndarray, dtype, direction: float) -> np.ndarray:
  """x (float32) in `dtype`, rounded toward `direction` (+inf: the smallest value ≥ x; -inf: the
  largest ≤ x), widened back to float32: the value the step will multiply by."""
  near = x.astype(dtype)
  off = near.astype(np.float32) < x if direction > 0 else near.astype(np.float32) > x
  return np.where(off, np.nextafter(near, dtype(direction)), near).astype(np.float32)


def quantize(w, format: str, block: int = DEFAULT_BLOCK, scale_dtype=np.float16) -> QuantizedTensor:
  """Quantize a float kernel (..., in, out) with numpy (see the module docstring for the math).

  `scale_dtype`: float16 (the default; float32 where a weight is beyond float16's range) or float32."""
  if format not in FORMATS:
    raise ValueError(f"unknown quantization format {format!r}; choose from {list(FORMATS)}")
  if format in FOUR_BIT and block % 2:
    raise ValueError(f"4-bit blocks must have an even size, got {block}")
  w = np.asarray(w, np.float32)
  blocks = _blocks(w, block)
  absmax = np.max(np.abs(blocks), axis=-2, keepdims=True)
  # every scale and offset is at most max|w| in size
  fits = np.dtype(scale_dtype) == np.float16 and (not w.size or np.max(absmax) <= np.finfo(np.float16).max)
  stored = np.float16 if fits else np.float32

  def up(x):
    return _round_to(x, stored, np.inf)

  offsets = None
  if format == "int8":
    scale = up(absmax / np.float32(127))
    codes = np.clip(np.rint(blocks / _safe(scale)), -127, 127).astype(np.int8).reshape(w.shape)
  elif format == "int4":
    scale = up(absmax / np.float32(7))
    codes = pack_nibbles((np.clip(np.rint(blocks / _safe(scale)), -7, 7) + 8).reshape(w.shape))
  elif format == "nf4":
    scale = up(absmax)
    normalized = blocks / _safe(scale)
    # nearest code: the code book is sorted, so compare with the midpoints between neighbours
    midpoints = (NF4_CODE[1:] + NF4_CODE[:-1]) / 2
    codes = pack_nibbles(np.searchsorted(midpoints, normalized).astype(np.uint8).reshape(w.shape))
  else:  # q4_1
    low = _round_to(np.min(blocks, axis=-2, keepdims=True), stored, -np.inf)
    scale = up((np.max(blocks, axis=-2, keepdims=True) - low) / np.float32(15))
    codes = pack_nibbles(np.clip(np.rint((blocks - low) / _safe(scale)), 0, 15).reshape(w.shape))
    offsets = low[..., 0, :].astype(stored)
  return QuantizedTensor(codes=codes, scales=scale[..., 0, :].astype(stored), offsets=offsets,
                         format=format, block=block)


def dequantize(q: QuantizedTensor, dtype=jnp.float32, xp=jnp, *, transposed: bool = False):
  """ŵ (..., in, out) in float32, cast to `dtype`; `xp` is jax.numpy (in the step) or numpy.

  `transposed`: ŵᵀ (..., out, in), computed in that layout from the transposed codes and scales
  (the same float32 operations element by element, so it equals `dequantize(q).T` bit for bit)
  without ŵ ever being materialized: what an embedding table stored as its LM head's kernel
  needs (`jaxsft.quant.kernel`)."""
  codes, scales, offsets = q.codes, q.scales, q.offsets
  axis = -1 if transposed else -2
  if transposed:
    codes, scales = xp.swapaxes(codes, -1, -2), xp.swapaxes(scales, -1, -2)
    offsets = None if offsets is None else xp.swapaxes(offsets, -1, -2)
  if q.format == "int8":
    values = codes.astype(xp.float32)
  else:
    codes = unpack_nibbles(codes, xp, axis)
    if q.format == "nf4":
      values = xp.asarray(NF4_CODE)[codes.astype(xp.int32)]
    elif q.format == "int4":
      values = codes.astype(xp.int8).astype(xp.float32) - xp.float32(8)
    else:
      values = codes.astype(xp.float32)
  shape = values.shape
  ax = len(shape) + axis  # the input axis: in -> (in/block, block), one scale per block
  blocks = values.reshape(*shape[:ax], shape[ax] // q.block, q.block, *shape[ax + 1:])
  w = blocks * xp.expand_dims(scales, axis).astype(xp.float32)  # float16 scales widen exactly
  if offsets is not None:
    w = w + xp.expand_dims(offsets, axis).astype(xp.float32)
  return w.reshape(shape).astype(dtype)


def take_columns(q: QuantizedTensor, index) -> QuantizedTensor:
  """The output columns `index` (an int array of shape (n,)) of `q`: a (..., in, n) tensor.
  Every array of `q` keeps the output axis last, so the gather touches n columns of codes
  and scales only (an embedding lookup dequantizes the looked-up rows, not the table)."""
  return jax.tree.map(lambda x: jnp.take(x, index, axis=-1), q)


def error_bound(q: QuantizedTensor, xp=np):
  """The largest |w - ŵ| the format allows per block (..., in/block, 1, out) for the w that gave `q`."""
  scale = xp.abs(q.scales).astype(np.float32)
  if q.format == "nf4":
    half_gap = np.float32(np.max(np.diff(NF4_CODE)) / 2)
    return (scale * half_gap)[..., :, None, :]
  return (scale / 2)[..., :, None, :]
