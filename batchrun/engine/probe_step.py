"""A real decode step at batch 1 that a runner can run before any request: for choices that only the whole
step shows (models/weight_loads.py), not one op timed alone."""
from __future__ import annotations

from typing import Callable, Optional

from batchrun.engine.block_pool import blocks_needed
from batchrun.engine.scheduler import ScheduledSeq, SchedulerOutput
from batchrun.engine.sequence import Sequence
from batchrun.outputs import SamplingParams

CONTEXT = 128     # tokens already in the cache: a short prompt's decode step


def decode_step(runner) -> Optional[Callable[[], None]]:
    """fn() that runs one greedy decode step of one sequence through runner.execute: the step's inputs, the
    forward, the logits and the argmax, as a step of a job does. The sequence's context is the first blocks
    of the KV cache, which no request holds yet (its K/V are whatever is there: the step's time, not its
    token, is what counts). None where the cache is too small for it. The runner's forward_s is left as it
    was found."""
    bs = runner.block_size
    ctx = min(CONTEXT, runner.max_model_len - 1, runner.num_blocks * bs - 1)
    if ctx < 1:
        return None
    seq = Sequence("probe-step", [1] * (ctx + 1), SamplingParams(temperature=0.0, max_tokens=1))
    seq.num_computed_tokens = ctx
    seq.block_table = list(range(blocks_needed(ctx + 1, bs)))
    out = SchedulerOutput(scheduled=[ScheduledSeq(seq, 1)])

    def step() -> None:
        before = runner.forward_s
        runner.execute(out)
        runner.forward_s = before
    return step
