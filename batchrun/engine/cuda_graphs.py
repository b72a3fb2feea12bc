"""CUDA graphs for pure-decode steps at bucketed batch sizes.

Captured largest first into one shared memory pool; a step of n decodes is padded to the next bucket
(padding rows write no K/V: slot -1; they read one token of block 0 and their output is dropped).
Only the Triton backend is captured: its kernels read lengths and tables from device tensors alone.
"""
from __future__ import annotations

import logging

import torch

from batchrun.models.attention import AttentionMetadata
from batchrun.engine.kv_cache import blocks_needed

log = logging.getLogger("batchrun")


def buckets(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    sizes += list(range(16, max_batch, 16))
    return sizes + [max_batch]


class DecodeGraphs:
    def __init__(self, runner, max_batch: int):
        self.runner = runner
        dev = runner.device
        self.sizes = buckets(max_batch)
        self.max_batch = max_batch
        width = blocks_needed(runner.max_model_len, runner.block_size)
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(max_batch, width, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._capture()

    def _meta(self, b: int) -> AttentionMetadata:
        r = self.runner
        return AttentionMetadata(slot_mapping=self.slot_mapping[:b], query_start_loc=self.query_start_loc[:b + 1],
                                 seq_lens=self.seq_lens[:b], block_tables=self.block_tables[:b], num_decodes=b,
                                 max_query_len=1, max_seq_len=r.max_model_len,
                                 query_start_loc_host=[], seq_lens_host=[])

    @torch.inference_mode()
    def _capture(self) -> None:
        r = self.runner
        pool = None
        before = torch.cuda.memory_allocated(r.device)
        for b in reversed(self.sizes):
            meta = self._meta(b)
            args = (self.input_ids[:b], self.positions[:b], r.kv_caches, meta, r.backend)
            r.model(*args)                       # warm-up: autotuning and allocations outside the graph
            torch.cuda.synchronize(r.device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                out = r.model(*args)
            pool = g.pool()
            self.graphs[b] = (g, out)
        log.info("captured %d decode CUDA graphs (batch %s), %.1f MiB", len(self.graphs),
                 self.sizes, (torch.cuda.memory_allocated(r.device) - before) / 2**20)

    def can_run(self, meta: AttentionMetadata) -> bool:
        B = meta.seq_lens.shape[0]
        return meta.num_decodes == B and B <= self.max_batch

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = input_ids.shape[0]
        b = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:b].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:b].fill_(1)
        w = meta.block_tables.shape[1]
        self.block_tables[:n, :w].copy_(meta.block_tables)
        g, out = self.graphs[b]
        g.replay()
        return out[:n]
