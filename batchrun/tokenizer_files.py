"""Reading a tokenizer directory's JSON and text files, each failure a TokenizerError naming the file or key."""
from __future__ import annotations

import json
import os
from typing import Any, Optional

from tokenizers import AddedToken

from batchrun.chat_template import TokenizerError


def read_json(path: str, required: bool = False) -> Optional[dict]:
    if not os.path.exists(path):
        if required:
            raise TokenizerError(f"{path}: missing")
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: cannot read ({e})") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def added_token(value: Any, where: str) -> Optional[AddedToken]:
    """tokenizer_config special token: a string or an AddedToken dict ({"content": ..., "lstrip": ...})."""
    if value is None:
        return None
    if isinstance(value, str):
        return AddedToken(value, special=True, normalized=False)
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return AddedToken(value["content"], single_word=bool(value.get("single_word", False)),
                          lstrip=bool(value.get("lstrip", False)), rstrip=bool(value.get("rstrip", False)),
                          normalized=bool(value.get("normalized", False)), special=True)
    raise TokenizerError(f"{where}: expected a string or an AddedToken object with 'content', got {value!r}")


def ids_of(value: Any, where: str) -> list[int]:
    if value is None:
        return []
    if isinstance(value, bool) or not isinstance(value, (int, list)):
        raise TokenizerError(f"{where}: expected an int or a list of ints, got {value!r}")
    values = value if isinstance(value, list) else [value]
    if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise TokenizerError(f"{where}: expected an int or a list of ints, got {value!r}")
    return values


def read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: cannot read ({e})") from e
