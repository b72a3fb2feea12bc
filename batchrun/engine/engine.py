"""LLMEngine: add requests, then step() = propose drafts -> schedule -> execute (forward + sample) -> the
scheduler's update (tokens appended, stops checked, finished sequences released), until all finish."""
from __future__ import annotations

import functools
import logging
import time
from typing import Any, Optional

from batchrun.engine.config import EngineConfig
from batchrun.engine.kv_cache import KVCacheManager, blocks_needed
from batchrun.engine.logits_processors import RowState, bad_words_token_ids, check_vocab
from batchrun.engine.logprobs import to_position_dicts
from batchrun.engine.runner import ModelRunner, build_tp_worker, resolve_device
from batchrun.engine.scheduler import Scheduler
from batchrun.engine.sequence import Sequence, SeqStatus
from batchrun.engine.speculative import NgramProposer, SeqSpecState, SpecConfig
from batchrun.engine.structured import Grammars, end_complete
from batchrun.models.calibration import needs_calibration, resolve_rows
from batchrun.models.loader import ModelError, inspect_model
from batchrun.outputs import CompletionOutput, RequestMetrics, RequestOutput, SamplingParams

log = logging.getLogger("batchrun")


class LLMEngine:
    """One engine replica over one model. Not thread-safe: drive it from one thread."""

    def __init__(self, config: EngineConfig, tokenizer: Any = None,
                 calibration_rows: Optional[list[list[int]]] = None):
        """calibration_rows: the job's prompts' token ids, which quantization_calibration's N rows come from."""
        # the knobs left None get the device's defaults (config.DEVICE_DEFAULTS)
        config = config.resolved(resolve_device(config.device).type)
        self.config = config
        info = inspect_model(config.model)   # fails on a bad directory before any weight is read
        if tokenizer is None:
            from batchrun.tokenizer import load_tokenizer
            tokenizer = load_tokenizer(config.model)
        self.tokenizer = tokenizer
        max_len = config.max_model_len or info.max_model_len
        if max_len > info.max_model_len:
            raise ModelError(f"max_model_len={max_len} exceeds the model's max_position_embeddings="
                             f"{info.max_model_len} ({config.model}/config.json)")
        self.max_model_len = max_len
        self.model_info = info
        self.tp = None
        if config.tensor_parallel_size > 1:     # ranks 1.. in worker processes (engine/tp_group.py)
            from batchrun.engine.tp_group import TPGroup, check_tp_settings
            check_tp_settings(config, info)
            self.tp = TPGroup(config.tensor_parallel_size, resolve_device(config.device).type,
                              functools.partial(build_tp_worker, config, info, max_len))
        try:
            rows = None
            if needs_calibration(config):       # quantization_calibration's rows (models/calibration.py)
                try:
                    rows = resolve_rows(config.quantization_calibration, tokenizer.encode, calibration_rows)
                except ValueError as e:
                    raise ModelError(str(e)) from None
            self.runner = ModelRunner(config, info, max_len, tp=self.tp, calibration_rows=rows,
                                      tp_group=self.tp.cmd_group if self.tp else None)
        except BaseException as e:
            if self.tp is not None:
                self.tp.close()
                if isinstance(e, RuntimeError) and not isinstance(e, ModelError):
                    raise self.tp.failure(e) from e
            raise
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                 num_host_blocks=self.runner.num_host_blocks)
        self.eos_token_ids = set(getattr(tokenizer, "eos_token_ids", []) or [])
        self.runner.eos_token_ids = tuple(sorted(self.eos_token_ids))
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   swap_min_tokens=config.swap_min_tokens,
                                   eos_token_ids=self.eos_token_ids, max_model_len=max_len,
                                   stop_strings=self._hit_stop_string)
        self.spec_config = SpecConfig.from_dict(config.speculative_config)
        self.proposer = NgramProposer(self.spec_config) if self.spec_config else None
        # structured outputs: compiled per distinct spec, a matcher per sequence (engine/structured.py)
        self.grammars = Grammars(tokenizer, info.config["vocab_size"], self.eos_token_ids, self.runner.threads)
        self._pending_errors: list[Sequence] = []
        self._samples: dict[str, list] = {}     # request id of n > 1 -> its samples' outputs so far
        self._bad_words: dict[tuple, list[list[int]]] = {}   # bad_words -> their token ids
        self._token_text: dict[int, str] = {}  # token id -> its text, for logprobs
        self._arrivals = 0
        self._stats = {"steps": 0, "batched_tokens": 0, "prompt_tokens": 0, "output_tokens": 0,
                       "requests": 0, "errors": 0, "spec_steps_disabled": 0, "computed_prompt_tokens": 0}
        self._step_s = 0.0          # wall time inside step(); minus the runner's forward_s: host overhead
        ledger = self.runner.memory_ledger
        log.info("memory ledger: weights %.1f MiB, KV %d B/token, %d blocks x %d tokens = %d tokens "
                 "(%.1f MiB), %.2f sequences at max_model_len=%d",
                 ledger["weights_bytes"] / 2**20, ledger["kv_bytes_per_token"], ledger["num_blocks"],
                 ledger["block_size"], ledger["kv_tokens"], ledger["kv_bytes"] / 2**20,
                 ledger["max_concurrency_at_max_model_len"], max_len)

    def close(self) -> None:
        """Stop the tensor-parallel workers (a no-op on one rank). The engine is unusable after."""
        if self.tp is not None:
            self.tp.close()
            self.tp = None

    @property
    def memory_ledger(self) -> dict:
        return self.runner.memory_ledger

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: Optional[str] = None) -> None:
        """Queue a request. Row-level problems never raise: they finish as an error output.

        n > 1: n sequences of the same prompt, sample k seeded with seed + k (vLLM's); the first computes
        the prompt's full blocks and the others take them from the prefix cache (the scheduler holds them
        back while it prefills; only a last partial block is computed again, as in vLLM V1), so
        stats["computed_prompt_tokens"] counts the prompt about once. One RequestOutput when all finish."""
        seq = Sequence(request_id, prompt_token_ids, params, prompt, self._arrivals)
        self._arrivals += 1
        self._stats["requests"] += 1
        error = self._check(seq)
        if error is not None:
            seq.status = SeqStatus.FINISHED
            seq.finish_reason, seq.error = "error", error
            seq.finish_time = time.perf_counter()
            self._pending_errors.append(seq)
            return
        if params.n > 1:
            self._samples[request_id] = [None] * params.n
        for k in range(params.n):
            if k:
                seq = Sequence(request_id, prompt_token_ids, params, prompt, self._arrivals)
                seq.sample_index = k
                seq.proc_state = RowState(self._bad_words.get(tuple(params.bad_words or ())))
            if params.structured_outputs is not None:
                seq.grammar = self.grammars.new_state(params.structured_outputs)
            if params.seed is not None and not params.greedy:
                seq.generator = self.runner.make_generator(params.seed + k)
            self.scheduler.add(seq)

    def _check(self, seq: Sequence) -> Optional[str]:
        n, p = seq.num_prompt_tokens, seq.params
        if n == 0:
            return "empty prompt"
        vocab = self.model_info.config["vocab_size"]
        if any(t < 0 or t >= vocab for t in seq.token_ids):
            return f"prompt has token ids outside the vocabulary [0, {vocab})"
        if n + p.max_tokens > self.max_model_len:
            return (f"prompt of {n} tokens + max_tokens={p.max_tokens} exceeds "
                    f"max_model_len={self.max_model_len}")
        if blocks_needed(n + p.max_tokens, self.kv.block_size) > self.kv.num_blocks:
            return (f"prompt of {n} tokens + max_tokens={p.max_tokens} needs more KV blocks than the "
                    f"whole cache holds ({self.kv.num_blocks} x {self.kv.block_size} tokens)")
        if p.structured_outputs is not None:
            error = self.grammars.check(p.structured_outputs)
            if error is not None:
                return error
        if p.processed:
            key = tuple(p.bad_words or ())
            if key not in self._bad_words:
                self._bad_words[key] = bad_words_token_ids(key, self.tokenizer) if key else []
            seq.proc_state = RowState(self._bad_words[key])
            return check_vocab(p, self._bad_words[key], vocab)
        return None

    def abort_request(self, request_id: str) -> None:
        while self.scheduler.abort(request_id) is not None:     # every sample of it
            pass
        self._samples.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending_errors) or self.scheduler.has_unfinished()

    def num_unfinished_requests(self) -> int:
        return len(self._pending_errors) + self.scheduler.num_unfinished()

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch; returns the requests that finished in it (text is None unless stop strings ran)."""
        t0 = time.perf_counter()
        try:
            return self._step()
        finally:
            self._step_s += time.perf_counter() - t0

    def _step(self) -> list[RequestOutput]:
        finished, self._pending_errors = self._pending_errors, []
        if self.proposer is not None:
            self._propose()
        sched = self.scheduler.schedule()
        if sched:
            self._mark_scheduled(sched)
            sampled = {id(e): tokens for e, tokens in self.runner.execute(sched)}
            if self.proposer is not None:
                self._record_drafts(sched, sampled)
            finished += self.scheduler.update(sched, sampled, time.perf_counter())
            finished += end_complete(sched, self.scheduler, time.perf_counter())   # grammars that ended
            self._stats["steps"] += 1
            self._stats["batched_tokens"] += sched.num_batched_tokens
        outs = [self._output(s) for s in finished]
        return [o for o in outs if o is not None]

    @staticmethod
    def _mark_scheduled(sched) -> None:
        now = time.perf_counter()
        for e in sched.scheduled:
            if e.seq.first_scheduled_time is None:
                e.seq.first_scheduled_time = now

    def _record_drafts(self, sched, sampled: dict) -> None:
        """Each verified draft's acceptance, for the proposer's adaptive draft length."""
        for e in sched.scheduled:
            if e.draft and id(e) in sampled:
                self.proposer.record(e.seq.spec, len(e.draft), len(sampled[id(e)]) - 1)

    def _propose(self) -> None:
        """Draft tokens for each decoding sequence, unless the batch is large enough to be compute-bound."""
        cfg = self.spec_config
        decoding = [s for s in self.scheduler.running if s.num_computed_tokens == s.num_tokens - 1]
        if cfg.disable_by_batch_size is not None and len(decoding) > cfg.disable_by_batch_size:
            self._stats["spec_steps_disabled"] += 1
            return
        for seq in decoding:
            if not seq.params.plain:    # processors and logprobs are not applied to drafts: no speculation
                continue
            if seq.spec is None:
                seq.spec = SeqSpecState()
            room = min(seq.params.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens)
            seq.draft = self.proposer.propose(seq.spec, seq.token_ids, room)

    def _hit_stop_string(self, seq: Sequence) -> bool:
        p = seq.params
        text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=p.skip_special_tokens)
        # only the tail can hold a new match: earlier text was checked on earlier steps
        window = max(len(s) for s in p.stop) + 16
        tail_start = max(0, len(text) - window)
        best = None
        for s in p.stop:
            i = text.find(s, tail_start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        seq.text = text[: i + len(s)] if p.include_stop_str_in_output else text[:i]
        return True

    def _decode_token(self, t: int) -> str:
        text = self._token_text.get(t)
        if text is None:
            text = self._token_text[t] = self.tokenizer.decode([t], skip_special_tokens=False)
        return text

    def _output(self, seq: Sequence) -> Optional[RequestOutput]:
        """seq's RequestOutput; with n > 1, None until the request's last sample finishes."""
        if seq.finish_reason != "error":
            self._stats["prompt_tokens"] += seq.num_prompt_tokens
            self._stats["output_tokens"] += seq.num_output_tokens
            self._stats["computed_prompt_tokens"] += seq.num_prompt_tokens - seq.num_cached_tokens
        else:
            self._stats["errors"] += 1
        lps = to_position_dicts(seq.logprobs, self._decode_token) if seq.params.logprobs is not None else None
        comp = CompletionOutput(seq.sample_index, seq.text, seq.output_token_ids, seq.finish_reason, lps,
                                None if lps is None else sum(e[1] for e in seq.logprobs or []))
        group = self._samples.get(seq.request_id) if seq.finish_reason != "error" else None
        if group is not None:
            group[seq.sample_index] = comp
            if any(c is None for c in group):
                return None
            del self._samples[seq.request_id]
        t0 = seq.arrival_time
        metrics = RequestMetrics(
            prompt_tokens=seq.num_prompt_tokens, output_tokens=seq.num_output_tokens,
            queued_s=(seq.first_scheduled_time or seq.finish_time or t0) - t0,
            first_token_s=None if seq.first_token_time is None else seq.first_token_time - t0,
            total_s=(seq.finish_time or t0) - t0)
        comps = group if group is not None else ([] if seq.finish_reason == "error" else [comp])
        if len(comps) > 1:
            metrics.output_tokens = sum(len(c.token_ids) for c in comps)
        first = comps[0] if comps else comp
        plp = None
        if seq.params.prompt_logprobs is not None and seq.finish_reason != "error":
            plp = [None] + (to_position_dicts(seq.prompt_logprobs or [], self._decode_token) or [])
        return RequestOutput(request_id=seq.request_id, prompt=seq.prompt,
                             prompt_token_ids=seq.token_ids[:seq.num_prompt_tokens],
                             text=first.text, token_ids=first.token_ids,
                             finish_reason=first.finish_reason,
                             error=seq.error, metrics=metrics, outputs=comps, prompt_logprobs=plp)

    @property
    def stats(self) -> dict:
        s = dict(self._stats) | self.scheduler.counters
        s["tokens_per_step"] = s["batched_tokens"] / s["steps"] if s["steps"] else 0.0
        s["preemptions"] = self.scheduler.num_preemptions
        s["peak_blocks_used"] = self.kv.pool.peak_used
        s["num_blocks"] = self.kv.num_blocks
        s["blocks_used"] = self.kv.pool.num_used
        s["swapped_out_blocks"] = self.kv.swapped_out_blocks
        s["swapped_in_blocks"] = self.kv.swapped_in_blocks
        s["recomputed_tokens"] = self.scheduler.recomputed_tokens
        s["prefix_cache_queries"] = self.kv.prefix_queries
        s["prefix_cache_hits"] = self.kv.prefix_hits
        s["spec_acceptance_rate"] = s["spec_accepted"] / s["spec_proposed"] if s["spec_proposed"] else 0.0
        s["mean_tokens_per_decode_step"] = (s["decode_tokens"] / s["decode_entries"]
                                            if s["decode_entries"] else 0.0)
        s["prefix_cache_hit_rate"] = self.kv.prefix_hits / self.kv.prefix_queries if self.kv.prefix_queries else 0.0
        # host overhead: step() time outside the model's forward and logits (scheduling, input
        # preparation, sampling, bookkeeping). CPU figures: on CUDA the forward is asynchronous.
        s["step_s"] = self._step_s
        s["forward_s"] = self.runner.forward_s
        s["host_overhead_s"] = max(0.0, self._step_s - self.runner.forward_s)
        s["host_overhead_ms_per_step"] = 1e3 * s["host_overhead_s"] / s["steps"] if s["steps"] else 0.0
        s["host_overhead_fraction"] = s["host_overhead_s"] / self._step_s if self._step_s > 0 else 0.0
        s["blocks_touched"] = self.kv.pool.num_touched
        return s
