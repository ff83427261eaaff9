"""Several devices: the world of ranks, launching workers (or joining torchrun's), reductions, sync counting.

`accutrain devices=N` spawns N worker processes itself (NCCL on GPUs, gloo on the CPU); under torchrun the world
comes from torchrun's environment and nothing is spawned. Only rank 0 writes logs, metrics and checkpoints.
"""
from __future__ import annotations

import logging
import logging.config
import multiprocessing
import os
import shutil
import signal
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from accutrain.errors import UserError

log = logging.getLogger("accutrain")


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def torchrun_world() -> Optional[World]:
    """The world torchrun (or any launcher setting RANK/WORLD_SIZE/LOCAL_RANK) describes, else None."""
    env = os.environ
    if not {"RANK", "WORLD_SIZE", "LOCAL_RANK"} <= env.keys():
        return None
    return World(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]),
                 int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])))


def count_devices(devices: Any, device_type: str) -> int:
    """`devices` as a number of worker processes: auto = every visible GPU, or 1 on the CPU."""
    visible = torch.cuda.device_count() if device_type == "cuda" else None
    if devices == "auto":
        return visible or 1
    if visible is not None and devices > visible:
        raise UserError(f"devices={devices} but only {visible} GPU(s) are visible: use devices={visible} or fewer "
                        "(or devices=auto)")
    return devices


def worker_device(device: torch.device, world: World) -> torch.device:
    """Each rank's device: its own GPU (by local rank) on CUDA, the CPU otherwise."""
    if device.type == "cuda" and world.size > 1:
        torch.cuda.set_device(world.local_rank)
        return torch.device("cuda", world.local_rank)
    return device


def init_process_group(world: World, device: torch.device, init_method: str = "env://") -> None:
    if world.size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method,
                                rank=world.rank, world_size=world.size)


def all_reduce_sum(values: torch.Tensor, world: World) -> torch.Tensor:
    """Sum across ranks (a no-op on one device)."""
    if world.size > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def all_reduce_min(values: torch.Tensor, world: World) -> torch.Tensor:
    if world.size > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MIN)
    return values


def broadcast_from_main(obj: Any, world: World) -> Any:
    """Rank 0's value of `obj`, on every rank."""
    if world.size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclass
class CommStats:
    """What DDP's gradient all-reduce sent: a communication hook adds to it, the loop reads it per step."""

    process_group: Any = None
    syncs: int = 0  # backward passes whose gradients were all-reduced (the hook sees each bucket; one is last)
    bytes: int = 0  # gradient bytes this rank contributed to all-reduces
    buckets: int = 0

    def take(self) -> tuple[int, int]:
        """(syncs, bytes) since the last call."""
        out = (self.syncs, self.bytes)
        self.syncs = self.bytes = 0
        return out


def counting_allreduce_hook(state, bucket):  # no annotations: DDP checks them, and they are strings here
    """DDP's own averaging all-reduce of a dist.GradBucket, counted into `state` (a CommStats)."""
    buffer = bucket.buffer()
    state.bytes += buffer.numel() * buffer.element_size()
    state.buckets += 1
    state.syncs += int(bucket.is_last())
    return default_hooks.allreduce_hook(state.process_group, bucket)


def remove_stray_run_dir(path: Path) -> None:
    """Remove a run directory another rank's Hydra made, if nothing but an empty log is in it."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == path:
            logging.getLogger().removeHandler(handler)
            handler.close()
    files = list(path.rglob("*")) if path.is_dir() else []
    if all(f.is_dir() or f.stat().st_size == 0 for f in files):
        shutil.rmtree(path, ignore_errors=True)


# --- spawning workers on one machine -------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quiet_logging(rank: int) -> None:
    """Ranks other than 0 log nothing but errors, named by rank."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.ERROR)


@dataclass
class _Job:
    nprocs: int
    port: int
    errors: Any  # a queue of (rank, message): user errors
    results: Any  # a queue holding rank 0's return value
    log_config: Optional[dict]
    threads: int
    target: Callable[..., Any]
    args: tuple = field(default_factory=tuple)


def _worker(local_rank: int, job: _Job) -> None:
    world = World(local_rank, job.nprocs, local_rank, job.nprocs)
    if world.main and job.log_config:
        logging.config.dictConfig(job.log_config)
    elif not world.main:
        quiet_logging(world.rank)
    torch.set_num_threads(job.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job.port), RANK=str(world.rank),
                      WORLD_SIZE=str(world.size), LOCAL_RANK=str(world.local_rank))
    try:
        result = job.target(world, *job.args)
        if world.main:
            job.results.put(result)
    except UserError as e:
        job.errors.put((world.rank, str(e)))
        sys.exit(2)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(nprocs: int, target: Callable[..., Any], args: tuple, log_config: Optional[dict]) -> Any:
    """Run target(world, *args) in `nprocs` fresh processes and return rank 0's result.

    A failure on any rank ends them all and is raised here: a UserError as itself (one line), anything else
    with the failing rank's traceback. A SIGTERM or SIGINT to this process is passed on to the workers, which
    stop together after their current optimizer step.
    """
    from accutrain.signals import StopRequest

    ctx = multiprocessing.get_context("spawn")
    errors, results = ctx.SimpleQueue(), ctx.SimpleQueue()
    threads = max(1, (os.cpu_count() or 1) // nprocs)
    job = _Job(nprocs, _free_port(), errors, results, log_config, threads, target, args)
    context = torch.multiprocessing.start_processes(_worker, args=(job,), nprocs=nprocs, join=False,
                                                    start_method="spawn")

    def pass_on(signum: int) -> None:
        for process in context.processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGTERM)

    try:
        with StopRequest(on_request=pass_on, announce=False):
            while not context.join():
                pass
    except torch.multiprocessing.ProcessExitedException as e:
        if not errors.empty():
            raise UserError(errors.get()[1]) from None
        raise RuntimeError(f"rank {e.error_index} of {nprocs} died (exit code {e.exit_code}); every rank stopped")
    except torch.multiprocessing.ProcessRaisedException as e:
        cause = str(e).strip().splitlines()[-1]  # the failing rank's exception, `Type: message`
        raise RuntimeError(f"rank {e.error_index} of {nprocs} failed ({cause}); every rank stopped. Its traceback:"
                           f"\n{e}") from None
    except KeyboardInterrupt:
        for process in context.processes:
            process.kill()
        raise
    return results.get() if not results.empty() else None
