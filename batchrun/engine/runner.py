"""ModelRunner: owns the model weights and the KV tensors, turns a SchedulerOutput into one forward pass.

A batch is flat: T tokens of B sequences, decodes (one query token) first, then prefill chunks.
"""
from __future__ import annotations

import contextlib
import logging
import os

import numpy as np
import torch

from batchrun.engine.attention import AttentionMetadata, TorchAttentionBackend
from batchrun.engine.config import EngineConfig
from batchrun.engine.kv_cache import blocks_needed
from batchrun.engine.sampler import sample, verify_sampled
from batchrun.engine.scheduler import ScheduledSeq, SchedulerOutput
from batchrun.models.llama import LlamaModel
from batchrun.models.loader import ModelError, ModelInfo, load_weights
from batchrun.models.rope import cos_sin_cache, rope_params

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


class ModelRunner:
    def __init__(self, config: EngineConfig, info: ModelInfo, max_model_len: int):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = info.torch_dtype(config.dtype)
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        try:
            params = rope_params(info.config)
        except ValueError as e:
            raise ModelError(f"{info.path}/{e}") from e
        arch = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}[info.architecture]
        with torch.device("meta"), _default_dtype(self.dtype):
            model = LlamaModel(dict(info.config), arch, max_model_len)
        model.to_empty(device=self.device)
        model.cos_sin = cos_sin_cache(model.layers[0].self_attn.head_dim, params, max_model_len).to(self.device)
        load_weights(model, info)
        self.model = model.eval()
        self.weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.backend = self._select_backend()
        self.default_generator = torch.Generator(device=self.device).manual_seed(config.seed)

        attn = model.layers[0].self_attn
        self.kv_bytes_per_token = info.kv_bytes_per_token(self.dtype)
        budget = self._kv_budget()
        num_blocks = budget // (self.kv_bytes_per_token * self.block_size)
        # more blocks than max_num_seqs full-length sequences can ever use is wasted memory
        useful = config.max_num_seqs * blocks_needed(max_model_len, self.block_size)
        self.num_blocks = int(min(num_blocks, useful))
        if self.num_blocks < 1:
            raise ModelError(f"KV cache budget of {budget} bytes holds no block of "
                             f"{self.kv_bytes_per_token * self.block_size} bytes; raise kv_cache_memory")
        shape = (info.num_layers, 2, self.num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim)
        self.kv_caches = torch.zeros(shape, dtype=self.dtype, device=self.device)
        # host pool for swapped-out blocks: pinned on CUDA so copies run asynchronously
        host_blocks = 0
        if config.preemption_mode == "swap":
            host_blocks = int(config.swap_space * 2**30) // (self.kv_bytes_per_token * self.block_size)
            host_blocks = min(host_blocks, useful)
        self.num_host_blocks = host_blocks
        self.host_kv = None
        if host_blocks:
            pin = self.device.type == "cuda"
            self.host_kv = torch.zeros((*shape[:2], host_blocks, *shape[3:]), dtype=self.dtype,
                                       device="cpu", pin_memory=pin)

        self.graphs = None
        if self.device.type == "cuda" and not config.enforce_eager and self.backend.name == "triton":
            from batchrun.engine.cuda_graphs import DecodeGraphs
            self.graphs = DecodeGraphs(self, config.max_num_seqs)

    def _select_backend(self):
        choice = self.config.attention_backend
        if choice == "auto":
            choice = "triton" if self.device.type == "cuda" else "torch"
        if choice == "triton":
            from batchrun.engine.attention import TritonAttentionBackend
            return TritonAttentionBackend()
        return TorchAttentionBackend()

    def _kv_budget(self) -> int:
        if self.config.kv_cache_memory is not None:
            return int(self.config.kv_cache_memory)
        if self.device.type == "cuda":
            return self._cuda_kv_budget()
        return int(min(4 << 30, 0.25 * _available_host_memory()))

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
                         dtype=self.dtype, device=self.device)
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
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "block_size": self.block_size, "num_blocks": self.num_blocks, "kv_tokens": kv_tokens,
            "kv_bytes": kv_tokens * self.kv_bytes_per_token,
            "max_model_len": self.max_model_len,
            "max_concurrency_at_max_model_len": round(kv_tokens / self.max_model_len, 2),
            "host_swap_blocks": self.num_host_blocks,
        }

    def _prepare(self, entries: list[ScheduledSeq]):
        bs = self.block_size
        ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        qsl = [0]
        lens: list[int] = []
        max_blocks = max(len(e.seq.block_table) for e in entries)
        tables = np.zeros((len(entries), max_blocks), dtype=np.int32)
        for i, e in enumerate(entries):
            seq, start, n = e.seq, e.seq.num_computed_tokens, e.num_new_tokens
            end = start + n
            ids.extend(seq.token_ids[start:end - len(e.draft)])
            ids.extend(e.draft)
            bt = np.asarray(seq.block_table, dtype=np.int64)
            tables[i, :len(bt)] = bt
            pos = np.arange(start, end, dtype=np.int64)
            positions.append(pos)
            slots.append(bt[pos // bs] * bs + pos % bs)
            qsl.append(qsl[-1] + n)
            lens.append(end)
        meta = AttentionMetadata(
            slot_mapping=self._to_device(np.concatenate(slots)),
            query_start_loc=self._to_device(np.asarray(qsl, dtype=np.int32)),
            seq_lens=self._to_device(np.asarray(lens, dtype=np.int32)),
            block_tables=self._to_device(tables),
            num_decodes=sum(1 for e in entries if e.num_new_tokens == 1),
            max_query_len=max(e.num_new_tokens for e in entries),
            max_seq_len=max(lens), query_start_loc_host=qsl, seq_lens_host=lens)
        input_ids = self._to_device(np.asarray(ids, dtype=np.int64))
        pos_t = self._to_device(np.concatenate(positions))
        return input_ids, pos_t, meta

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        if self.device.type == "cuda":   # pinned staging so the copy overlaps; no sync until sampling
            return t.pin_memory().to(self.device, non_blocking=True)
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
            blocks = self.host_kv.index_select(2, host).to(self.device, non_blocking=True)
            self.kv_caches.index_copy_(2, dev, blocks)
        if swap_out:
            dev = torch.tensor([d for d, _ in swap_out], device=self.device)
            host = torch.tensor([h for _, h in swap_out])
            self.host_kv.index_copy_(2, host, self.kv_caches.index_select(2, dev).to("cpu"))

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
        if self.graphs is not None and self.graphs.can_run(meta):
            hidden = self.graphs.run(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
        sampling = [i for i, e in enumerate(entries) if e.samples]
        if not sampling:
            return []
        # rows to score: the last token of each sampling entry, plus one per draft token
        qsl = meta.query_start_loc_host
        rows = [r for i in sampling for r in range(qsl[i + 1] - 1 - len(entries[i].draft), qsl[i + 1])]
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        plain = [i for i in sampling if not entries[i].draft]
        spec = [i for i in sampling if entries[i].draft]
        result: dict[int, list[int]] = {}
        row_of, r = {}, 0
        for i in sampling:
            row_of[i] = r
            r += 1 + len(entries[i].draft)
        if plain:
            seqs = [entries[i].seq for i in plain]
            idx = torch.tensor([row_of[i] for i in plain], device=self.device)
            tokens = sample(logits[idx], [s.params for s in seqs], [s.generator for s in seqs],
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
