"""The recipe: build everything from the config, then windows → accumulate → one optimizer step → log/evaluate."""
from __future__ import annotations

import logging
import random
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Optional

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Subset, default_collate

from accutrain import checkpoint, data, dist, models
from accutrain.config import load_target, validate
from accutrain.dist import World
from accutrain.errors import UserError
from accutrain.metrics import MetricsLog, progress_bar, summary_line
from accutrain.plan import BatchPlan, make_plan
from accutrain.step import accumulate, evaluate, grad_norm
from accutrain.windows import Window, WindowSampler

log = logging.getLogger("accutrain")


def resolve_device(name: str) -> torch.device:
    """`auto` is CUDA when visible, else the CPU; an unusable choice is one clear line."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
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
    return device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def factory_kwargs(group: str, node: DictConfig, *drop: str) -> tuple[Any, dict[str, Any]]:
    """(the callable `group._target_` names, the node's other keys as plain Python values)."""
    kwargs = OmegaConf.to_container(node, resolve=True)
    target = kwargs.pop("_target_")
    for key in drop:
        kwargs.pop(key, None)
    return load_target(f"{group}._target_", target), kwargs


@contextmanager
def main_first(world: World) -> Iterator[None]:
    """Rank 0 runs the block first (a download, say), the other ranks after it."""
    if not world.main:
        torch.distributed.barrier()
    yield
    if world.main and world.size > 1:
        torch.distributed.barrier()


@dataclass
class Run:
    """Everything the loop needs, built from the config."""

    cfg: DictConfig
    world: World
    plan: BatchPlan
    device: torch.device
    model: nn.Module  # the bare model: its state_dict is what checkpoints hold
    forward: nn.Module  # what the loop calls: the DDP wrapper on several devices, else the model itself
    no_sync: Callable[[], ContextManager]
    comm: Optional[dist.CommStats]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: WindowSampler
    loader: DataLoader
    val_loader: DataLoader
    empty_batch: Any  # a batch of zero samples, for a rank whose share of a short window runs out


def setup(cfg: DictConfig, world: World = World(), device: Optional[torch.device] = None) -> Run:
    validate(cfg)
    device = device or resolve_device(cfg.trainer.device)
    seed_everything(cfg.seed)
    make_data, data_kwargs = factory_kwargs("data", cfg.data, "num_workers")
    with main_first(world):
        datasets: data.Datasets = make_data(**data_kwargs)
    plan = make_plan(
        micro_batch=cfg.micro_batch, accum=cfg.accum, devices=world.size, global_batch=cfg.global_batch,
        train_size=len(datasets.train), last_window=cfg.trainer.last_window,
        epochs=cfg.trainer.epochs, max_steps=cfg.trainer.max_steps,
    )
    for line in plan.describe():
        log.info(line)
    log.info(data.describe_split_sizes(datasets))

    torch.manual_seed(cfg.seed)  # the initial weights depend on the seed only
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    model = models.build_model(model_cfg, datasets.sample_shape, datasets.num_classes)
    if world.size > 1 and model_cfg.get("sync_batchnorm"):
        if device.type != "cuda":
            raise UserError("model.sync_batchnorm=true needs CUDA devices: PyTorch's SyncBatchNorm does not run on "
                            "the CPU (use devices=1, or model.sync_batchnorm=false)")
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    log.info(f"model {cfg.model.get('name', cfg.model._target_)}: {models.count_parameters(model):,} parameters, "
             f"on {device}" + (f" × {world.size} ranks" if world.size > 1 else ""))
    forward, no_sync, comm = model, nullcontext, None
    if world.size > 1:
        forward = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                          gradient_as_bucket_view=True)
        comm = dist.CommStats(process_group=None)
        forward.register_comm_hook(comm, dist.counting_allreduce_hook)
        no_sync = forward.no_sync
    make_optimizer, optim_kwargs = factory_kwargs("optim", cfg.optim)
    optimizer = make_optimizer(model, **optim_kwargs)
    make_scheduler, sched_kwargs = factory_kwargs("sched", cfg.sched)
    scheduler = make_scheduler(optimizer, total_steps=plan.total_steps, **sched_kwargs)

    pin = device.type == "cuda"
    sampler = WindowSampler(plan, cfg.seed, world.rank, world.size)
    loader = data.train_loader(datasets.train, sampler, cfg.data.num_workers, pin)
    val_share = Subset(datasets.val, range(world.rank, len(datasets.val), world.size))  # no padding: exact
    val_loader = data.eval_loader(val_share, cfg.trainer.eval_batch or cfg.micro_batch, cfg.data.num_workers, pin)
    empty_batch = [t[:0] for t in default_collate([datasets.train[0]])]
    return Run(cfg, world, plan, device, model, forward, no_sync, comm, optimizer, scheduler, sampler, loader,
               val_loader, empty_batch)


def micro_batches(window: Window, batches: Iterator, empty_batch: Any) -> Iterator:
    """This rank's micro-batches of the window; an empty one (a short window's tail) is a batch of zero samples."""
    for indices in window.micro:
        yield next(batches) if indices else empty_batch


@dataclass
class Outcome:
    steps: int = 0
    samples: int = 0
    last_loss: Optional[float] = None
    best_acc: Optional[float] = None
    best_step: Optional[int] = None
    seconds: float = 0.0


