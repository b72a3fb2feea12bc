"""The processes of one tensor-parallel engine: rank 0 is the engine's own process (scheduler, KV manager,
sampler, and its shard of the model); ranks 1..N-1 are worker processes started here that hold the other
shards and replay what rank 0 tells them, in the same order: each step's flat inputs, block swaps, stop.

Ranks talk through torch.distributed: gloo on CPU (loopback TCP), NCCL on CUDA for the all-reduces of the
row-parallel projections (models/tp.py); the per-step commands always go over a gloo group, as pickled
objects (a few KB: token ids, positions, block tables). A worker that dies breaks rank 0's next collective;
rank 0 then raises TPWorkerError naming the rank and its exit code.
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

log = logging.getLogger("batchrun")

# How long a collective waits for a silent rank (a dead one usually fails it at once: its socket closes).
TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("BATCHRUN_TP_TIMEOUT_S", "300")))


class TPWorkerError(RuntimeError):
    """A tensor-parallel worker failed or died; the engine cannot go on."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, port: int, device_type: str):
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(rank)          # NCCL binds each rank to its GPU
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=TIMEOUT)
    # commands travel as pickled objects, which NCCL would stage through device memory
    return dist.new_group(backend="gloo", timeout=TIMEOUT) if backend == "nccl" else dist.group.WORLD


def check_tp_settings(config, info) -> None:
    """tensor_parallel_size against the model and the machine, before any process starts: a ValueError
    naming the knob."""
    from batchrun.engine.config import default_threads
    from batchrun.engine.runner import resolve_device
    from batchrun.models.tp import check_tensor_parallel
    world = config.tensor_parallel_size
    check_tensor_parallel(info.args, world)
    device = resolve_device(config.device)
    have = torch.cuda.device_count() if device.type == "cuda" else default_threads()
    if world > have:
        what = "GPUs" if device.type == "cuda" else "CPU cores this process may use"
        raise ValueError(f"tensor_parallel_size: {world} ranks, but {have} {what}")
    if config.quantization == "int4":           # each rank's row-parallel inputs must hold whole groups
        g, a = config.group_size, info.args
        bad = sorted({n // world for n in (a.q_size, a.intermediate_size) if (n // world) % g})
        if bad:
            raise ValueError(f"quantization_group_size: {g} does not divide the per-rank layer inputs {bad} "
                             f"at tensor_parallel_size {world}")
    if config.quantization == "gguf":
        raise ValueError("tensor_parallel_size: quantization 'gguf' keeps a GGUF file's whole tensors; use "
                         "int8/int4 (applied to each rank's shard) or tensor_parallel_size 1")


class TPGroup:
    """Rank 0's side: starts the workers, sends them commands, checks on them, shuts them down."""

    def __init__(self, world: int, device_type: str, build_worker: Any):
        """build_worker(rank, world, group) -> an object with forward(ids, positions, meta) and swap(out, in): the
        rank's model runner, built in the worker process (it must be picklable: a top-level function or a
        functools.partial of one)."""
        self.world = world
        port = _free_port()
        ctx = mp.get_context("spawn")          # fork would copy the parent's threads and locks
        self.procs = [ctx.Process(target=_worker_main, args=(r, world, port, device_type, build_worker),
                                  name=f"batchrun-tp-rank{r}", daemon=True) for r in range(1, world)]
        for p in self.procs:
            p.start()
        try:
            self.cmd_group = _init(0, world, port, device_type)
        except Exception as e:
            self.close()
            raise TPWorkerError(f"tensor_parallel_size={world}: the ranks could not join ({e})") from e
        self._closed = False

    def send(self, *cmd: Any) -> None:
        """Broadcast one command to every worker."""
        try:
            dist.broadcast_object_list([cmd], src=0, group=self.cmd_group)
        except Exception as e:
            raise self.failure(e) from e

    def failure(self, e: BaseException) -> TPWorkerError:
        """The error to raise for a failed collective: which rank died, when one did."""
        dead = []
        for p in self.procs:
            p.join(timeout=2.0 if p.exitcode is None else 0)
            if p.exitcode is not None:
                dead.append(f"rank {p.name.rsplit('rank', 1)[1]} exited with code {p.exitcode}")
        what = "; ".join(dead) or f"a collective failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        return TPWorkerError(f"tensor-parallel worker failed: {what}")

    def close(self) -> None:
        if getattr(self, "_closed", True) is False:
            self._closed = True
            try:
                dist.broadcast_object_list([("stop",)], src=0, group=self.cmd_group)
            except Exception:   # noqa: BLE001 - a dead worker: nothing to tell
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


def _worker_main(rank: int, world: int, port: int, device_type: str, build_worker: Any) -> None:
    group = _init(rank, world, port, device_type)
    runner = build_worker(rank, world, group)
    while True:
        box: list[Optional[tuple]] = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        cmd = box[0]
        if cmd[0] == "forward":
            with torch.inference_mode():
                runner.forward(*cmd[1:])
        elif cmd[0] == "swap":
            runner.swap(*cmd[1:])
        elif cmd[0] == "stop":
            break
    dist.destroy_process_group()
