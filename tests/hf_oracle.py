"""transformers' float32 model of a GGUF file (the parity oracle), converted once per machine and cached.

`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` dequantises the whole file with gguf-py each time
(SmolLM2-135M: ~30 s on 2 AVX-512 cores, ~87 s on an AVX2-only Zen 1). The first session that needs it
saves that model with `save_pretrained` (float32 safetensors) into $XDG_CACHE_HOME/batchrun/test_oracles
(else ~/.cache/...), in a folder keyed by the file's name, size and mtime and the transformers and gguf
versions; every session, that one included, then loads the saved folder with `from_pretrained`. The oracle
stays transformers' own model, converted by transformers from the same file: only the repeated
dequantisation is saved. Converters serialise on a file lock (which dies with its process), so concurrent
sessions and xdist workers convert once; a folder appears whole (renamed into place) or not at all, and a
new conversion removes the same file's older ones.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import tempfile
import warnings
from importlib.metadata import version

DONE = "converted"     # written last, inside the folder before it is renamed into place


def cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "batchrun", "test_oracles")


def oracle_dir(gguf_path: str) -> str:
    """The cache folder of this file as these transformers and gguf versions convert it."""
    st = os.stat(gguf_path)
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    key = repr((stem, st.st_size, st.st_mtime_ns, version("transformers"), version("gguf")))
    return os.path.join(cache_root(), f"{stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}")


def _stem(folder: str) -> str:
    return os.path.basename(folder).rsplit("-", 1)[0]


def _convert(gguf_path: str, out: str, parse_context) -> None:
    import torch
    import transformers as tf
    root = os.path.dirname(out)
    tmp = tempfile.mkdtemp(dir=root, prefix=".converting-")
    try:
        folder, name = os.path.split(gguf_path)
        with warnings.catch_warnings(), parse_context():
            warnings.simplefilter("ignore")
            hf = tf.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        kinds = {t.dtype for t in hf.state_dict().values()}
        assert kinds == {torch.float32}, f"{gguf_path}: transformers kept {kinds} tensors, not float32 ones"
        # the weights are dequantised into plain float32 modules; transformers still tags the model as
        # GGUF-quantized, and refuses to save such a model, so the tag goes
        hf.hf_quantizer = None
        del hf.config.quantization_config
        hf.save_pretrained(tmp)
        open(os.path.join(tmp, DONE), "w").close()
        stem = _stem(out)
        for old in os.listdir(root):     # this file's conversions by other versions, or of an older copy
            if not old.endswith(".lock") and _stem(old) == stem:
                shutil.rmtree(os.path.join(root, old), ignore_errors=True)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def hf_model_of_gguf(gguf_path: str, parse_context=contextlib.nullcontext):
    """transformers' float32 model of `gguf_path`, eval mode, from the cached conversion (made first if
    missing). parse_context: a context manager the conversion runs in (conftest's gguf_parsed_once)."""
    import torch
    import transformers as tf
    out = oracle_dir(gguf_path)
    if not os.path.exists(os.path.join(out, DONE)):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(os.path.join(os.path.dirname(out), _stem(out) + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not os.path.exists(os.path.join(out, DONE)):     # else converted while we waited
                _convert(gguf_path, out, parse_context)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