def fit(r: Run, metrics: MetricsLog) -> Outcome:
    """Run every optimizer step of the plan: one window of micro-batches each, then evaluate."""
    trainer, plan, world = r.cfg.trainer, r.plan, r.world
    params = [p for p in r.model.parameters() if p.requires_grad]
    out = Outcome()
    bar = progress_bar(plan.total_steps, 0, trainer.progress and world.main)
    start = time.perf_counter()

    def validate_now(epoch: int) -> None:
        loss_sum, correct, n = dist.all_reduce_sum(evaluate(r.forward, r.val_loader, r.device), world).tolist()
        val_loss, val_acc = loss_sum / n, correct / n
        metrics.write(dict(step=out.steps, epoch=epoch + 1, val_loss=val_loss, val_acc=val_acc))
        log.info(f"step {out.steps} (epoch {epoch + 1}): val_loss {val_loss:.4f}  val_acc {val_acc:.4f}")
        if out.best_acc is None or val_acc > out.best_acc:
            out.best_acc, out.best_step = val_acc, out.steps

    for epoch in range(plan.total_epochs):
        r.sampler.set_epoch(epoch)
        batches = iter(r.loader)
        for window in r.sampler.windows():
            t0 = time.perf_counter()
            loss_sum = accumulate(r.forward, micro_batches(window, batches, r.empty_batch), len(window.micro),
                                  window.size, r.device, world=world.size, no_sync=r.no_sync)
            norm = grad_norm(params, trainer.grad_clip)  # measured, and clipped if asked, once per window
            lr = r.optimizer.param_groups[0]["lr"]
            r.optimizer.step()
            r.scheduler.step()
            r.optimizer.zero_grad(set_to_none=True)
            out.steps, out.samples = out.steps + 1, out.samples + window.size
            out.last_loss = dist.all_reduce_sum(loss_sum, world).item() / window.size  # the window's mean
            rate = window.size / (time.perf_counter() - t0)
            record = dict(step=out.steps, epoch=epoch + 1, loss=out.last_loss, samples=window.size,
                          micro_batches=len(window.micro), lr=lr, grad_norm=norm.item(), samples_per_s=rate,
                          samples_seen=out.samples, time=time.perf_counter() - start)
            if r.comm is not None:
                record["grad_syncs"], record["comm_bytes"] = r.comm.take()
            metrics.write(record)
            bar.set_postfix(loss=f"{out.last_loss:.4f}", lr=f"{lr:.3g}", samples_s=f"{rate:.0f}", refresh=False)
            bar.update()
            if out.steps % trainer.log_every == 0:
                log.info(f"step {out.steps}/{plan.total_steps} (epoch {epoch + 1}): loss {out.last_loss:.4f}  "
                         f"lr {lr:.4g}  grad_norm {norm.item():.3g}  {rate:.0f} samples/s")
            if trainer.eval_every and out.steps % trainer.eval_every == 0:
                validate_now(epoch)
            if out.steps == plan.total_steps:
                break
        if trainer.eval_every is None or (out.steps == plan.total_steps and out.steps % trainer.eval_every):
            validate_now(epoch)
    bar.close()
    out.seconds = time.perf_counter() - start
    return out


def train(world: World, cfg: DictConfig, run_dir: Path) -> Outcome:
    """One rank's training: config.yaml, metrics.jsonl and checkpoints/last.pt go into run_dir (from rank 0)."""
    device = dist.worker_device(resolve_device(cfg.trainer.device), world)
    dist.init_process_group(world, device)
    main_dir = Path(dist.broadcast_from_main(str(run_dir), world))
    if main_dir != run_dir:  # torchrun: this rank's Hydra may have timed its directory a second later
        dist.remove_stray_run_dir(run_dir)
    run_dir = main_dir
    r = setup(cfg, world, device)
    if world.main:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    metrics = MetricsLog(run_dir / "metrics.jsonl" if world.main else None)
    try:
        out = fit(r, metrics)
    finally:
        metrics.close()
    if world.main:
        checkpoint.save_atomic(
            dict(model=r.model.state_dict(), optimizer=r.optimizer.state_dict(), scheduler=r.scheduler.state_dict(),
                 step=out.steps, epoch=r.plan.total_epochs,
                 config=OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)),
            run_dir / "checkpoints" / "last.pt",
        )
        log.info(summary_line(out.steps, out.samples, out.seconds, out.last_loss, out.best_acc, out.best_step))
        log.info(f"outputs in {run_dir}")
    return out


def run(cfg: DictConfig, run_dir: Path, log_config: Optional[dict] = None) -> None:
    """Train as configured: in this process, in `devices` spawned workers, or as one rank of torchrun's world."""
    validate(cfg)
    device = resolve_device(cfg.trainer.device)
    world = dist.torchrun_world()
    if world is not None:
        if not world.main:
            dist.quiet_logging(world.rank)
        if cfg.devices not in ("auto", world.size):
            raise UserError(f"devices={cfg.devices} but torchrun started {world.size} processes: leave devices=auto "
                            f"or set devices={world.size}")
        train(world, cfg, run_dir)
        return
    n = dist.count_devices(cfg.devices, device.type)
    if n == 1:
        train(World(), cfg, run_dir)
    else:
        log.info(f"launching {n} worker processes ({'NCCL' if device.type == 'cuda' else 'gloo'})")
        dist.spawn(n, train, (cfg, run_dir), log_config)
