"""A GGUF file's own Q4_0 / Q4_1 / Q8_0 blocks as `QuantizedTensor`s, unchanged.

ggml stores a weight (out, in) row by row, each row in blocks of 32 (`GGML_QUANT_SIZES`):

  Q8_0: d (float16), 32 × int8 q            ŵ = q · d             -> format int8, block 32
  Q4_0: d (float16), 16 bytes of nibbles    ŵ = (c - 8) · d       -> format int4, block 32
  Q4_1: d, m (float16), 16 bytes of nibbles ŵ = c · d + m         -> format q4_1, block 32

with element j of a 4-bit block in the low nibble of byte j and element j + 16 in its high
nibble. The codes are moved into `jaxsft.quant.formats`' layout (in, out), two rows per byte;
d and m stay float16 (5 bits a weight for Q4_1, not 6) and are widened to float32 on use, as
gguf does: c · d is exact in float32 (an 11-bit mantissa times a 4-bit integer), so
`dequantize` equals `gguf.quants.dequantize` bit for bit.

llama.cpp's q/k row permutation (`jaxsft.models.gguf.llama_cpp.unpermute_qk`) moves whole
rows, i.e. whole blocks, so it is undone exactly on the codes and scales.
"""

from __future__ import annotations

import numpy as np

from jaxsft.quant.formats import QuantizedTensor, pack_nibbles

BLOCK = 32
# GGML type name -> (jaxsft format, bytes per block)
GGUF_BLOCK_TYPES = {"Q8_0": ("int8", 34), "Q4_0": ("int4", 18), "Q4_1": ("q4_1", 20)}


def gguf_blocks(tensor, row_map=None) -> QuantizedTensor:
  """One GGUF weight tensor (a `gguf.GGUFReader` tensor of HF shape (out, in)) as a
  `QuantizedTensor` of the kernel (in, out). `row_map(x)` reorders the weight's rows (applied
  to codes and scales alike); raises ValueError naming the tensor for any other GGML type."""
  type_name = tensor.tensor_type.name
  if type_name not in GGUF_BLOCK_TYPES:
    raise ValueError(f"GGUF tensor {tensor.name!r} is {type_name}; model.quantize=gguf keeps only "
                     f"{sorted(GGUF_BLOCK_TYPES)} blocks (use model.quantize none, int8, int4 or nf4)")
  format, block_bytes = GGUF_BLOCK_TYPES[type_name]
  cols, rows = (int(n) for n in tensor.shape[:2])  # ne[0] = in (contiguous), ne[1] = out
  raw = np.asarray(tensor.data).view(np.uint8).reshape(rows, cols // BLOCK, block_bytes)
  d = raw[..., 0:2].copy().view(np.float16)[..., 0]  # (out, in/32)
  offsets = None
  if format == "int8":
    codes = raw[..., 2:].copy().view(np.int8).reshape(rows, cols)
  else:
    start = 4 if format == "q4_1" else 2
    if format == "q4_1":
      offsets = raw[..., 2:4].copy().view(np.float16)[..., 0]
    nibbles = raw[..., start:]
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, cols)
  if row_map is not None:
    codes, d = row_map(codes), row_map(d)
    offsets = None if offsets is None else row_map(offsets)
  codes = np.ascontiguousarray(codes.T)
  if format != "int8":
    codes = pack_nibbles(codes)
  return QuantizedTensor(codes=codes, scales=np.ascontiguousarray(d.T),
                         offsets=None if offsets is None else np.ascontiguousarray(offsets.T),
                         format=format, block=BLOCK)


def stack(tensors: list[QuantizedTensor]) -> QuantizedTensor:
  """Per-layer tensors of one format -> one tensor with a leading layer axis."""
  first = tensors[0]
  return QuantizedTensor(codes=np.stack([t.codes for t in tensors]), scales=np.stack([t.scales for t in tensors]),
                         offsets=None if first.offsets is None else np.stack([t.offsets for t in tensors]),
                         format=first.format, block=first.block)
