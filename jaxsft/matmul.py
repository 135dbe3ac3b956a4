"""The model's weight products, written in the forms a CPU runs fastest in 16-bit.

    matmul(x, w)      y = x w      x (..., k), w (k, n)   (a projection: the kernel is (in, out))
    matmul_t(x, w)    y = x wᵀ     x (..., k), w (n, k)   (the LM head: the embedding is (V, H))

In float32, and on a GPU or TPU, both are the plain products. With a bfloat16 weight on a CPU
with bf16 units (AMX, `avx512_bf16`; `uses_16bit_kernels`), x is rounded to the weight's dtype
and the product accumulates in float32, rounded once to x's dtype,

    y = round_x(Σ_k round₁₆(x_k) · w_k  in float32),

which for a 16-bit x is what XLA computes for a plain 16-bit product anyway (it upcasts the
operands) and what PyTorch's bfloat16 GEMM computes; x may also be float32 (the activations of a
16-bit model on a CPU, `jaxsft.models.decoder.activation_dtype`), rounded at the product as torch's
autocast does. What changes is the kernel: XLA's CPU backend hands a 16-bit × 16-bit → float32
product with the operands in place to its YNNPACK library kernels (bf16 dot-product
instructions: `avx512_bf16`, AMX tiles), where a 16-bit output, a 2-D transposed operand or a
float32 operand makes it convert both operands to float32 first and run the float32 kernel. The
backward pass is written out (`jax.custom_vjp`) for the same reason: autodiff's transpose of a
float32-accumulating product multiplies a float32 cotangent by the 16-bit weight, a float32
product. Here every product of the backward pass takes 16-bit operands, with a leading batch
axis on the activations (g: the cotangent of y):

    ∂x = round_x(round₁₆(g) wᵀ),   ∂w = round₁₆(Σ_tokens round₁₆(x)ᵀ round₁₆(g))
    (for y = x w; for y = x wᵀ, mirrored)

A 16-bit product's output is named `PRODUCT` (`jax.ad_checkpoint.checkpoint_name`): a remat
policy that keeps the layers' dot outputs must keep it by name, since a policy that looks for dot
primitives does not see inside a `custom_vjp`. `cpu_matmul_path()` says which path the installed
XLA takes on this machine.
"""

from __future__ import annotations

import functools
import pathlib
import re

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

PRODUCT = "weight_product"

_SIXTEEN_BIT = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
BF16_UNITS = ("amx_bf16", "avx512_bf16")
"""The CPU features that run bfloat16 products faster than float32 ones: AMX tiles, AVX-512 bf16
dot products. Without either, a bfloat16 product is converted to float32 anyway."""


def has_bf16_units(features) -> bool:
  """Whether CPU `features` (`cpu_features`, or /proc/cpuinfo flags) include one of `BF16_UNITS`."""
  return any(f in BF16_UNITS for f in features)


def uses_16bit_kernels(dtype) -> bool:
  """Whether products with `dtype` weights run on the CPU's 16-bit kernels here: bfloat16, on a
  CPU with bf16 units (`BF16_UNITS`), whose XLA hands such products to its library kernels.
  Elsewhere on a CPU (float16, or a CPU without the units) a 16-bit weight meets float32
  activations in a float32 product, which is what XLA would run for a 16-bit product there."""
  return (jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) and jax.default_backend() == "cpu"
          and has_bf16_units(_this_cpu()) and library_takes_16bit_products())


def product_dtype(activation_dtype, weight_dtype) -> jnp.dtype:
  """The operand dtype of the products between two activations (the attention's) in a model with
  `weight_dtype` weights: that 16-bit dtype where the CPU's 16-bit kernels serve it
  (`uses_16bit_kernels`: the activations are float32 there, rounded at each product), else the
  activations' own."""
  return jnp.dtype(weight_dtype) if uses_16bit_kernels(weight_dtype) else jnp.dtype(activation_dtype)


def _accumulates_in_float32(x: jax.Array, w: jax.Array) -> bool:
  """Whether (x, w) take the float32-accumulating 16-bit path: a weight on the 16-bit kernels
  (`uses_16bit_kernels`), x in its dtype or float32 (rounded to it at the product)."""
  return jnp.dtype(x.dtype) in (jnp.dtype(w.dtype), jnp.dtype(jnp.float32)) and uses_16bit_kernels(w.dtype)


def _batched(x: jax.Array) -> jax.Array:
  """x with at least one leading axis before its last: (k,) or (m, k) → (1, ..., k). XLA's CPU
  library path takes a transposed weight beside a batched activation, not beside a 2-D one."""
  return x.reshape((1,) * max(3 - x.ndim, 0) + x.shape)


def _einsum(spec: str, a: jax.Array, b: jax.Array, dtype) -> jax.Array:
  return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(dtype)


def _operands(x, w):
  """An activation (or a cotangent) batched and rounded to the weight's dtype: a 16-bit operand."""
  return _batched(x).astype(w.dtype)


