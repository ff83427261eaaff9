"""Devices and ranks: the device a run uses, the world of ranks, its process group, reductions, sync counting.

How the ranks are started (in this process, spawned, or by torchrun) is accutrain.runtime.launch. Only rank 0 writes
logs, metrics and checkpoints.
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from accutrain.errors import UserError

log = logging.getLogger("accutrain")


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0  # the rank among this machine's processes: its GPU

    @property
    def main(self) -> bool:
        return self.rank == 0


def resolve_device(name: str) -> torch.device:
    """`trainer.device`: `auto` is CUDA when visible, else the CPU; an unusable choice is one clear line. A CUDA
    device always carries its index (`cuda` is the first visible GPU), as torch.cuda.set_device and tensors' .device
    want; CUDA is not initialised here (a launcher's parent process must not)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"trainer.device={name!r} is not valid: expected auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"trainer.device={name!r} is not supported: expected auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"trainer.device={name} but no CUDA device is visible: use trainer.device=cpu (or auto)")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UserError(f"trainer.device={name} but only {torch.cuda.device_count()} CUDA device(s) are visible")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    return device


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
    """Each rank's device: its own GPU (by local rank) on CUDA — the only one it sees, where the launcher gave each
    process its own (SLURM's --gpus-per-task, a container per GPU) — the CPU otherwise."""
    if device.type == "cuda" and world.size > 1:
        visible = torch.cuda.device_count()
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible == 1 and hidden is not None and "," not in hidden:  # the launcher bound this process to its GPU
            torch.cuda.set_device(0)
            return torch.device("cuda", 0)
        if world.local_rank >= visible:
            raise UserError(f"rank {world.rank} has LOCAL_RANK={world.local_rank} but this process sees {visible} "
                            f"CUDA device(s)" + (f" (CUDA_VISIBLE_DEVICES={hidden})" if hidden is not None else "")
                            + ": start one process per visible GPU, or give every process all the node's GPUs")
        torch.cuda.set_device(world.local_rank)
        return torch.device("cuda", world.local_rank)
    return device


_patient_group: Optional[Any] = None  # a gloo group for waiting on rank-0-only work (see wait_for_main)
_vote_group: Optional[Any] = None  # a gloo group for votes on the host between micro-batches (see vote_sum)


def init_process_group(world: World, device: torch.device, patience_s: Optional[float] = None) -> None:
    """Join the world's process group (from the MASTER_ADDR/MASTER_PORT environment): NCCL on GPUs (bound to this
    rank's device), else gloo; and a gloo group whose collectives wait `patience_s` seconds, for wait_for_main."""
    global _patient_group, _vote_group
    if world.size > 1 and not dist.is_initialized():
        if device.type == "cuda":
            dist.init_process_group("nccl", rank=world.rank, world_size=world.size, device_id=device)
        else:
            dist.init_process_group("gloo", rank=world.rank, world_size=world.size)
        _patient_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=patience_s)) if patience_s else None
        _vote_group = dist.new_group(backend="gloo") if device.type == "cuda" else None  # None: the gloo world


def wait_for_main(world: World) -> None:
    """Every rank waits here until rank 0 arrives: after work rank 0 does alone (a download, accutrain-check,
    writing a checkpoint), which may outlast the default group's collective timeout (NCCL's: 10 minutes). The wait
    is on a gloo group timed by trainer.dist_timeout_s, so no NCCL collective is left pending meanwhile."""
    if world.size > 1:
        dist.barrier(group=_patient_group)


def leave_process_group() -> None:
    """Destroy this process's process groups, if it joined any."""
    global _patient_group, _vote_group
    if dist.is_initialized():
        dist.destroy_process_group()
    _patient_group = _vote_group = None


def vote_sum(values: torch.Tensor, world: World) -> torch.Tensor:
    """Sum a small CPU tensor across ranks on a gloo group: a vote taken on the host between micro-batches, which
    waits for no device (the world's NCCL group would)."""
    if world.size > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=_vote_group)
    return values


def all_reduce_sum(values: torch.Tensor, world: World) -> torch.Tensor:
    """Sum across ranks (a no-op on one device)."""
    if world.size > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def all_reduce_min(values: torch.Tensor, world: World) -> torch.Tensor:
    if world.size > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MIN)
    return values


def is_sharded(value: Any) -> bool:
    """A DTensor (strategy=fsdp's parameters, gradients and their norm), told without importing DTensor (slow to
    import) unless FSDP already has."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def all_reduce_max(values: torch.Tensor, world: World) -> torch.Tensor:
    if world.size > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
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

    def take(self) -> tuple[int, int]:
        """(syncs, bytes) since the last call."""
        out = (self.syncs, self.bytes)
        self.syncs = self.bytes = 0
        return out


def counting_allreduce_hook(state, bucket):  # no annotations: DDP checks them, and they are strings here
    """DDP's own averaging all-reduce of a dist.GradBucket, counted into `state` (a CommStats)."""
    buffer = bucket.buffer()
    state.bytes += buffer.numel() * buffer.element_size()
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
