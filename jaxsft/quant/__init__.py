"""Quantized frozen bases (QLoRA): block formats, GGUF blocks, and the hooks that quantize or
dequantize a model's kernels. It sits below `jaxsft.models` (the decoder dequantizes through
`kernel`); models whose kernels come quantized from their source are `jaxsft.models.quantized`."""

from jaxsft.config_checks import QUANTIZE_CHOICES  # `model.quantize`'s list lives with the config's other choices
from jaxsft.quant.formats import FORMATS, NF4_CODE, QuantizedTensor, dequantize, quantize
from jaxsft.quant.kernel import QuantizedKernel, kernel_value
from jaxsft.quant.model import dequantize_model, is_quantized, param_count, quantize_model, tree_bytes

__all__ = ["FORMATS", "NF4_CODE", "QUANTIZE_CHOICES", "QuantizedKernel", "QuantizedTensor", "dequantize",
           "dequantize_model", "is_quantized", "kernel_value", "param_count", "quantize", "quantize_model",
           "tree_bytes"]
