"""mode=full against PyTorch: jaxsft's step (the trainer's own `trainable_filter` split and
`jaxsft.step` functions) gives the gradients of EVERY parameter that torch's autograd gives for
Σ nll / Σ valid, and one clipped AdamW update lands on the same weights as
`clip_grad_norm_` + `torch.optim.AdamW`. Tiny random Llama (untied) and Qwen2 (tied, biases)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxsft import config as config_lib
from jaxsft import step as step_lib
from jaxsft.models import hf_weights
from jaxsft.train.startup import trainable_filter
from parity_utils import batch_of, grad_rel_err, model_inputs, torch_logits

LR, WD, CLIP = 1e-3, 0.01, 1.0


def _cfg():
  cfg = config_lib.TrainConfig()
  cfg.mode = "full"
  cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.max_grad_norm = LR, WD, CLIP
  cfg.optim.schedule, cfg.optim.warmup_steps = "constant", 0
  return cfg


def _hf_named(graphdef, params, frozen) -> dict[str, np.ndarray]:
  """A params-shaped tree (weights or gradients) under transformers' names and layouts."""
  return {k: np.asarray(v) for k, v in hf_weights.to_hf_state_dict(nnx.merge(graphdef, params, frozen)).items()}


@pytest.mark.slow
@pytest.mark.parametrize("which", ["tiny_llama", "tiny_qwen2"])
def test_full_gradients_and_one_adamw_step_match_torch(which, request, examples):
  torch_model, jax_model = request.getfixturevalue(which)
  batch = batch_of(examples[:4], buckets=(128,))
  cfg = _cfg()
  graphdef, params, frozen = nnx.split(nnx.clone(jax_model), trainable_filter(cfg), ...)
  assert not jax.tree.leaves(frozen)  # every param is trained
  schedule = step_lib.make_schedule(cfg.optim, 10)
  tx = step_lib.make_optimizer(cfg.optim, schedule)
  fns = step_lib.make_step_functions(graphdef, cfg)
  jbatch = {k: jnp.asarray(v) for k, v in batch.items() if k in step_lib.BATCH_KEYS}
  acc = jax.jit(fns.accumulate)(fns.zeros(params), params, frozen, jbatch, np.int32(0))
  n_valid = int(acc["n_valid"])
  j_grads = {k: v / n_valid for k, v in _hf_named(graphdef, acc["grads"], frozen).items()}
  new_params, _, out = jax.jit(fns.apply)(params, tx.init(params), acc, schedule)
  j_new = _hf_named(graphdef, new_params, frozen)

  model = __import__("copy").deepcopy(torch_model).train(False)
  logits = torch_logits(model, batch)
  targets = torch.tensor(np.asarray(batch["labels"])[:, 1:], dtype=torch.long).reshape(-1)
  nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets,
                                          ignore_index=-100, reduction="sum")
  count = int((targets != -100).sum())
  assert count == n_valid
  (nll / count).backward()
  t_grads = {name: p.grad.detach().numpy().copy() for name, p in model.named_parameters()}
  assert sorted(j_grads) == sorted(t_grads)
  # transformers builds embed_tokens as nn.Embedding(padding_idx=pad_token_id), whose row gets no
  # gradient. SmolLM2's pad is its end-of-turn token (id 2), a real input token in multi-turn
  # data, and jaxsft trains that row (tied: torch's row has the LM head's part only); every other
  # entry of every parameter must agree.
  pad = torch_model.config.pad_token_id
  assert j_grads["model.embed_tokens.weight"][pad].any()
  if not torch_model.config.tie_word_embeddings:
    assert not t_grads["model.embed_tokens.weight"][pad].any()
  for grads in (j_grads, t_grads):
    grads["model.embed_tokens.weight"] = np.delete(grads["model.embed_tokens.weight"], pad, axis=0)
  err = grad_rel_err([j_grads[k] for k in sorted(j_grads)], [t_grads[k] for k in sorted(t_grads)])
  print(f"{which}: loss {nll.item() / count:.5f} vs {float(out['loss']):.5f}; all-param grad rel err {err:.1e}")
  assert abs(float(out["loss"]) - nll.item() / count) <= 1e-5 * abs(nll.item() / count)
  assert err <= 1e-5

  # The update from here on: the same gradients on both sides (jaxsft's, the pad row included),
  # so clipping and AdamW are compared alone.
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.grad.copy_(torch.as_tensor(_hf_named(graphdef, acc["grads"], frozen)[name] / n_valid))
  before = {name: p.detach().numpy().copy() for name, p in model.named_parameters()}
  torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
  opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WD)
  opt.step()
  t_new = {name: p.detach().numpy() for name, p in model.named_parameters()}
  if "lm_head.weight" not in t_new:  # tied: one tensor, exported once
    j_new.pop("lm_head.weight", None)
  moved = max(np.abs(t_new[k] - before[k]).max() for k in t_new)
  worst = max(np.abs(j_new[k] - t_new[k]).max() for k in t_new)
  print(f"{which}: one AdamW step moved weights by up to {moved:.1e}; jaxsft vs torch max |Δ| {worst:.1e}")
  assert moved > 0.5 * LR and worst <= 1e-6
