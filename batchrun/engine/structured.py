"""Structured outputs in the engine: llguidance matchers over the tokenizer's vocabulary, one token bitmask
per sampling step for the whole batch, applied to the logits before sampling (greedy and sampled rows).

- Grammars (one per engine): the llguidance tokenizer, built on the first constrained request from the
  `tokenizers` pipeline both our tokenizers wrap (tokenizer.json and GGUF alike), and a compiled
  template matcher per distinct spec (cache keyed by the spec's canonical text); each sequence gets a
  copy of it.
- SeqGrammar (seq.grammar): the matcher and how many of the sequence's output tokens it has consumed.
  It follows the tokens, never the steps: sync() feeds it the output tokens it has not seen, so a
  preempted sequence recomputed from its kept tokens, a swapped one, or a chunked prefill never advances
  it twice or skips a token.
- masks: the rows' bitmasks filled in one parallel llguidance call, unpacked with shifts into a bool
  [R, V] and applied with one masked_fill; a constrained row's grammar that has ended (only EOS could
  follow) finishes the row with "stop" without another step (end_complete, after the scheduler's update).

N-gram speculation is off for constrained rows (SamplingParams.plain): drafts are never checked against
the grammar. Under tensor parallelism only rank 0 samples, so only it holds matchers.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterable, Optional, Sequence as Seq

import torch

from batchrun.engine.sequence import SeqStatus

CACHE_SPECS = 256          # distinct specs kept compiled (a per-row schema column may hold many)
_SHIFTS = torch.arange(32, dtype=torch.int32)


class SeqGrammar:
    """One sequence's matcher and the number of its output tokens consumed."""
    __slots__ = ("matcher", "consumed", "grammars")

    def __init__(self, matcher: Any, grammars: "Grammars"):
        self.matcher = matcher
        self.consumed = 0
        self.grammars = grammars

    def sync(self, seq) -> Optional[str]:
        """Consume the output tokens not yet seen; the matcher's error (one line) if one was refused."""
        new = seq.token_ids[seq.num_prompt_tokens + self.consumed:]
        if new:
            self.matcher.consume_tokens(new)
            self.consumed += len(new)
        if self.matcher.is_error():
            return "structured output: " + " ".join(self.matcher.get_error().split())
        return None

    @property
    def ended(self) -> bool:
        """True when the grammar is complete and nothing but EOS may follow."""
        return self.matcher.is_stopped()


class Grammars:
    """The engine's compiled grammars and the batch bitmask (see the module docstring)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int], threads: int = 1):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.threads = max(1, threads)
        self._ll_tokenizer = None
        self._executor = None
        self._templates: OrderedDict[str, Any] = OrderedDict()    # spec key -> matcher or error text
        self._bitmask = torch.empty(0)
        self.compiled = 0           # distinct specs compiled (the cache's misses)

    @property
    def ll_tokenizer(self):
        if self._ll_tokenizer is None:
            import llguidance
            backend = getattr(self.tokenizer, "backend", None)
            if backend is None:
                raise ValueError("structured outputs need a `tokenizers`-based tokenizer (tokenizer.json or GGUF)")
            eos = self.eos_token_ids or None
            self._ll_tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size,
                                                        eos_token=eos[0] if eos and len(eos) == 1 else eos)
            self._executor = llguidance.LLExecutor(self.threads)
        return self._ll_tokenizer

    def _template(self, spec) -> Any:
        key = spec.key
        hit = self._templates.get(key)
        if hit is not None:
            self._templates.move_to_end(key)
            return hit
        import llguidance
        try:
            m = llguidance.LLMatcher(self.ll_tokenizer, spec.grammar_text(), log_level=0)
            hit = f"structured_outputs.{spec.kind}: " + " ".join(m.get_error().split()) if m.is_error() else m
        except ValueError as e:
            hit = str(e)
        self.compiled += 1
        self._templates[key] = hit
        if len(self._templates) > CACHE_SPECS:
            self._templates.popitem(last=False)
        return hit

    def check(self, spec) -> Optional[str]:
        """The row-level error of a spec that does not compile against this vocabulary, or None."""
        t = self._template(spec)
        return t if isinstance(t, str) else None

    def new_state(self, spec) -> SeqGrammar:
        """A fresh matcher for one sequence (check() first: the spec compiles)."""
        return SeqGrammar(self._template(spec).deep_copy(), self)

    def fill(self, states: Seq[SeqGrammar]) -> torch.Tensor:
        """The rows' allowed tokens as a bitmask [R, ceil(V / 32)] int32, filled in one parallel call."""
        R, W = len(states), (self.vocab_size + 31) // 32
        if self._bitmask.shape[0] < R:
            self._bitmask = torch.empty((max(R, 2 * self._bitmask.shape[0]), W), dtype=torch.int32)
        bm = self._bitmask[:R]
        # the executor's own call, not llguidance.torch's wrapper: importing that module pulls in
        # torch._dynamo (seconds at first use) for a torch.compile'd helper we do not use
        self._executor.unsafe_compute_mask_ptr([(s.matcher, i) for i, s in enumerate(states)],
                                               bm.data_ptr(), W * 4, R)
        return bm


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bitmask [R, W] int32 (bit j of word w: token 32 w + j) -> bool [R, vocab_size]."""
    R = bitmask.shape[0]
    return ((bitmask.unsqueeze(-1) >> _SHIFTS) & 1).view(R, -1)[:, :vocab_size].bool()


def apply(logits: torch.Tensor, seqs: Seq) -> torch.Tensor:
    """logits [S, V], seqs[i] the sequence row i samples for -> logits with each constrained row's
    disallowed tokens at -inf (a new tensor; `logits` itself when no row is constrained)."""
    rows = [i for i, s in enumerate(seqs) if getattr(s, "grammar", None) is not None]
    if not rows:
        return logits
    states = [seqs[i].grammar for i in rows]
    for i, st in zip(rows, states):
        st.sync(seqs[i])            # a no-op after end_complete; here for callers that step by hand
    S, V = logits.shape
    ok = allowed_tokens(states[0].grammars.fill(states), V).to(logits.device)
    if len(rows) == S:
        return logits.masked_fill(~ok, float("-inf"))
    keep = torch.ones((S, V), dtype=torch.bool, device=logits.device)
    keep[torch.tensor(rows, device=logits.device)] = ok
    return logits.masked_fill(~keep, float("-inf"))


def end_complete(sched, scheduler, now: float) -> list:
    """After the scheduler's update: each constrained, still running sequence of the step consumes its new
    tokens; one whose grammar is complete (only EOS may follow) finishes with "stop", one whose token
    the grammar refused (never, when the mask was applied) with an error. Returns the finished ones."""
    done = []
    for e in sched.scheduled:
        seq = e.seq
        st = seq.grammar
        if st is None or seq.status is not SeqStatus.RUNNING:
            continue
        error = st.sync(seq)
        if error is not None:
            scheduler.finish(seq, "error", error)
        elif st.ended:
            scheduler.finish(seq, "stop")
        else:
            continue
        seq.finish_time = now
        done.append(seq)
    if done:
        scheduler.remove_finished()
    return done
