"""ModelRunner: owns the model weights and the KV tensors, turns a SchedulerOutput into one forward pass.

A batch is flat: T tokens of B sequences, decodes (one query token) first, then prefill chunks.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Optional

import torch
import torch.distributed as dist

from batchrun.engine.block_pool import blocks_needed
from batchrun.engine.config import EngineConfig, default_threads
from batchrun.engine.kv_memory import check_fits_one_sequence, kv_budget, lazy_zeros
from batchrun.engine.logprobs import record_prompt
from batchrun.engine.probe_step import decode_step
from batchrun.engine.sampler import sample_seqs, verify_drafts
from batchrun.engine.scheduler import ScheduledSeq, SchedulerOutput
from batchrun.engine.step_inputs import StepInputs
from batchrun.kernels import cpu_argmax
from batchrun.kernels.kv_quant import bytes_view, is_int8, kv_dtype, row_bytes, row_width
from batchrun.models.attention import TorchAttentionBackend
from batchrun.models.cpu_fused import fused_ops_supported, use_fused_layer_ops
from batchrun.models import attention_choice, kernel_choice, quant_kernel_choice, weight_loads
from batchrun.models.cpu_linear import pack_linear_weights, packing_supported
from batchrun.models.llama import LlamaModel
from batchrun.models.loader import ModelError, ModelInfo, load_weights
from batchrun.models.quant import apply_quantization, check_quantization, kernels_enabled
from batchrun.models.smoothquant import calibrate_model
from batchrun.models.tp import apply_tensor_parallel, shard_args, weight_slice

log = logging.getLogger("batchrun")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def resolve_device(name: str, rank: int = 0) -> torch.device:
    """The device of tensor-parallel rank `rank` (CUDA rank r: GPU r)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    return torch.device("cuda", rank) if dev.type == "cuda" and rank else dev


