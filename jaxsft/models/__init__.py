"""Models: decoder-only causal LMs in Flax NNX (Llama, Mistral, Qwen2/3, Gemma 3, SmolLM3, Phi-3, OLMo 2) and their loading (no torch)."""

from jaxsft.models.families import LlamaConfig, from_hf_config, to_hf_config
from jaxsft.models.gguf import read_gguf
from jaxsft.models.hub import ModelSource, load_tokenizer, resolve_model

# The decoder and what builds one load jax and flax: they are imported on first use of their
# names, so resolving a model, reading its config and loading its tokenizer (the data command)
# run without them.
_DECODER = ("CausalLM", "Llama", "init_random")
_HF_WEIGHTS = ("from_hf_state_dict", "to_hf_state_dict")
_LOADING = ("load_causal_lm", "load_model")


def __getattr__(name: str):
  if name in _DECODER:
    from jaxsft.models import decoder

    return getattr(decoder, name)
  if name in _HF_WEIGHTS:
    from jaxsft.models import hf_weights

    return getattr(hf_weights, name)
  if name in _LOADING:
    from jaxsft.models import loading

    return getattr(loading, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CausalLM", "Llama", "LlamaConfig", "ModelSource", "from_hf_config", "from_hf_state_dict",
    "init_random", "load_causal_lm", "load_model", "load_tokenizer", "read_gguf", "resolve_model",
    "to_hf_config", "to_hf_state_dict",
]
