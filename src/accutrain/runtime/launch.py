"""Starting the ranks: one process, `devices` worker processes on this machine (start_method), or one rank of the
world torchrun (or any launcher setting RANK/WORLD_SIZE/LOCAL_RANK) started. Each rank then runs session.train_rank."""
from __future__ import annotations

import logging
import logging.config
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from accutrain.config.train import TrainConfig
from accutrain.config.validate_values import auto_needs_budget
from accutrain.core.plan import window_split
from accutrain.core.precision import float32_math
from accutrain.dist import World, count_devices, leave_process_group, resolve_device
from accutrain.errors import Preempted, UserError
from accutrain.models.norms import batchnorm_in
from accutrain.runtime.scheduler import launcher_name
from accutrain.runtime.session import train_rank
from accutrain.runtime.workers import quiet_logging, spawn
from accutrain.seeding import deterministic_algorithms
from accutrain.signals import signal_numbers
from accutrain.train.loop import Outcome

log = logging.getLogger("accutrain")


@dataclass
class Ranks:
    """Where the run will go, as preflight decided it."""

    device: torch.device
    world: Optional[World]  # the world torchrun started, else None
    n: int  # ranks in all


def place(cfg: TrainConfig) -> Ranks:
    """The device and the number of ranks the config asks for, checked against the machine. Raises UserError."""
    device = resolve_device(cfg.trainer.device)
    world = torchrun_world()
    # A world's processes (torchrun's, a scheduler's tasks) are the devices: `devices` left at its default 1 means
    # them too, as the recipes and the multi-node presets leave it
    if world is not None and cfg.devices not in ("auto", 1, world.size):
        raise UserError(f"devices={cfg.devices} but {launcher_name()} started {world.size} processes: leave "
                        f"devices out (its default, or auto, means the processes started) or set devices={world.size}")
    if world is not None and cfg.micro_batch != "auto" and cfg.batch_schedule is None:
        window_split(cfg.micro_batch, world.size, cfg.accum, cfg.global_batch,  # this world's split, one line
                     cfg.micro_tokens)
    auto_needs_budget(cfg, device.type)  # trainer.device=auto found no CUDA device: before the run directory is made
    if cfg.model.get("quantize") is not None and device.type != "cuda":
        raise UserError(f"model.quantize={cfg.model.get('quantize')} (QLoRA) needs a CUDA GPU and bitsandbytes; "
                        f"this run's device is {device}: drop model.quantize to train LoRA on the unquantized weights")
    n = world.size if world is not None else count_devices(cfg.devices, device.type)
    if n > 1 and cfg.strategy.name == "fsdp" and cfg.batchnorm.convert.name == "keep" and \
            (layers := batchnorm_in(cfg.model.node())):  # before the workers start and build it (seconds each)
        raise UserError(f"strategy=fsdp with batchnorm.convert=keep: the model has {layers} BatchNorm layers, whose "
                        "running statistics FSDP leaves different on every rank (DDP broadcasts rank 0's); use "
                        "batchnorm.convert=group (GroupNorm) or batchnorm.convert=frozen, or strategy=ddp")
    if n > 1 and cfg.batchnorm.sync and device.type != "cuda":
        raise UserError("batchnorm.sync=true needs CUDA devices: PyTorch's SyncBatchNorm does not run on the CPU (use "
                        "devices=1, or batchnorm.sync=false)")
    return Ranks(device, world, n)


def train(cfg: TrainConfig, run_dir: Path, log_config: Optional[dict] = None, ranks: Optional[Ranks] = None
          ) -> Optional[Outcome]:
    """Train the checked run (config.validate.typed_run), then run the ranks; raise Preempted if a signal stopped the
    run early (after its checkpoint). `ranks`: what the caller's place() found (the command line checks once), else
    placed here.
    `log_config` is the logging setup a spawned rank 0 repeats (Hydra's job logging). The caller owns run_dir: the
    command line refuses one an earlier run used (accutrain.store.rundir)."""
    ranks = ranks or place(cfg)
    if cfg.trainer.tf32 is not None and ranks.device.type == "cpu":
        log.info(f"trainer.tf32={str(cfg.trainer.tf32).lower()} changes nothing on the CPU (TF32 is a CUDA format)")
    # before anything runs on CUDA; a spawned worker sets both again (the settings are per process)
    with deterministic_algorithms(cfg.trainer.deterministic), float32_math(cfg.trainer.tf32):
        out = _train(cfg, ranks, run_dir, log_config)
    if out is not None and out.stopped_by:
        raise Preempted(signal.Signals[out.stopped_by], f"stopped by {out.stopped_by} after optimizer step "
                                                        f"{out.progress.step}; checkpoint {out.checkpoint}")
    return out


def _train(cfg: TrainConfig, ranks: Ranks, run_dir: Path, log_config: Optional[dict]) -> Optional[Outcome]:
    device, world, n = ranks.device, ranks.world, ranks.n
    if world is not None:
        if not world.main:
            quiet_logging(world.rank)
        try:
            return train_rank(world, cfg, run_dir, device)
        finally:
            leave_process_group()
    if n == 1:
        return train_rank(World(), cfg, run_dir, device)
    log.info(f"launching {n} worker processes ({'NCCL' if device.type == 'cuda' else 'gloo'})")
    return spawn(n, train_rank, (cfg, run_dir, device), log_config, cfg.trainer.deterministic,
                 signal_numbers(cfg.trainer.preempt_signals), cfg.trainer.tf32)


def torchrun_world() -> Optional[World]:
    """The world torchrun (or any launcher setting RANK/WORLD_SIZE/LOCAL_RANK) describes, else None."""
    env = os.environ
    if not {"RANK", "WORLD_SIZE", "LOCAL_RANK"} <= env.keys():
        return None
    return World(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]))


