"""jaxsft: supervised fine-tuning of language models with LoRA in JAX/Flax."""

__version__ = "0.1.0"
