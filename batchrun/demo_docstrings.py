"""Real text for the demo: prose paragraphs from the Python standard library's docstrings.

Every machine that runs batchrun has them. The source files are parsed with `ast`, never imported, so
collecting them runs no module code. The selection is deterministic for a given Python version.
"""
from __future__ import annotations

import ast
import collections
import os
import sysconfig

# paragraphs that read as prose: long enough to summarise, short enough for a quick demo
MIN_CHARS, MAX_CHARS = 250, 900
_SKIP_DIRS = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "site-packages",
              "pydoc_data", "__pycache__", "venv"}


def _source_files(root: str) -> list[str]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return files


# the nodes that can hold a def or class: ast.walk's breadth-first order restricted to them is the same
# order for those (a statement's ancestors are all of these), without visiting the expressions (~25% faster)
_BLOCKS = (ast.stmt, ast.excepthandler, ast.match_case)


def _docstrings(tree: ast.AST):
    todo = collections.deque([tree])
    while todo:
        node = todo.popleft()
        todo.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, _BLOCKS))
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                yield getattr(node, "name", ""), doc


def _is_prose(block: str, text: str) -> bool:
    lines = block.splitlines()
    if any(line.startswith((" ", "\t", ">>>", "-", "*", "+", "|", "=", "..")) for line in lines):
        return False   # code, doctests, lists, tables, reST directives
    if ":" in text[:40] or text.count("(") > 6 or not text[0].isupper() or not text.endswith("."):
        return False
    return MIN_CHARS <= len(text) <= MAX_CHARS


def stdlib_docstrings():
    """Yield (module, object name or "", docstring) for every module, class and function of the stdlib,
    in a deterministic order (ast-parsed, never imported; files that do not parse are skipped)."""
    root = sysconfig.get_paths()["stdlib"]
    for path in _source_files(root):
        try:
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        module = os.path.relpath(path, root)[:-3].replace(os.sep, ".").removesuffix(".__init__")
        for name, doc in _docstrings(tree):
            yield module, name, doc


def stdlib_paragraphs(limit: int = 300) -> list[dict]:
    """Up to `limit` distinct prose paragraphs: [{"module": "json.decoder", "object": "...", "text": ...}]."""
    out, seen = [], set()
    for module, name, doc in stdlib_docstrings():
        for block in doc.split("\n\n"):
            text = " ".join(block.split())
            if text in seen or not text or not _is_prose(block, text):
                continue
            seen.add(text)
            out.append({"module": module, "object": name or module, "text": text})
    # spread the sample over the whole library instead of the first modules alphabetically
    step = max(1, len(out) // limit)
    return out[::step][:limit]