def apply_threads(config: EngineConfig, world: int = 1) -> int:
    """torch.set_num_threads(config.threads or the machine's cores, shared by `world` tensor-parallel
    ranks); returns the count."""
    n = config.threads if config.threads is not None else max(1, default_threads() // world)
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


class ModelRunner:
    def __init__(self, config: EngineConfig, info: ModelInfo, max_model_len: int, rank: int = 0,
                 tp=None, tp_group=None, calibration_rows=None):
        """calibration_rows: token rows of the calibration pass (w8a8, fp8 KV scales).
        rank/tp_group: this process's tensor-parallel rank and the gloo group of the ranks (None: one
        rank); tp: on rank 0, the TPGroup whose workers replay each forward and swap."""
        self.config = config
        self.world = config.tensor_parallel_size
        self.rank, self.tp, self.tp_group = rank, tp, tp_group
        self.device = resolve_device(config.device, rank)
        self.threads = apply_threads(config, self.world)
        self.dtype = info.torch_dtype(config.dtype)
        self.kv_dtype = kv_dtype(config.kv_cache_dtype, self.dtype)     # float8 or int8 with kv_cache_dtype
        if is_int8(self.kv_dtype) and self.device.type != "cpu":
            raise ModelError(f"kv_cache_dtype int8 runs on CPU only (device {self.device.type}); "
                             "on CUDA use fp8_e4m3 or auto")
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        args = shard_args(info.args, self.world)                        # this rank's heads and MLP rows
        per_seq = blocks_needed(max_model_len, self.block_size)
        # K and V of every layer, this rank's KV heads
        self.kv_bytes_per_token = 2 * args.num_layers * args.num_kv_heads * row_bytes(self.kv_dtype, args.head_dim)
        if config.kv_cache_memory is not None:        # refuse before any weight is read
            check_fits_one_sequence(self, int(config.kv_cache_memory), self.kv_bytes_per_token, per_seq,
                                          max_model_len)
        try:
            gemm_mode = kernel_choice.resolve_mode(config.cpu_gemm)
            attention_mode = attention_choice.resolve_mode(config.cpu_attention)
            loads_mode = weight_loads.resolve_mode()
        except ValueError as e:
            raise ModelError(str(e)) from e
        self.quantization = config.quantization
        try:
            check_quantization(config.quantization, config.group_size, info, self.device)
        except ValueError as e:
            raise ModelError(str(e)) from e
        with torch.device("meta"), _default_dtype(self.dtype):
            model = LlamaModel(args, max_model_len, device=self.device)
        model.to_empty(device=self.device)
        load_weights(model, info, (lambda name: weight_slice(name, info.args, rank, self.world))
                     if self.world > 1 else None)
        self.model = model.eval()
        quant_bytes = 0
        try:     # the calibration pass and what it sets: W8A8's int8 layers, fp8 KV scales (models/smoothquant.py)
            self.calibration = calibrate_model(model, info, config, self.kv_dtype, calibration_rows)
        except ValueError as e:
            raise ModelError(str(e)) from e
        if self.quantization == "w8a8":
            quant_bytes = self.calibration.pop("quantized_bytes")
        elif self.quantization:      # weight-only int8/int4 linear layers (models/quant.py)
            quant_bytes = apply_quantization(model, info, self.quantization, config.group_size,
                                             config.quantize_lm_head, self.dtype)
        self.quantized_bytes = quant_bytes
        # where CPU weight-only products switch from torch's kernels to dense ones, measured here
        self.quant_kernel_choice = quant_kernel_choice.choose(model, self.dtype, self.threads) \
            if self.device.type == "cpu" and self.quantization in ("int8", "int4", "gguf") else None
        self.weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) + quant_bytes
        self.decode_weights_bytes = model.decode_read_bytes(self.weights_bytes)
        self.backend = self._select_backend()
        self.attention_choice = self._choose_attention(attention_mode, max_model_len)
        self.default_generator = torch.Generator(device=self.device).manual_seed(config.seed)

        attn = model.layers[0].self_attn
        block_bytes = self.kv_bytes_per_token * self.block_size
        # more blocks than max_num_seqs full-length sequences can ever use is wasted memory
        useful = config.max_num_seqs * per_seq
        budget = kv_budget(self, useful * block_bytes)
        check_fits_one_sequence(self, budget, self.kv_bytes_per_token, per_seq, max_model_len)
        self.num_blocks = int(min(budget // block_bytes, useful))
        if self.world > 1:      # every rank holds the same blocks (its heads of each): the smallest count
            n = torch.tensor([self.num_blocks])
            dist.all_reduce(n, op=dist.ReduceOp.MIN, group=tp_group)
            self.num_blocks = int(n)
        shape = (info.num_layers, 2, self.num_blocks, self.block_size, attn.num_kv_heads,
                 row_width(self.kv_dtype, attn.head_dim))          # int8: each row's codes, then its scales
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
        self.eos_token_ids: tuple = ()    # the engine's: min_tokens bans them (engine/logits_processors.py)
        self.inputs = StepInputs(config, self.device, max_model_len)
        # dynamo would trace the quantized weights' objects and the all-reduces
        self.compiled = bool(config.compile and not config.enforce_eager and self.device.type == "cpu"
                             and not self.quantization and self.world == 1)
        if self.compiled:
            self.model.compile_dense()
        # bf16 projections in the forms measured fastest here per row count (models/kernel_choice.py:
        # own kernel, oneDNN, plain F.linear); off under torch.compile
        self.kernel_choice, self.packed_extra_bytes = None, 0
        if self.device.type == "cpu" and not self.compiled and packing_supported(self.dtype):
            chosen = kernel_choice.choose(model, gemm_mode, self.threads, config.max_num_seqs)
            self.kernel_choice = chosen["report"]
            self.packed_extra_bytes = pack_linear_weights(model, chosen["choice"], kernel_choice.bucket_of,
                                                          config.max_num_seqs)
        self.packed_linear = self.kernel_choice is not None and any(
            not c.startswith("plain") or "," in c for c in self.kernel_choice["choice"].values())
        # norms, RoPE and SwiGLU's activation as one compiled op each (models/cpu_fused.py); eager CPU only
        self.fused_layer_ops = not self.compiled and fused_ops_supported(self.device, self.dtype)
        if self.fused_layer_ops:     # and the whole layer as one op where it can (not under TP: its all-reduces)
            use_fused_layer_ops(model, whole_layer=self.world == 1)
        self.decoder_layer_op = model.dense_fns.layers is not None

        if self.world > 1:    # o_proj and down_proj sum their partial products over the ranks
            apply_tensor_parallel(model, tp_group if self.device.type == "cpu" else None)

        self.graphs = None
        if self.device.type == "cuda" and not config.enforce_eager and self.backend.name == "triton" \
                and self.world == 1:
            from batchrun.engine.cuda_graphs import DecodeGraphs
            self.graphs = DecodeGraphs(self, config.max_num_seqs)
        if self.kernel_choice is not None:   # how few-row products load the weights, timed on real decode steps
            step = decode_step(self) if self.world == 1 else None
            self.kernel_choice["weight_loads"] = weight_loads.choose(model, step, self.threads, loads_mode)

    def _select_backend(self):
        choice = self.config.attention_backend
        if choice == "auto":
            choice = "triton" if self.device.type == "cuda" else "torch"
        if choice == "triton":
            from batchrun.models.attention import TritonAttentionBackend
            return TritonAttentionBackend()
        return TorchAttentionBackend()

    def _choose_attention(self, mode: str, max_model_len: int) -> Optional[dict]:
        """CPU attention's implementation for this model's heads (models/attention_choice.py), set on the
        torch backend; None elsewhere. Without the compiled op, the reference path runs whatever the mode."""
        if self.device.type != "cpu" or self.backend.name != "torch":
            return None
        from batchrun.kernels import cpu_attention
        if mode != "torch" and not cpu_attention.load():
            mode = "torch"
        a = self.model.layers[0].self_attn
        longest = min(max_model_len, self.config.max_num_batched_tokens or max_model_len)
        report = attention_choice.choose((a.num_heads, a.num_kv_heads, a.head_dim), self.dtype, mode,
                                         self.threads, longest)
        self.backend.requested = "torch" if report["decode"] == "torch" else "op"
        self.backend.sdpa_from = report["sdpa_from"] or -1
        return report

    @property
    def memory_ledger(self) -> dict:
        kv_tokens = self.num_blocks * self.block_size
        return {
            "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
            "weights_bytes": self.weights_bytes,
            "decode_weights_bytes": self.decode_weights_bytes,
            "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "block_size": self.block_size, "num_blocks": self.num_blocks, "kv_tokens": kv_tokens,
            "kv_bytes": kv_tokens * self.kv_bytes_per_token,
            "max_model_len": self.max_model_len,
            "max_concurrency_at_max_model_len": round(kv_tokens / self.max_model_len, 2),
            "host_swap_blocks": self.num_host_blocks,
            "host_swap_bytes": self.num_host_blocks * self.block_size * self.kv_bytes_per_token,
            "threads": self.threads,
            "tensor_parallel_size": self.world,     # weights and KV above are one rank's
            "compiled": self.compiled,
            "packed_linear": self.packed_linear, "packed_extra_bytes": self.packed_extra_bytes,
            "cpu_gemm": self.kernel_choice,
            "cpu_attention": self.attention_choice,
            "fused_layer_ops": self.fused_layer_ops, "decoder_layer_op": self.decoder_layer_op,
            "quantization": self.quantization, "quantized_bytes": self.quantized_bytes,
            "quant_kernels": bool(self.quantization) and kernels_enabled(),
            "quant_kernel_choice": self.quant_kernel_choice,   # int8 kernel rows, int4 chunk (measured)
            "calibration": self.calibration,     # rows, cache, fp8 KV scales, w8a8's kernel per row bucket
        }

    def _prepare(self, entries: list[ScheduledSeq]):
        return self.inputs.prepare(entries)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """The model over one step's flat inputs -> hidden [T, H]; on rank 0 of a tensor-parallel engine
        the workers run the same step (their all-reduces meet this rank's)."""
        if self.tp is None:
            return self.model(input_ids, positions, self.kv_caches, meta, self.backend)
        self.tp.send("forward", input_ids, positions, meta)
        try:
            return self.model(input_ids, positions, self.kv_caches, meta, self.backend)
        except RuntimeError as e:       # a worker gone mid-collective
            raise self.tp.failure(e) from e

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
            if self.tp is not None:
                self.tp.send("swap", out.swap_out, out.swap_in)
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
            hidden = self.forward(input_ids, positions, meta)
        self.forward_s += time.perf_counter() - t0
        if plain_step and all(e.samples and e.seq.params.greedy and e.seq.params.plain for e in entries):
            # a pure greedy decode step: every row samples, no gather, argmax in the model's dtype (exact:
            # the float32 upcast changes no value, so no order or tie)
            t0 = time.perf_counter()
            logits = self.model.compute_logits(hidden, upcast=False)
            self.forward_s += time.perf_counter() - t0
            # max(dim).indices: the first maximal index, as argmax (2-3x faster than argmax in bf16 on CPU);
            # with the compiled layer ops, their vectorised, threaded version of it
            tokens = cpu_argmax.argmax(logits) if self.fused_layer_ops else logits.max(dim=-1).indices
            return [(e, [t]) for e, t in zip(entries, tokens.tolist())]
        qsl = meta.query_start_loc_host
        for i, e in enumerate(entries):     # prompt_logprobs: every prompt position of the chunk is scored
            seq = e.seq
            if seq.params.prompt_logprobs is not None and seq.num_computed_tokens < seq.num_prompt_tokens - 1:
                record_prompt(self.model.compute_logits, hidden, seq, seq.num_computed_tokens,
                              e.num_new_tokens - len(e.draft), qsl[i])
        sampling = [i for i, e in enumerate(entries) if e.samples]
        if not sampling:
            return []
        # rows to score: the last token of each sampling entry, plus one per draft token
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
            # the step's one host sync without drafts (and without logprobs)
            tokens = sample_seqs(sub, seqs, self.default_generator, self.eos_token_ids)
            result.update({i: [t] for i, t in zip(plain, tokens)})
        if spec:
            result.update(verify_drafts(logits, {i: (entries[i].seq, entries[i].draft, row_of[i]) for i in spec},
                                        self.default_generator))
        return [(entries[i], result[i]) for i in sampling]

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)


def build_tp_worker(config: EngineConfig, info: ModelInfo, max_model_len: int, rank: int, world: int,
                    group) -> ModelRunner:
    """A tensor-parallel worker's runner (engine/tp_group.py calls this in the worker process)."""
    return ModelRunner(config, info, max_model_len, rank=rank, tp_group=group)
