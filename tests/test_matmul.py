"""The model's weight products (jaxsft.matmul): on the 16-bit kernels, the same values as XLA's plain
16-bit product and autodiff's gradients, computed by the float32-accumulating forms; on a CPU
without bf16 units, float32 products; the path they take, as a run's summary names it; and the
float32 activations of a 16-bit model on a CPU. The CPU's features are set by each test, so the
suite checks the same things on every CPU."""

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsft import matmul as matmul_lib
from jaxsft.models import decoder

RNG = np.random.default_rng(0)


@pytest.fixture
def bf16_units(monkeypatch):
  """This CPU as one with bf16 units (the products' values do not depend on the kernel)."""
  monkeypatch.setattr(matmul_lib, "uses_16bit_kernels", lambda dtype: jnp.dtype(dtype) == jnp.bfloat16)


@pytest.fixture
def no_bf16_units(monkeypatch):
  monkeypatch.setattr(matmul_lib, "_this_cpu", lambda: ("avx512f", "avx2"))


def _arrays(*shapes, dtype=jnp.bfloat16):
  return [jnp.asarray(RNG.standard_normal(s), dtype) for s in shapes]


def _reference(x, w, transpose):
  """Autodiff of the product computed in float32 from the same 16-bit values, rounded to x's dtype."""
  y = jnp.einsum("...k,nk->...n" if transpose else "...k,kn->...n", x.astype(jnp.float32), w.astype(jnp.float32))
  return y.astype(x.dtype)


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("x_shape", [(3, 5, 16), (7, 16), (16,)])
def test_16bit_product_and_gradients_equal_a_float32_product_rounded_once(bf16_units, transpose, x_shape):
  x, = _arrays(x_shape)
  w, = _arrays((24, 16) if transpose else (16, 24))
  ct, = _arrays((*x_shape[:-1], 24))
  fn = matmul_lib.matmul_t if transpose else matmul_lib.matmul
  y, vjp = jax.vjp(fn, x, w)
  y_ref, vjp_ref = jax.vjp(lambda a, b: _reference(a, b, transpose), x, w)
  assert y.dtype == jnp.bfloat16 and y.shape == y_ref.shape
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))
  for got, want in zip(vjp(ct), vjp_ref(ct)):
    assert got.dtype == want.dtype == jnp.bfloat16
    # the reference's cotangent products run in float32 before their rounding, the same sums
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2)


def test_float32_activations_round_to_the_weights_dtype_at_the_product(bf16_units):
  x, = _arrays((4, 8, 16), dtype=jnp.float32)
  w, = _arrays((16, 24))
  ct, = _arrays((4, 8, 24), dtype=jnp.float32)
  y, vjp = jax.vjp(matmul_lib.matmul, x, w)
  assert y.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(y), np.asarray(_reference(x.astype(jnp.bfloat16), w, False).astype(jnp.float32)),
                             rtol=1e-2, atol=1e-2)
  dx, dw = vjp(ct)
  assert dx.dtype == jnp.float32 and dw.dtype == jnp.bfloat16
  want_dx = ct.astype(jnp.bfloat16).astype(jnp.float32) @ w.astype(jnp.float32).T
  np.testing.assert_allclose(np.asarray(dx), np.asarray(want_dx), rtol=1e-5, atol=1e-5)


def test_without_bf16_units_a_bf16_weight_meets_float32_activations_in_a_float32_product(no_bf16_units):
  x, = _arrays((3, 5, 16), dtype=jnp.float32)
  w, = _arrays((16, 24))
  assert not matmul_lib.uses_16bit_kernels(jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(matmul_lib.matmul(x, w)), np.asarray(x @ w.astype(jnp.float32)))
  assert "custom_vjp" not in str(jax.make_jaxpr(matmul_lib.matmul)(x, w))
  assert matmul_lib.cpu_matmul_path(jnp.bfloat16).startswith("bfloat16 weights, float32 products")


def test_float32_products_are_the_plain_ones():
  x, w = _arrays((3, 5, 16), (16, 24), dtype=jnp.float32)
  np.testing.assert_array_equal(np.asarray(matmul_lib.matmul(x, w)), np.asarray(x @ w))
  np.testing.assert_array_equal(np.asarray(matmul_lib.matmul_t(x, w.T)), np.asarray(x @ w))


def test_16bit_products_are_plain_off_a_cpu(monkeypatch):
  """On a GPU or TPU the 16-bit products are XLA's own (traced here, never run)."""
  x, w = _arrays((3, 5, 16), (16, 24))
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert not matmul_lib.uses_16bit_kernels(jnp.bfloat16)
  jaxpr = str(jax.make_jaxpr(matmul_lib.matmul)(x, w))
  assert "custom_vjp" not in jaxpr and "preferred_element_type=float32" not in jaxpr
  assert matmul_lib.cpu_matmul_path(jnp.bfloat16) is None
  assert decoder.activation_dtype(jnp.bfloat16) == jnp.bfloat16


def test_a_16bit_model_keeps_float32_activations_on_a_cpu():
  assert decoder.activation_dtype(jnp.bfloat16) == jnp.float32
  assert decoder.activation_dtype(jnp.float16) == jnp.float32
  assert decoder.activation_dtype(jnp.float32) == jnp.float32


