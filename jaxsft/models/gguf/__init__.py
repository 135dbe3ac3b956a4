"""GGUF, read and written without torch, in llama.cpp's conventions.

transformers' own GGUF loader needs torch, so the file is read with the `gguf` package (numpy
dequantization) and llama.cpp's conventions are undone here, per GGUF architecture
(`general.architecture`); writing redoes them, as llama.cpp's `convert_hf_to_gguf.py` does:

| GGUF arch | jaxsft family | read as llama.cpp runs it                                            |
| --------- | ------------- | -------------------------------------------------------------------- |
| llama     | llama         | q/k rows permuted (llama.cpp's `LlamaModel.permute`)                 |
| qwen2     | qwen2         | q/k/v biases                                                         |
| qwen3     | qwen3         | `attn_q_norm`/`attn_k_norm`; no sliding window                       |
| gemma3    | gemma3_text   | every `*norm.weight` stored as 1 + w; layer i sliding iff i % 6 < 5; |
|           |               | sliding layers at RoPE base 10000, unscaled; attention scale         |
|           |               | 1/sqrt(head_dim) (1/sqrt(hidden/heads) for the 62-layer 27B)         |
| smollm3   | smollm3       | q/k rows permuted; no RoPE on layers i with (i + 1) % 4 == 0         |
| phi3      | phi3          | fused `attn_qkv`, `ffn_up` = gate_up; rope.dimension_count rotary    |
|           |               | dims (partial rotary); attention.sliding_window (0: none)            |
| olmo2     | olmo2         | `post_attention_norm`/`post_ffw_norm`, q/k norms over the projection |

(llama.cpp's `src/llama-model.cpp` hard-codes the Gemma 3 pattern, local base and scale and
the SmolLM3 NoPE step: no GGUF key carries them.) A file whose metadata llama.cpp builds would
read differently, or that jaxsft cannot represent, is refused naming the key; a model llama.cpp
would run differently is not written (`gguf_refusal`).

- `names`: the two-way tables, GGUF architecture <-> model_type and GGUF <-> HF tensor names.
- `llama_cpp`: what llama.cpp fixes per architecture with no key (layout, Gemma 3, SmolLM3).
- `read`: `open_gguf`, `gguf_config` (config from metadata), `read_gguf` (the tensors).
- `write`: `gguf_refusal` and `write_gguf`.
- `tokenizer`: GGUF tokenizer metadata <-> Hugging Face fast tokenizer.
"""

from jaxsft.models.gguf.read import gguf_config, open_gguf, read_gguf
from jaxsft.models.gguf.tokenizer import TokenizerNotConvertible, gguf_tokenizer_fields, tokenizer_from_gguf
from jaxsft.models.gguf.write import gguf_refusal, write_gguf

__all__ = ["TokenizerNotConvertible", "gguf_config", "gguf_refusal", "gguf_tokenizer_fields", "open_gguf",
           "read_gguf", "tokenizer_from_gguf", "write_gguf"]
