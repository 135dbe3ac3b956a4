"""Models whose frozen kernels are quantized at their source: a GGUF file's own blocks
(`load_gguf_blocks`, what `model.quantize=gguf` loads) or random codes drawn in the stored format
(`init_random_quantized`, the benchmarks' large bases). The formats and the hooks that quantize
or dequantize a loaded model are `jaxsft.quant`'s; this module needs the decoder and the GGUF
reader, so it sits above both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsft.models.decoder import CausalLM, resolve_dtype
from jaxsft.models.gguf import llama_cpp
from jaxsft.models.gguf.names import gguf_layer_names
from jaxsft.models.gguf.read import gguf_field
from jaxsft.quant import formats
from jaxsft.quant import gguf as gguf_quant
from jaxsft.quant.formats import QuantizedTensor
from jaxsft.quant.kernel import QuantizedKernel
from jaxsft.quant.model import as_variable, projections, set_quantized, tables


def load_gguf_blocks(model, gguf_path: str, *, embeddings: bool = False) -> None:
  """Replace `model`'s projection kernels with the GGUF file's own blocks, IN PLACE.

  Every layer of a projection must hold the same block type; any other type is refused
  naming the tensor and its type (`jaxsft.quant.gguf.gguf_blocks`). `embeddings`: the
  file's `token_embd` (and `output`, when not tied) blocks too: ggml's rows (ne[0] = H) are
  one token's embedding, so they are the (H, V) kernel `jaxsft.quant.kernel` stores.
  """
  from gguf import GGUFReader

  reader = GGUFReader(str(gguf_path))
  arch = gguf_field(reader, "general.architecture")
  by_module = {hf: name for name, hf in gguf_layer_names(arch).items()}
  tensors = {t.name: t for t in reader.tensors}
  cfg = model.config
  for path, proj in projections(model):
    name = by_module[path]
    row_map = None
    if arch in llama_cpp.GGUF_PERMUTED_QK_ARCHS and name in ("attn_q", "attn_k"):
      heads = cfg.num_heads if name == "attn_q" else cfg.num_kv_heads
      row_map = lambda x, heads=heads: llama_cpp.unpermute_qk(x, heads)  # noqa: E731
    try:
      layers = [gguf_quant.gguf_blocks(tensors[f"blk.{i}.{name}.weight"], row_map) for i in range(cfg.num_layers)]
    except ValueError as e:
      raise ValueError(f"{gguf_path}: {e}") from None
    kinds = {q.format for q in layers}
    if len(kinds) > 1:
      raise ValueError(f"{gguf_path}: blk.*.{name}.weight mixes block types across layers ({sorted(kinds)}); "
                       f"model.quantize=gguf needs one per projection")
    set_quantized(proj, gguf_quant.stack(layers))
  if embeddings:
    for name, table in tables(model):
      tensor = tensors["token_embd.weight" if name == "embed_tokens" else "output.weight"]
      if tensor.tensor_type.name not in gguf_quant.GGUF_BLOCK_TYPES:
        raise ValueError(f"{gguf_path}: GGUF tensor {tensor.name!r} is {tensor.tensor_type.name}; "
                         f"model.quantize_embeddings with model.quantize=gguf keeps only "
                         f"{sorted(gguf_quant.GGUF_BLOCK_TYPES)} blocks (set model.quantize_embeddings=false)")
      setattr(model, name, as_variable(gguf_quant.gguf_blocks(tensor)))
  model.quantize = "gguf"


def init_random_quantized(config, format: str, *, block: int = formats.DEFAULT_BLOCK, dtype="bfloat16", seed: int = 0,
                          abstract: bool = False, embeddings: bool = False, **kwargs):
  """A random-weight `CausalLM` whose projection kernels are DRAWN quantized (random codes,
  scales around a 0.02-std weight's block maximum): no float copy of the kernels ever exists,
  so an 8B base fits where its float32 weights would not. Embeddings and LM head are drawn
  the same way with `embeddings`, else N(0, 0.02²) in `dtype` like the biases; norm weights 1
  (benchmarks and memory checks of real shapes).

  Drawn with numpy straight into the stored dtypes, one array at a time (a jax draw of 8-bit
  codes makes 32-bit words first); `abstract`: shapes and dtypes only (`jax.ShapeDtypeStruct`),
  nothing allocated.
  """
  import ml_dtypes  # noqa: F401  (numpy's bfloat16)

  dtype = resolve_dtype(dtype)
  model = nnx.eval_shape(lambda: CausalLM(config, dtype=dtype, rngs=nnx.Rngs(0), **kwargs))
  rng = np.random.default_rng(seed)

  def draw(shape, dt, make):
    if abstract:
      return jax.ShapeDtypeStruct(shape, dt)
    return jnp.asarray(make(shape))

  max_abs = 0.06  # ~3 standard deviations of N(0, 0.02²)
  scale = {"int8": max_abs / 127, "int4": max_abs / 7, "nf4": max_abs}[format]
  def draw_quantized(*lead, rows, out):
    code_rows, code_dtype = (rows, np.int8) if format == "int8" else (rows // 2, np.uint8)
    codes = draw((*lead, code_rows, out), code_dtype,
                 lambda s: rng.integers(0, 256, s, dtype=np.uint8).view(code_dtype))
    scales = draw((*lead, rows // block, out), np.float16,
                  lambda s: (rng.uniform(0.5, 1.5, s) * scale).astype(np.float16))
    return QuantizedKernel(QuantizedTensor(codes=codes, scales=scales, format=format, block=block))

  for _, proj in projections(model):
    layers, rows, out = proj.kernel.shape
    proj.kernel = draw_quantized(layers, rows=rows, out=out)
  if embeddings:
    for name, table in tables(model):
      vocab, hidden = table.shape
      setattr(model, name, draw_quantized(rows=hidden, out=vocab))
  for path, variable in nnx.iter_graph(model):  # the float rest (a QuantizedKernel is no Param)
    if not isinstance(variable, nnx.Param):
      continue
    shape = tuple(variable.shape)
    if "norm" in ".".join(map(str, path)):
      variable.set_value(draw(shape, dtype, lambda s: np.ones(s, dtype)))
    else:
      variable.set_value(draw(shape, dtype, lambda s: _normal_in_rows(rng, s, dtype)))
  model.quantize = format
  return model


def _normal_in_rows(rng: np.random.Generator, shape: tuple[int, ...], dtype, std: float = 0.02) -> np.ndarray:
  """N(0, std²) drawn straight into `dtype`, 4096 rows at a time: no float32 copy of a whole
  embedding table ever exists."""
  out = np.empty(shape, dtype)
  flat = out.reshape(-1, shape[-1]) if len(shape) > 1 else out.reshape(1, -1)
  for start in range(0, flat.shape[0], 4096):
    chunk = rng.standard_normal((min(4096, flat.shape[0] - start), flat.shape[1]), dtype=np.float32)
    flat[start:start + 4096] = (chunk * np.float32(std)).astype(dtype)
  return out
