"""Host and device memory for the KV cache: lazily paged host tensors and the CUDA budget from a profiled step."""
from __future__ import annotations

import logging
import math
import mmap
import os

import torch

from batchrun.engine.block_pool import blocks_needed
from batchrun.models.attention import AttentionMetadata
from batchrun.models.loader import ModelError

log = logging.getLogger("batchrun")


def available_host_memory() -> int:
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


@torch.inference_mode()
def cuda_kv_budget(self) -> int:
    """The KV budget of runner `self` on CUDA: gpu_memory_utilization x total, less what the weights and the peak activations of the largest
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


def kv_budget(self, useful_bytes: int) -> int:
    """The KV bytes of runner `self`: kv_cache_memory, the CUDA budget, or on CPU what the job can use."""
    if self.config.kv_cache_memory is not None:
        return int(self.config.kv_cache_memory)
    if self.device.type == "cuda":
        return cuda_kv_budget(self)
    # CPU: what the job can use, at most half the RAM available now (the weights are loaded already).
    # Untouched pages cost nothing, so a large cap only bounds how far the working set may grow.
    return int(min(useful_bytes, 0.5 * available_host_memory()))


def check_fits_one_sequence(self, budget: int, kv_bytes_per_token: int, per_seq: int,
                            max_model_len: int) -> None:
    """A cache that cannot hold one sequence of max_model_len is a bad setting, refused at start."""
    block_bytes = kv_bytes_per_token * self.block_size
    blocks = budget // block_bytes
    if blocks < per_seq:
        knob, source = budget_knob(self)
        raise ModelError(
            f"{knob}: the KV cache holds {blocks} blocks of {self.block_size} tokens ({budget} bytes, "
            f"{source}), fewer than one sequence of max_model_len={max_model_len} needs ({per_seq} blocks, "
            f"{per_seq * block_bytes} bytes); raise {knob} or lower max_model_len")


def budget_knob(self) -> tuple[str, str]:
    """(the knob that sets the KV budget, where this budget came from)."""
    if self.config.kv_cache_memory is not None:
        return "kv_cache_memory", f"kv_cache_memory={self.config.kv_cache_memory}"
    if self.device.type == "cuda":
        return "gpu_memory_utilization", f"gpu_memory_utilization={self.config.gpu_memory_utilization}"
    return "kv_cache_memory", "default: half the available RAM"