def test_a_remat_policy_that_keeps_dots_keeps_the_16bit_products(bf16_units):
  """The layer's products are a custom_vjp: a dots policy keeps them by name, so the backward
  pass does not run them again (the rematerialized computation holds no forward product)."""
  from jaxsft.models import decoder as d

  policy = d.REMAT_POLICIES[d.DEFAULT_REMAT]
  x, w = _arrays((2, 8, 16), (16, 16))

  def layer(x):
    return jnp.sum(jnp.tanh(matmul_lib.matmul(jnp.tanh(x), w)).astype(jnp.float32))

  def saved(policy):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(layer, policy=policy), x)
    return out.getvalue()

  assert f"named '{matmul_lib.PRODUCT}'" in saved(policy)
  assert matmul_lib.PRODUCT not in saved(jax.checkpoint_policies.nothing_saveable)


CPUINFO = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_tile amx_bf16\n"


def test_cpu_features_name_the_matrix_units():
  assert matmul_lib.cpu_features(CPUINFO) == ("amx_bf16", "avx512_bf16", "avx512f", "avx2")
  assert matmul_lib.cpu_features("flags\t: fpu sse avx2\n") == ("avx2",)
  assert matmul_lib.cpu_features("") == ()


@pytest.mark.parametrize("flags,line", [
    ("avx2 avx512f avx512_bf16 amx_bf16", "bfloat16 products accumulated in float32 by XLA's YNNPACK kernels, on AMX tiles"),
    ("avx2 avx512f avx512_bf16", "bfloat16 products accumulated in float32 by XLA's YNNPACK kernels, on avx512_bf16 dot products"),
    ("avx2 avx512f", "bfloat16 weights, float32 products on XLA's CPU kernels (avx512f; no bf16 units on this CPU)"),
    ("avx2", "bfloat16 weights, float32 products on XLA's CPU kernels (avx2; no bf16 units on this CPU)")])
def test_the_summary_line_names_the_kernels_that_ran(monkeypatch, flags, line):
  features = matmul_lib.cpu_features(f"flags\t: fpu {flags}\n")
  monkeypatch.setattr(matmul_lib, "cpu_features", lambda cpuinfo=None: features)
  monkeypatch.setattr(matmul_lib, "_this_cpu", lambda: features)
  monkeypatch.setattr(matmul_lib, "library_takes_16bit_products", lambda: True)
  assert matmul_lib.cpu_matmul_path(jnp.bfloat16) == line
  vector = "avx512f" if "avx512f" in features else "avx2"
  assert matmul_lib.cpu_matmul_path(jnp.float32) == f"float32 products on XLA's CPU kernels ({vector})"
  assert matmul_lib.cpu_matmul_path(jnp.float16).endswith("the 16-bit kernels serve bfloat16)")
  monkeypatch.setattr(matmul_lib, "library_takes_16bit_products", lambda: False)
  if "avx512_bf16" in features:  # an XLA without the library path
    assert matmul_lib.cpu_matmul_path(jnp.bfloat16).endswith("(avx512f; this XLA has no 16-bit library kernel)")


@pytest.mark.parametrize("flags", ["avx2 avx512f avx512_bf16 amx_bf16", "avx2 avx512f avx512_bf16", "avx2 avx512f", "avx2"])
def test_a_16bit_run_is_told_when_its_products_run_in_float32(monkeypatch, flags):
  features = matmul_lib.cpu_features(f"flags\t: fpu {flags}\n")
  monkeypatch.setattr(matmul_lib, "cpu_features", lambda cpuinfo=None: features)
  monkeypatch.setattr(matmul_lib, "_this_cpu", lambda: features)
  monkeypatch.setattr(matmul_lib, "library_takes_16bit_products", lambda: True)
  note = matmul_lib.cpu_16bit_note(jnp.bfloat16)
  if "avx512_bf16" in flags:  # the products run on the bf16 units: nothing to say
    assert note is None
  else:
    assert note.startswith(matmul_lib.cpu_matmul_path(jnp.bfloat16) + ": ") and "no bf16 units" in note
    assert "halves the frozen weights' memory here, not the step time" in note
  assert matmul_lib.cpu_16bit_note(jnp.float32) is None
  assert "the 16-bit kernels serve bfloat16" in matmul_lib.cpu_16bit_note(jnp.float16)  # on any CPU
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert matmul_lib.cpu_16bit_note(jnp.bfloat16) is None and matmul_lib.cpu_16bit_note(jnp.float16) is None


def test_loading_a_16bit_model_to_train_says_so_where_its_products_run_in_float32(tiny_dir, monkeypatch, caplog):
  from jaxsft import config as config_lib
  from jaxsft.train import startup

  def load(dtype):
    caplog.clear()
    cfg = config_lib.apply_overrides(config_lib.TrainConfig(), {"model.name": str(tiny_dir), "model.dtype": dtype})
    with caplog.at_level("WARNING", logger="jaxsft.train"):
      startup.load_model_to_train(cfg)
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]

  monkeypatch.setattr(matmul_lib, "_this_cpu", lambda: ("avx2",))
  assert load("bfloat16") == [matmul_lib.cpu_16bit_note(jnp.bfloat16)]  # float32's None: the test above
  monkeypatch.setattr(matmul_lib, "uses_16bit_kernels", lambda dtype: jnp.dtype(dtype) == jnp.bfloat16)
  assert load("bfloat16") == []


def test_this_xla_hands_16bit_products_to_its_library_kernels():
  """The installed jaxlib is what the project's bfloat16 speed rests on: a jaxlib that loses the
  path shows here, not only as a slower benchmark."""
  assert matmul_lib.library_takes_16bit_products()