# The einsums of y, ∂x and ∂w for y = x w (w (k, n)) and for y = x wᵀ (w (n, k)).
_FORMS = {False: ("...k,kn->...n", "...n,kn->...k", "...k,...n->kn"),
          True: ("...k,nk->...n", "...n,nk->...k", "...k,...n->nk")}


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _product16(transposed: bool, x, w):
  out = w.shape[0] if transposed else w.shape[-1]
  return _einsum(_FORMS[transposed][0], _operands(x, w), w, x.dtype).reshape(*x.shape[:-1], out)


def _product16_fwd(transposed, x, w):
  return _product16(transposed, x, w), (x, w)


def _product16_bwd(transposed, residuals, g):
  x, w = residuals
  _, dx_form, dw_form = _FORMS[transposed]
  dx = _einsum(dx_form, _operands(g, w), w, x.dtype).reshape(x.shape)
  dw = _einsum(dw_form, _operands(x, w), _operands(g, w), w.dtype)  # dropped by XLA when w is frozen (LoRA)
  return dx, dw


_product16.defvjp(_product16_fwd, _product16_bwd)


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """x w for x (..., k), w (k, n), in x's dtype (see the module docstring for 16-bit on a CPU)."""
  return checkpoint_name(_product16(False, x, w), PRODUCT) if _accumulates_in_float32(x, w) else x @ w


def matmul_t(x: jax.Array, w: jax.Array) -> jax.Array:
  """x wᵀ for x (..., k), w (n, k), in x's dtype (see the module docstring for 16-bit on a CPU)."""
  return checkpoint_name(_product16(True, x, w), PRODUCT) if _accumulates_in_float32(x, w) else x @ w.T


# ---------------------------------------------------------------------------------------------
# What ran: for the run's summary and the benchmarks.


def cpu_features(cpuinfo: str | None = None) -> tuple[str, ...]:
  """The matrix and vector features of this CPU that its 16-bit products can use, as
  /proc/cpuinfo names them (amx_bf16, avx512_bf16, avx512f, avx2); () where it cannot be read."""
  if cpuinfo is None:
    try:
      cpuinfo = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
      return ()
  flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
  return tuple(f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags)


@functools.cache
def _this_cpu() -> tuple[str, ...]:
  return cpu_features()


@functools.cache
def library_takes_16bit_products() -> bool:
  """Whether the installed XLA runs `matmul`'s bfloat16 product on its CPU library kernels with
  bfloat16 operands: read from the compiled program of a small one (a YNNPACK fusion whose
  computation takes bf16 parameters, not operands converted to float32 first)."""
  if jax.default_backend() != "cpu":
    return False
  x = jax.ShapeDtypeStruct((2, 64, 64), jnp.bfloat16)
  product = functools.partial(_product16, False)
  hlo = jax.jit(product).lower(x, jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)).compile().as_text()
  return any(_library_fusion_params(hlo, line) == {"bf16"} for line in hlo.splitlines() if "__ynn_fusion" in line)


def _library_fusion_params(hlo: str, fusion_line: str) -> set[str]:
  """The element types of the parameters of the computation a fusion line calls."""
  called = re.search(r"calls=(%[\w.\-]+)", fusion_line)
  if not called:
    return set()
  header = next((line for line in hlo.splitlines() if line.startswith(called.group(1) + " (")), "")
  return set(re.findall(r": (\w+)\[", header.split("->")[0]))


def cpu_16bit_note(dtype) -> str | None:
  """A line for a run that asked for 16-bit `dtype` weights on a CPU whose products cannot use
  16-bit kernels (`uses_16bit_kernels`: a CPU without bf16 units, float16, or an XLA without the
  library kernel): the weights take half the memory, but the products still run in float32, with
  conversions added, so the steps are no faster than float32's. None for float32, where the
  16-bit kernels run, and off a CPU."""
  if jax.default_backend() != "cpu" or jnp.dtype(dtype) not in _SIXTEEN_BIT or uses_16bit_kernels(dtype):
    return None
  return (f"{cpu_matmul_path(dtype)}: {jnp.dtype(dtype).name} halves the frozen weights' memory here, "
          f"not the step time (model.dtype auto computes in float32 on a CPU)")


def cpu_matmul_path(dtype) -> str | None:
  """One line naming what runs the model's products with `dtype` weights on this CPU, for a run's
  summary; None off a CPU."""
  if jax.default_backend() != "cpu":
    return None
  features = cpu_features()
  name = jnp.dtype(dtype).name
  vector = next((f for f in ("avx512f", "avx2") if f in features), "no AVX2")
  if jnp.dtype(dtype) not in _SIXTEEN_BIT:
    return f"{name} products on XLA's CPU kernels ({vector})"
  if uses_16bit_kernels(dtype):
    unit = "AMX tiles" if "amx_bf16" in features else "avx512_bf16 dot products"
    return f"{name} products accumulated in float32 by XLA's YNNPACK kernels, on {unit}"
  if name != "bfloat16":
    why = "the 16-bit kernels serve bfloat16"
  elif has_bf16_units(features):
    why = "this XLA has no 16-bit library kernel"
  else:
    why = "no bf16 units on this CPU"
  return f"{name} weights, float32 products on XLA's CPU kernels ({vector}; {why})"
