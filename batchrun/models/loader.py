"""Reads a model: an HF directory (config.json checks before any weight is touched, safetensors loading) or a
GGUF file (models/gguf.py, which maps its tensors to HF names and dequantises them). What both formats share
(ModelError, ModelInfo, model_args) lives in models/model_info.py and is re-exported here.

HF tensor names are mapped onto models/llama.py's fused layout: q/k/v -> qkv_proj, gate/up -> gate_up_proj.
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from batchrun.models.args import SUPPORTED_ARCHITECTURES, ConfigError, ModelArgs  # noqa: F401 (re-exported)
from batchrun.models.model_info import DTYPES, ModelError, ModelInfo, model_args  # noqa: F401 (re-exported)
from batchrun.models.model_info import fused_name as _fused_name

if TYPE_CHECKING:    # torch loads with the weights: inspect_model (a plan, `validate`, a refused submit) needs none
    import torch


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ModelError(f"{path}: not valid JSON ({e})") from e
    except UnicodeDecodeError as e:
        raise ModelError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from e
    if not isinstance(data, dict):
        raise ModelError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


@contextmanager
def _safetensors(file: str, framework: str = "pt"):
    """safe_open(file), its failures (a header cut short, offsets past the end of the file) a ModelError
    naming the file, and the tensor when the failure is in one. framework "numpy": headers only, no torch."""
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(file, framework=framework) as sf:
            yield sf
    except SafetensorError as e:
        raise ModelError(f"{file}: not a readable safetensors file, truncated or corrupt ({e})") from e


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelError(f"{index}: no 'weight_map'")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.exists(os.path.join(path, f))]
        if missing:
            raise ModelError(f"{index} names shards that are missing: {', '.join(missing)}")
        return [os.path.join(path, f) for f in files]
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    shards = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if shards:
        return [os.path.join(path, f) for f in shards]
    pickles = sorted(f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth", ".ckpt")))
    if pickles:
        raise ModelError(
            f"{path}: only pickle checkpoints found ({', '.join(pickles)}); batchrun loads safetensors only, "
            "because pickle files can run arbitrary code. Convert with transformers: "
            "model.save_pretrained(dir, safe_serialization=True)")
    raise ModelError(f"{path}: no *.safetensors weights found")


_ST_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
             "U16": 2}   # everything else (I8, U8, BOOL, F8_*) is one byte


def _scan_safetensors(files: list[str]) -> tuple[int, dict[str, tuple[int, int]]]:
    """(parameter count, on-disk dtype -> (tensors, bytes)) from the safetensors headers alone."""
    total, types = 0, {}
    for f in files:
        with _safetensors(f, "numpy") as sf:  # reads the header only
            for name in sf.keys():
                sl = sf.get_slice(name)
                n = 1
                for d in sl.get_shape():
                    n *= d
                total += n
                kind = sl.get_dtype()
                count, nbytes = types.get(kind, (0, 0))
                types[kind] = (count + 1, nbytes + n * _ST_BYTES.get(kind, 1))
    return total, types


def find_gguf(path: str) -> Optional[str]:
    """The GGUF file `path` stands for: a `.gguf` file itself, or the one `*.gguf` in a directory that has
    no config.json; None for anything else (an HF directory, a missing path)."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return path if path.lower().endswith(".gguf") else None
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, "config.json")):
        return None
    found = sorted(f for f in os.listdir(path) if f.lower().endswith(".gguf"))
    if len(found) > 1:
        raise ModelError(f"{path}: holds several GGUF files ({', '.join(found)}); name one in model.path")
    return os.path.join(path, found[0]) if found else None


def inspect_model(path: str) -> ModelInfo:
    """Validate a model from its metadata alone (no weight is read): an HF directory's config.json and
    safetensors headers, or a GGUF file's header (models/gguf.py)."""
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        from batchrun.models.gguf import inspect_gguf
        return inspect_gguf(gguf_file)
    if not os.path.isdir(path):
        raise ModelError(f"model path {path!r} is not a directory")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise ModelError(f"{cfg_path}: missing (an HF model directory needs config.json)")
    cfg = _read_json(cfg_path)
    args = model_args(cfg, cfg_path)
    files = _weight_files(path)
    num_params, types = _scan_safetensors(files)
    return ModelInfo(
        path=path, architecture=ModelArgs.hf_architecture(cfg), config=cfg, weight_files=files,
        num_params=num_params, weights_bytes=sum(os.path.getsize(f) for f in files),
        max_model_len=int(cfg.get("max_position_embeddings") or 2048), args=args, tensor_types=types)


# HF name -> (dim, start, length) of the part to read, or None for all of it (models/tp.py's weight_slice)
Slicer = Callable[[str], Optional[tuple[int, int, int]]]


def _read_slice(sf, name: str, part: Optional[tuple[int, int, int]]) -> torch.Tensor:
    if part is None:
        return sf.get_tensor(name)
    dim, start, length = part
    index = (slice(None),) * dim + (slice(start, start + length),)
    return sf.get_slice(name)[index]         # reads only those bytes


def iter_weights(info: ModelInfo, slicer: Optional[Slicer] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every weight on disk: safetensors as stored, GGUF dequantised to float32; with
    a slicer, the part of each tensor it names (read alone from safetensors; a GGUF tensor is dequantised
    whole, then cut: its blocks run along the dim a row-parallel slice cuts)."""
    if info.format == "gguf":
        from batchrun.models.gguf import iter_gguf_weights
        for name, tensor in iter_gguf_weights(info):
            part = slicer(name) if slicer else None
            yield name, tensor if part is None else tensor.narrow(*part).contiguous()
        return
    for f in info.weight_files:
        with _safetensors(f) as sf:
            for name in sf.keys():
                try:
                    tensor = _read_slice(sf, name, slicer(name) if slicer else None)
                except Exception as e:   # noqa: BLE001 - safetensors raises several types on bad bytes
                    raise ModelError(f"{f}: tensor {name!r} cannot be read ({type(e).__name__}: {e})") from e
                yield name, tensor


def load_weights(model: torch.nn.Module, info: ModelInfo, slicer: Optional[Slicer] = None) -> None:
    """Copy the weights into `model` (already built on its device and dtype), fusing q/k/v and gate/up;
    each tensor is cast to the model's dtype as it is copied. A tensor-parallel shard passes the slicer
    that names its part of each tensor (models/tp.py)."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    source = "the GGUF metadata" if info.format == "gguf" else "config.json"
    for hf_name, tensor in iter_weights(info, slicer):
        if "rotary_emb.inv_freq" in hf_name:
            continue
        name, shard = _fused_name(hf_name)
        if name == "lm_head.weight" and model.tie_word_embeddings:
            continue  # tied: the head reads embed_tokens
        if name not in params:
            raise ModelError(f"{info.path}: unexpected tensor {hf_name!r} for {info.architecture}")
        param = params[name]
        if shard is None:
            dst = param.data
        else:
            dst = param.data.narrow(0, *model.shard_range(name, shard))
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ModelError(f"{info.path}: tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(dst.shape)} from {source}")
        dst.copy_(tensor)
        loaded.add(f"{name}#{shard}")
    expected = set()
    for name in params:
        shards = model.num_shards(name)
        expected.update({f"{name}#{i}" for i in range(shards)} if shards else {f"{name}#None"})
    missing = sorted(expected - loaded)
    if missing:
        raise ModelError(f"{info.path}: weights missing from the checkpoint: {', '.join(missing[:5])}"
                         + (" ..." if len(missing) > 5 else ""))
