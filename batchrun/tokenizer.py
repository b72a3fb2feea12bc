"""The tokenizer of a model path, whatever its format: `load_tokenizer` picks an HF directory's tokenizer.json
(Tokenizer.from_dir) or a GGUF file's metadata (gguf_tokenizer.py).

The Tokenizer class lives in tokenizer_base.py, which both loaders build on, so imports run one way:
tokenizer -> gguf_tokenizer -> tokenizer_base. Tokenizer and TokenizerError are re-exported here.
"""
from __future__ import annotations

from batchrun.chat_template import TokenizerError  # noqa: F401 (re-exported)
from batchrun.gguf_tokenizer import tokenizer_from_gguf
from batchrun.tokenizer_base import SPECIAL_TOKEN_NAMES, Tokenizer  # noqa: F401 (re-exported)


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer of a model path: an HF directory (Tokenizer.from_dir) or a GGUF file's metadata."""
    from batchrun.models.loader import find_gguf
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        return tokenizer_from_gguf(gguf_file)
    return Tokenizer.from_dir(path)
