"""One parsed GGUF file per process: the tokenizer (gguf_tokenizer.py) and the model loader (models/gguf.py)
read the same file's header, and parsing a real model's vocabulary (SmolLM2's 49k tokens and merges) takes
seconds, so they share one GGUFReader while the file is unchanged. Needs only the `gguf` package (no torch).
"""
from __future__ import annotations

import functools
import os


def shared_reader(file: str):
    """The GGUFReader of `file`, parsed once while its size and mtime stay the same. Raises what os.stat or
    GGUFReader raise (callers word it as their own error)."""
    st = os.stat(file)
    return cached_reader(file, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def cached_reader(file: str, size: int, mtime_ns: int):
    """GGUFReader(file, "r"), cached by (file, size, mtime_ns); a failure is not cached."""
    import gguf
    return gguf.GGUFReader(file, "r")
