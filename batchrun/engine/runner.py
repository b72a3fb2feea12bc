"""ModelRunner: owns the model weights and the KV tensors, turns a SchedulerOutput into one forward pass.

A batch is flat: T tokens of B sequences, decodes (one query token) first, then prefill chunks.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import math
import mmap
import os
import time

import numpy as np
import torch

from batchrun.kernels.kv_quant import bytes_view, kv_dtype
from batchrun.models.attention import AttentionMetadata, TorchAttentionBackend
from batchrun.engine.config import EngineConfig, default_threads
from batchrun.engine.kv_cache import blocks_needed
from batchrun.engine.sampler import sample, verify_sampled
from batchrun.engine.scheduler import ScheduledSeq, SchedulerOutput
from batchrun.models.cpu_fused import fused_ops_supported, use_fused_layer_ops
from batchrun.models.cpu_linear import PACKED_LINEAR_ENV, pack_linear_weights, packing_supported
from batchrun.models.llama import LlamaModel
from batchrun.models.loader import ModelError, ModelInfo, load_weights
from batchrun.models.quant import apply_quantization, check_quantization, kernels_enabled

log = logging.getLogger("batchrun")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor in host memory that costs no RSS until written: an anonymous mmap (the kernel maps a
    page on first touch, zero-filled). torch.zeros would write, hence page in, every byte up front;
    torch.empty would leave whatever the allocator reused, and a never-written KV slot must read as a
    finite number (attention multiplies masked positions by a zero probability)."""
    count = math.prod(shape)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, max(nbytes, 1))
    return torch.frombuffer(buf, dtype=dtype, count=count).view(shape)   # the tensor keeps buf alive


def apply_threads(config: EngineConfig) -> int:
    """torch.set_num_threads(config.threads or the machine's cores); returns the count."""
    n = config.threads if config.threads is not None else default_threads()
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


