"""The step functions: the logged learning rate is the one AdamW used, skipped steps included."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsft import config as config_lib
from jaxsft import lora, models
from jaxsft import step as step_lib
from tiny_model import TINY


def test_logged_lr_is_the_rate_adamw_used_after_a_skipped_step():
  cfg = config_lib.TrainConfig()
  cfg.optim.schedule, cfg.optim.warmup_steps, cfg.optim.lr = "linear", 4, 1e-2
  model = models.init_random(TINY, seed=0)
  lora.apply_lora(model, r=2, alpha=4, seed=1)
  graphdef, params, frozen = nnx.split(model, nnx.LoRAParam, ...)
  schedule = step_lib.make_schedule(cfg.optim, 10)
  tx = step_lib.make_optimizer(cfg.optim, schedule)
  fns = step_lib.make_step_functions(graphdef, cfg, tx, schedule)
  opt_state = tx.init(params)
  good = fns.zeros(params)
  good = {**good, "grads": jax.tree.map(lambda g: g + 1.0, good["grads"]), "nll": jnp.float32(3.0),
          "n_valid": jnp.int32(2)}
  bad = {**good, "nll": jnp.float32(np.nan)}
  bad["grads"] = jax.tree.map(lambda g: g * np.nan, good["grads"])
  lrs, finite = [], []
  for acc in (good, bad, good, good):  # the second update is skipped
    params, opt_state, out = fns.apply(params, opt_state, acc)
    lrs.append(float(out["lr"]))
    finite.append(bool(out["finite"]))
  assert finite == [True, False, True, True]
  # AdamW applied updates 0, (skip), 1, 2: its schedule read counts 0, 1, 1, 2 — not the loop's 0..3.
  expected = [float(schedule(c)) for c in (0, 1, 1, 2)]
  assert lrs == expected and expected[2] != float(schedule(2))
  assert int(step_lib.updates_applied(opt_state)) == 3
