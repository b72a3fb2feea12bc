"""The Python entry point: LLM(...).generate(prompts, SamplingParams(...)), as in vLLM."""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from batchrun.engine.config import EngineConfig
from batchrun.engine.engine import LLMEngine
from batchrun.outputs import RequestOutput, SamplingParams

PromptType = Union[str, list[int], dict[str, Any]]


class LLM:
    """An offline engine over one HF model directory.

    >>> llm = LLM(model="path/to/model", dtype="bfloat16", max_num_seqs=256)
    >>> outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))

    Keyword arguments are EngineConfig fields (vLLM's names): max_num_seqs, max_num_batched_tokens,
    block_size, max_model_len, kv_cache_memory, gpu_memory_utilization, swap_space,
    enable_prefix_caching, speculative_config, enforce_eager, device, seed, tensor_parallel_size (then
    close() the LLM, or use it as a context manager, to stop the worker processes).
    """

    def __init__(self, model: str, dtype: str = "auto", tokenizer: Any = None, **engine_kwargs: Any):
        unknown = set(engine_kwargs) - set(EngineConfig.field_names())
        if unknown:
            raise TypeError(f"LLM() got unknown engine arguments: {', '.join(sorted(unknown))}")
        self.config = EngineConfig(model=model, dtype=dtype, **engine_kwargs)
        self.engine = LLMEngine(self.config, tokenizer)
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def close(self) -> None:
        """Release what outlives the Python object: tensor-parallel worker processes (a no-op on one rank)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def stats(self) -> dict:
        """Engine counters: steps, tokens_per_step, preemptions, peak_blocks_used, num_blocks, ..."""
        return self.engine.stats

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for each prompt; returns one RequestOutput per prompt, in input order.

        prompts: strings, token-id lists, or dicts {"prompt_token_ids": [...]} / {"prompt": "..."}.
        sampling_params: one SamplingParams for all, or one per prompt.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                 and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts))
        texts: list[Optional[str]] = []
        ids: list[Optional[list[int]]] = []
        for p in prompts:
            if isinstance(p, str):
                texts.append(p); ids.append(None)
            elif isinstance(p, dict):
                if "prompt_token_ids" in p:
                    texts.append(p.get("prompt")); ids.append(list(p["prompt_token_ids"]))
                elif "prompt" in p:
                    texts.append(p["prompt"]); ids.append(None)
                else:
                    raise ValueError("a dict prompt needs 'prompt_token_ids' or 'prompt'")
            else:
                texts.append(None); ids.append(list(p))
        for i, t in enumerate(texts):
            if ids[i] is None and not t:
                ids[i] = []      # an empty prompt is an error row, not a lone BOS token
        to_encode = [i for i, x in enumerate(ids) if x is None]
        if to_encode:
            for i, enc in zip(to_encode, self.tokenizer.encode_batch([texts[i] for i in to_encode])):
                ids[i] = enc
        return self._run(texts, ids, params, use_tqdm)

    def chat(self, messages: Union[list[dict], Sequence[list[dict]]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        convs = list(messages)
        params = self._params_per_prompt(sampling_params, len(convs))
        texts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt)
                 for c in convs]
        ids = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        return self._run(texts, ids, params, use_tqdm)

    @staticmethod
    def _params_per_prompt(sp, n: int) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams()] * n
        if isinstance(sp, SamplingParams):
            return [sp] * n
        sp = list(sp)
        if len(sp) != n:
            raise ValueError(f"got {len(sp)} SamplingParams for {n} prompts")
        return sp

    def _run(self, texts, ids, params, use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        order: dict[str, int] = {}
        for i, (t, x, p) in enumerate(zip(texts, ids, params)):
            rid = str(self._next_id)
            self._next_id += 1
            order[rid] = i
            engine.add_request(rid, x, p, prompt=t)
        results: list[Optional[RequestOutput]] = [None] * len(order)
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(order), desc="generate", unit="req", dynamic_ncols=True)
        while engine.has_unfinished_requests():
            done = engine.step()
            for out in done:
                results[order[out.request_id]] = out
            if bar is not None and done:
                bar.update(len(done))
        if bar is not None:
            bar.close()
        detokenize(results, params, self.tokenizer)
        return results  # type: ignore[return-value]


def detokenize(outputs: Sequence[RequestOutput], params: Sequence[SamplingParams], tokenizer: Any) -> None:
    """Fill `text` of finished outputs and of their samples in batches (stop-string outputs already carry
    theirs); RequestOutput.text is its first sample's."""
    for skip in (True, False):
        todo = [c for o, p in zip(outputs, params) if o.finish_reason != "error" and p.skip_special_tokens is skip
                for c in (o.outputs or [o]) if c.text is None]
        if todo:
            for c, t in zip(todo, tokenizer.decode_batch([c.token_ids for c in todo],
                                                         skip_special_tokens=skip)):
                c.text = t
    for o in outputs:
        if o.outputs:
            o.text = o.outputs[0].text
        if o.text is None:
            o.text = ""