class ModelRunner:
    def __init__(self, config: EngineConfig, info: ModelInfo, max_model_len: int):
        self.config = config
        self.device = resolve_device(config.device)
        self.threads = apply_threads(config)
        self.dtype = info.torch_dtype(config.dtype)
        self.kv_dtype = kv_dtype(config.kv_cache_dtype, self.dtype)     # float8 with kv_cache_dtype fp8
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        per_seq = blocks_needed(max_model_len, self.block_size)
        if config.kv_cache_memory is not None:        # refuse before any weight is read
            self._check_fits_one_sequence(int(config.kv_cache_memory), info.kv_bytes_per_token(self.kv_dtype), per_seq,
                                          max_model_len)
        self.quantization = config.quantization
        try:
            check_quantization(config.quantization, config.quantization_group_size, info, self.device)
        except ValueError as e:
            raise ModelError(str(e)) from e
        with torch.device("meta"), _default_dtype(self.dtype):
            model = LlamaModel(info.args, max_model_len, device=self.device)
        model.to_empty(device=self.device)
        load_weights(model, info)
        self.model = model.eval()
        quant_bytes = 0
        if self.quantization:      # weight-only int8/int4 linear layers (models/quant.py)
            quant_bytes = apply_quantization(model, info, self.quantization, config.quantization_group_size,
                                             config.quantize_lm_head, self.dtype)
        self.quantized_bytes = quant_bytes
        self.weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) + quant_bytes
        self.backend = self._select_backend()
        self.default_generator = torch.Generator(device=self.device).manual_seed(config.seed)

        attn = model.layers[0].self_attn
        self.kv_bytes_per_token = info.kv_bytes_per_token(self.kv_dtype)
        block_bytes = self.kv_bytes_per_token * self.block_size
        # more blocks than max_num_seqs full-length sequences can ever use is wasted memory
        useful = config.max_num_seqs * per_seq
        budget = self._kv_budget(useful * block_bytes)
        self._check_fits_one_sequence(budget, self.kv_bytes_per_token, per_seq, max_model_len)
        self.num_blocks = int(min(budget // block_bytes, useful))
        shape = (info.num_layers, 2, self.num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim)
        if self.device.type == "cpu":
            self.kv_caches = lazy_zeros(shape, self.kv_dtype)   # paged in as blocks are first used
        else:
            self.kv_caches = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        # host pool for swapped-out blocks: pinned on CUDA so copies run asynchronously. None of it on CPU
        # unless swap_space is set explicitly: there the device is the host, and preemption recomputes.
        host_blocks = 0
        if config.preemption_mode == "swap" and config.swap_space:
            host_blocks = min(int(config.swap_space * 2**30) // block_bytes, useful)
        self.num_host_blocks = host_blocks
        self.host_kv = None
        if host_blocks:
            host_shape = (*shape[:2], host_blocks, *shape[3:])
            if self.device.type == "cuda":
                self.host_kv = torch.empty(host_shape, dtype=self.kv_dtype, device="cpu", pin_memory=True)
            else:
                self.host_kv = lazy_zeros(host_shape, self.kv_dtype)

        self.forward_s = 0.0          # model forward + logits, summed over steps (host overhead = step - this)
        self._bufs_cap = (0, 0, 0)
        self._h2d_done = None
        self.compiled = bool(config.compile and not config.enforce_eager and self.device.type == "cpu"
                             and not self.quantization)     # dynamo would trace the quantized weights' objects
        if self.compiled:
            self.model.compile_dense()
        # bf16 projections through oneDNN's packed layout (models/cpu_linear.py); off under torch.compile
        self.packed_linear = (self.device.type == "cpu" and not self.compiled and packing_supported(self.dtype)
                              and os.environ.get(PACKED_LINEAR_ENV, "1") != "0")
        self.packed_extra_bytes = pack_linear_weights(model, config.max_num_seqs) if self.packed_linear else 0
        # norms, RoPE and SwiGLU's activation as one compiled op each (models/cpu_fused.py); eager CPU only
        self.fused_layer_ops = not self.compiled and fused_ops_supported(self.device, self.dtype)
        if self.fused_layer_ops:
            use_fused_layer_ops(model)

        self.graphs = None
        if self.device.type == "cuda" and not config.enforce_eager and self.backend.name == "triton":
            from batchrun.engine.cuda_graphs import DecodeGraphs
            self.graphs = DecodeGraphs(self, config.max_num_seqs)

    def _select_backend(self):
        choice = self.config.attention_backend
        if choice == "auto":
            choice = "triton" if self.device.type == "cuda" else "torch"
        if choice == "triton":
            from batchrun.models.attention import TritonAttentionBackend
            return TritonAttentionBackend()
        return TorchAttentionBackend()

    def _kv_budget(self, useful_bytes: int) -> int:
        if self.config.kv_cache_memory is not None:
            return int(self.config.kv_cache_memory)
        if self.device.type == "cuda":
            return self._cuda_kv_budget()
        # CPU: what the job can use, at most half the RAM available now (the weights are loaded already).
        # Untouched pages cost nothing, so a large cap only bounds how far the working set may grow.
        return int(min(useful_bytes, 0.5 * _available_host_memory()))

    def _check_fits_one_sequence(self, budget: int, kv_bytes_per_token: int, per_seq: int, max_model_len: int) -> None:
        """A cache that cannot hold one sequence of max_model_len is a bad setting, refused at start."""
        block_bytes = kv_bytes_per_token * self.block_size
        blocks = budget // block_bytes
        if blocks < per_seq:
            knob, source = self._budget_knob()
            raise ModelError(
                f"{knob}: the KV cache holds {blocks} blocks of {self.block_size} tokens ({budget} bytes, "
                f"{source}), fewer than one sequence of max_model_len={max_model_len} needs ({per_seq} blocks, "
                f"{per_seq * block_bytes} bytes); raise {knob} or lower max_model_len")

    def _budget_knob(self) -> tuple[str, str]:
        """(the knob that sets the KV budget, where this budget came from)."""
        if self.config.kv_cache_memory is not None:
            return "kv_cache_memory", f"kv_cache_memory={self.config.kv_cache_memory}"
        if self.device.type == "cuda":
            return "gpu_memory_utilization", f"gpu_memory_utilization={self.config.gpu_memory_utilization}"
        return "kv_cache_memory", "default: half the available RAM"

    @torch.inference_mode()
    def _cuda_kv_budget(self) -> int:
        """gpu_memory_utilization x total, less what the weights and the peak activations of the largest
        step (a profiling forward of max_num_batched_tokens tokens) use, less other processes' memory."""
        cfg = self.config
        free0, total = torch.cuda.mem_get_info(self.device)
        others = total - free0 - torch.cuda.memory_reserved(self.device)
        T = min(cfg.max_num_batched_tokens, cfg.max_num_seqs * self.max_model_len)
        seqs = [min(self.max_model_len, T - i) for i in range(0, T, self.max_model_len)]
        attn = self.model.layers[0].self_attn
        nblk = sum(blocks_needed(n, self.block_size) for n in seqs)
        kv = torch.zeros((len(self.model.layers), 2, nblk, self.block_size, attn.num_kv_heads, attn.head_dim),
                         dtype=self.kv_dtype, device=self.device)
        tables, slots, qsl, start = [], [], [0], 0
        width = max(blocks_needed(n, self.block_size) for n in seqs)
        for n in seqs:
            b = blocks_needed(n, self.block_size)
            tables.append(list(range(start, start + b)) + [0] * (width - b))
            slots.extend(range(start * self.block_size, start * self.block_size + n))
            qsl.append(qsl[-1] + n)
            start += b
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=dev), query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seqs, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev), num_decodes=0,
            max_query_len=max(seqs), max_seq_len=max(seqs), query_start_loc_host=qsl, seq_lens_host=seqs)
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        ids = torch.zeros(T, dtype=torch.long, device=dev)
        pos = torch.cat([torch.arange(n, device=dev) for n in seqs])
        h = self.model(ids, pos, kv, meta, self.backend)
        self.model.compute_logits(h[:min(T, cfg.max_num_seqs)])
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - kv.numel() * kv.element_size()
        del kv, h
        torch.cuda.empty_cache()
        budget = int(total * cfg.gpu_memory_utilization) - peak - others
        log.info("profiled step of %d tokens: peak %.2f GiB with weights; KV budget %.2f GiB",
                 T, peak / 2**30, budget / 2**30)
        return max(0, budget)

    @property
    def memory_ledger(self) -> dict:
        kv_tokens = self.num_blocks * self.block_size
        return {
            "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
            "weights_bytes": self.weights_bytes,
            "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "block_size": self.block_size, "num_blocks": self.num_blocks, "kv_tokens": kv_tokens,
            "kv_bytes": kv_tokens * self.kv_bytes_per_token,
            "max_model_len": self.max_model_len,
            "max_concurrency_at_max_model_len": round(kv_tokens / self.max_model_len, 2),
            "host_swap_blocks": self.num_host_blocks,
            "host_swap_bytes": self.num_host_blocks * self.block_size * self.kv_bytes_per_token,
            "threads": self.threads,
            "compiled": self.compiled,
            "packed_linear": self.packed_linear, "packed_extra_bytes": self.packed_extra_bytes,
            "fused_layer_ops": self.fused_layer_ops,
            "quantization": self.quantization, "quantized_bytes": self.quantized_bytes,
            "quant_kernels": bool(self.quantization) and kernels_enabled(),
        }

    def _buffers(self, T: int, B: int, W: int) -> None:
        """Host staging buffers reused across steps (pinned on CUDA), grown when a step needs more."""
        t0, b0, w0 = self._bufs_cap
        if T <= t0 and B <= b0 and B * W <= w0:
            return
        T, B = max(T, t0, self.config.max_num_batched_tokens), max(B, b0, self.config.max_num_seqs)
        W = max(B * W, w0, B * blocks_needed(min(self.max_model_len, 1024), self.block_size))
        pin = self.device.type == "cuda"

        def buf(n, dtype):
            return torch.empty(n, dtype=dtype, pin_memory=pin).numpy()
        self._ids, self._pos, self._slots = buf(T, torch.int64), buf(T, torch.int64), buf(T, torch.int64)
        self._qsl, self._lens = buf(B + 1, torch.int32), buf(B, torch.int32)
        self._tables = buf(W, torch.int32)
        self._arange = np.arange(max(T, B, W), dtype=np.int64)
        self._bufs_cap = (T, B, W)

    def _prepare(self, entries: list[ScheduledSeq]):
        """Flat inputs and attention metadata of one step: one Python pass over the entries to read them,
        then vectorised numpy into reused buffers (zero-copy torch views on CPU)."""
        bs = self.block_size
        B = len(entries)
        starts, ns, tables_in, ids_in = [], [], [], []
        plain = True                                   # every entry one token, no draft: a decode step
        for e in entries:
            seq, n = e.seq, e.num_new_tokens
            start = seq.num_computed_tokens
            starts.append(start)
            ns.append(n)
            tables_in.append(seq.block_table)
            if e.draft:
                ids_in.append(seq.token_ids[start:start + n - len(e.draft)])
                ids_in.append(e.draft)
                plain = False
            else:
                ids_in.append(seq.token_ids[start:start + n])
                plain = plain and n == 1
        start_a = np.array(starts, dtype=np.int64)
        n_a = np.array(ns, dtype=np.int64)
        T = B if plain else int(n_a.sum())
        bt_lens = np.fromiter(map(len, tables_in), dtype=np.int64, count=B)
        W = int(bt_lens.max())
        if self.device.type == "cuda" and self._h2d_done is not None:
            self._h2d_done.synchronize()               # last step's copies out of the staging buffers are done
        self._buffers(T, B, W)
        ar = self._arange
        ids = self._ids[:T]
        ids[:] = np.fromiter(itertools.chain.from_iterable(ids_in), dtype=np.int64, count=T)
        lens = self._lens[:B]
        np.add(start_a, n_a, out=lens, casting="unsafe")
        qsl = self._qsl[:B + 1]
        qsl[0] = 0
        qsl[1:] = np.cumsum(n_a)
        tables = self._tables[:B * W].reshape(B, W)
        tables.fill(0)
        tables[ar[:W][None, :] < bt_lens[:, None]] = np.fromiter(
            itertools.chain.from_iterable(tables_in), dtype=np.int32, count=int(bt_lens.sum()))
        pos = self._pos[:T]
        if plain:
            pos[:] = start_a
            rows = ar[:B]
        else:       # token t of entry i sits at position start_i + (t - qsl_i)
            rows = np.repeat(ar[:B], n_a)
            np.add(np.repeat(start_a - qsl[:-1], n_a), ar[:T], out=pos)
        slots = self._slots[:T]
        np.add(tables[rows, pos // bs].astype(np.int64) * bs, pos % bs, out=slots)
        qsl_host, lens_host = qsl.tolist(), lens.tolist()
        meta = AttentionMetadata(
            slot_mapping=self._to_device(slots), query_start_loc=self._to_device(qsl),
            seq_lens=self._to_device(lens), block_tables=self._to_device(tables),
            num_decodes=B if plain else int((n_a == 1).sum()),
            max_query_len=1 if plain else int(n_a.max()),
            max_seq_len=max(lens_host), query_start_loc_host=qsl_host, seq_lens_host=lens_host)
        input_ids, pos_t = self._to_device(ids), self._to_device(pos)
        if self.device.type == "cuda":
            self._h2d_done = torch.cuda.Event()
            self._h2d_done.record()
        return input_ids, pos_t, meta

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        if self.device.type == "cuda":   # from the pinned staging buffer: the copy overlaps; no sync here
            return t.to(self.device, non_blocking=True)
        return t

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Batched block copies, one gather/scatter per direction.

        In before out: the scheduler swaps in before it preempts, so a host block freed by a swap-in
        may be reused by a swap-out (and a just-swapped-in sequence may be swapped out again).
        Both run before the forward, which may write the device blocks a swap-out freed.
        """
        if swap_in:
            host = torch.tensor([h for h, _ in swap_in])
            dev = torch.tensor([d for _, d in swap_in], device=self.device)
            # raw bytes (a float8 cache has no index_copy_): the copy is exact whatever the dtype
            blocks = bytes_view(self.host_kv).index_select(2, host).to(self.device, non_blocking=True)
            bytes_view(self.kv_caches).index_copy_(2, dev, blocks)
        if swap_out:
            dev = torch.tensor([d for d, _ in swap_out], device=self.device)
            host = torch.tensor([h for _, h in swap_out])
            bytes_view(self.host_kv).index_copy_(2, host, bytes_view(self.kv_caches).index_select(2, dev).to("cpu"))

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> list[tuple[ScheduledSeq, list[int]]]:
        """Run one step; returns (entry, new tokens) for each entry that reaches its sequence's end.

        Without a draft an entry gets one token; with d draft tokens it gets the accepted drafts plus
        the model's own next token (1 to d + 1 tokens).
        """
        if out.swap_out or out.swap_in:
            self.swap(out.swap_out, out.swap_in)
        if not out.scheduled:
            return []
        entries = sorted(out.scheduled, key=lambda e: e.num_new_tokens != 1)  # stable: decodes first
        input_ids, positions, meta = self._prepare(entries)
        plain_step = meta.num_decodes == len(entries)     # one token each, no draft
        t0 = time.perf_counter()
        if self.graphs is not None and self.graphs.can_run(meta):
            hidden = self.graphs.run(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
        self.forward_s += time.perf_counter() - t0
        if plain_step and all(e.samples and e.seq.params.greedy for e in entries):
            # a pure greedy decode step: every row samples, no gather, argmax in the model's dtype (exact:
            # the float32 upcast changes no value, so no order or tie)
            t0 = time.perf_counter()
            logits = self.model.compute_logits(hidden, upcast=False)
            self.forward_s += time.perf_counter() - t0
            # max(dim).indices: the first maximal index, as argmax, and 2-3x faster than argmax in bf16 on CPU
            return [(e, [t]) for e, t in zip(entries, logits.max(dim=-1).indices.tolist())]
        sampling = [i for i, e in enumerate(entries) if e.samples]
        if not sampling:
            return []
        # rows to score: the last token of each sampling entry, plus one per draft token
        qsl = meta.query_start_loc_host
        rows = [r for i in sampling for r in range(qsl[i + 1] - 1 - len(entries[i].draft), qsl[i + 1])]
        t0 = time.perf_counter()
        h = hidden if len(rows) == hidden.shape[0] else hidden[torch.tensor(rows, device=self.device)]
        logits = self.model.compute_logits(h)
        self.forward_s += time.perf_counter() - t0
        plain = [i for i in sampling if not entries[i].draft]
        spec = [i for i in sampling if entries[i].draft]
        result: dict[int, list[int]] = {}
        row_of, r = {}, 0
        for i in sampling:
            row_of[i] = r
            r += 1 + len(entries[i].draft)
        if plain:
            seqs = [entries[i].seq for i in plain]
            sub = logits if len(plain) == logits.shape[0] else \
                logits[torch.tensor([row_of[i] for i in plain], device=self.device)]
            tokens = sample(sub, [s.params for s in seqs], [s.generator for s in seqs],
                            self.default_generator).tolist()   # the step's one host sync without drafts
            result.update({i: [t] for i, t in zip(plain, tokens)})
        if spec:
            greedy = [i for i in spec if entries[i].seq.params.greedy]
            if greedy:
                argmax = logits.argmax(dim=-1).tolist()
                for i in greedy:
                    draft, r0 = entries[i].draft, row_of[i]
                    a = 0
                    while a < len(draft) and draft[a] == argmax[r0 + a]:
                        a += 1
                    result[i] = draft[:a] + [argmax[r0 + a]]
            for i in spec:
                if i not in result:
                    seq, r0 = entries[i].seq, row_of[i]
                    result[i] = verify_sampled(logits[r0:r0 + 1 + len(entries[i].draft)], entries[i].draft,
                                               seq.params, seq.generator or self.default_generator)
        return [(entries[i], result[i]) for i in sampling]

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)
