"""Models: decoder-only causal LMs in Flax NNX (Llama, Mistral, Qwen2/3, Gemma 3, SmolLM3, Phi-3, OLMo 2) and their loading (no torch)."""

from jaxsft.models.decoder import CausalLM, Llama, init_random
from jaxsft.models.families import LlamaConfig, from_hf_config, to_hf_config
from jaxsft.models.hf_weights import from_hf_state_dict, to_hf_state_dict
from jaxsft.models.hub import ModelSource, load_tokenizer, resolve_model
from jaxsft.models.gguf import read_gguf
from jaxsft.models.loading import load_causal_lm, load_model

__all__ = [
    "CausalLM", "Llama", "LlamaConfig", "ModelSource", "from_hf_config", "from_hf_state_dict",
    "init_random", "load_causal_lm", "load_model", "load_tokenizer", "read_gguf", "resolve_model",
    "to_hf_config", "to_hf_state_dict",
]
