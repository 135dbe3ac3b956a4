"""A 16-bit layer stack that XLA's CPU backend slices without converting it to float32.

The decoder scans its layers over weights stacked along a leading layer axis, so each step of
the scan takes its layer's weights with a dynamic slice. XLA's CPU backend runs 16-bit
elementwise and data-movement ops in float32 (its float normalization pass), so a bfloat16
dynamic slice becomes convert-to-float32, slice, convert-back, and loop-invariant code motion
hoists the first conversion out of the loop: every step converted every layer's weights to a
float32 copy (twice their size) and read the copy back, a few tenths of a second a step at
SmolLM2's size.

`pack` views each 16-bit leaf (..., 2n) as float32 (..., n) holding the same bits in pairs, so
the scan slices float32 data, and `unpack` views a slice as 16-bit again: no value changes, no
conversion is left (a bitcast is neither float normalized nor folded back). Both carry their
cotangents through the same views, so a trained 16-bit weight (full fine-tuning) gets exactly
the gradient it gets unpacked: the scan transposes each layer's slice on its own (stacks, never
sums, the per-layer cotangents), and a packed value feeds nothing but `unpack`.

Packing costs a pass over the stack (XLA's CPU backend builds the float32 words element by
element). Calls that read the same weights again and again (each train step's frozen base, each
generated token) take them packed ahead (`prepacked`, as `Packed` leaves), and `pack_tree` passes
those through; `unpacked` gives the 16-bit arrays back (to save or export the weights).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_16BIT = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def packable(x) -> bool:
  """A 16-bit float array of a stack (a layer axis and at least one more) with an even last axis."""
  return jnp.dtype(x.dtype) in _16BIT and x.ndim >= 2 and x.shape[-1] % 2 == 0


def _pack(x: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2), jnp.float32)


def _unpack(p: jax.Array, dtype) -> jax.Array:
  x = jax.lax.bitcast_convert_type(p, dtype)
  return x.reshape(*x.shape[:-2], x.shape[-2] * 2)


@jax.custom_vjp
def pack(x: jax.Array) -> jax.Array:
  """(..., 2n) bfloat16/float16 as float32 (..., n), bit for bit."""
  return _pack(x)


def _pack_fwd(x):
  return _pack(x), jnp.zeros((), x.dtype)  # the residual only carries the dtype


def _pack_bwd(dtype_carrier, g):
  return (_unpack(g, dtype_carrier.dtype),)


pack.defvjp(_pack_fwd, _pack_bwd)


@jax.custom_vjp
def _unpack_bf16(p: jax.Array) -> jax.Array:
  return _unpack(p, jnp.bfloat16)


@jax.custom_vjp
def _unpack_f16(p: jax.Array) -> jax.Array:
  return _unpack(p, jnp.float16)


for _f, _dtype in ((_unpack_bf16, jnp.bfloat16), (_unpack_f16, jnp.float16)):
  _f.defvjp(lambda p, _d=_dtype: (_unpack(p, _d), None), lambda _, g: (_pack(g),))


def unpack(p: jax.Array, dtype) -> jax.Array:
  """The inverse of `pack`: float32 (..., n) as `dtype` (..., 2n)."""
  return (_unpack_bf16 if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) else _unpack_f16)(p)


@jax.tree_util.register_pytree_node_class
class Packed:
  """A 16-bit stack packed ahead of the calls that read it (`prepacked`): its float32 `words`
  (`pack`) and the name of its `dtype`."""

  def __init__(self, words, dtype: str):
    self.words, self.dtype = words, dtype

  def tree_flatten(self):
    return (self.words,), self.dtype

  @classmethod
  def tree_unflatten(cls, dtype, children):
    return cls(children[0], dtype)


def _is_packed(x) -> bool:
  return isinstance(x, Packed)


_pack_outside = jax.jit(_pack)
_unpack_outside = jax.jit(_unpack, static_argnums=1)


def prepacked(tree):
  """`tree` with its `packable` leaves as `Packed` (a layer stack's tree only: every packable leaf
  must be read through `pack_tree`)."""
  return jax.tree.map(lambda x: Packed(_pack_outside(x), jnp.dtype(x.dtype).name) if packable(x) else x, tree)


def unpacked(tree):
  """The inverse of `prepacked`: every `Packed` leaf as the 16-bit array it holds, bit for bit."""
  return jax.tree.map(lambda x: _unpack_outside(x.words, jnp.dtype(x.dtype)) if _is_packed(x) else x, tree,
                      is_leaf=_is_packed)


def pack_tree(tree):
  """(the tree with its `packable` leaves packed, each leaf's dtype name or "" where it is left
  as it is): what `unpack_tree` takes. `Packed` leaves (`prepacked`) are taken as they are."""
  dtypes = jax.tree.map(lambda x: x.dtype if _is_packed(x) else jnp.dtype(x.dtype).name if packable(x) else "", tree,
                        is_leaf=_is_packed)
  packed = jax.tree.map(lambda x, d: x.words if _is_packed(x) else pack(x) if d else x, tree, dtypes, is_leaf=_is_packed)
  return packed, dtypes


def unpack_tree(packed, dtypes):
  """`pack_tree`'s tree (or a slice of every leaf along the layer axis) as it was."""
  return jax.tree.map(lambda p, d: unpack(p, d) if d else p, packed, dtypes)
