"""The recipe: build everything from the config, then windows → accumulate → one optimizer step → log/evaluate."""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils.data import DataLoader

from accutrain import checkpoint, data, lr_scaling, models
from accutrain.config import load_target, validate
from accutrain.errors import UserError
from accutrain.metrics import MetricsLog, progress_bar, summary_line
from accutrain.plan import BatchPlan, make_plan
from accutrain.step import accumulate, evaluate, grad_norm
from accutrain.windows import WindowSampler

log = logging.getLogger("accutrain")


def resolve_device(name: str) -> torch.device:
    """`auto` is CUDA when visible, else the CPU; an unusable choice is one clear line."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"trainer.device={name!r} is not valid: expected auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"trainer.device={name} but no CUDA device is visible: use trainer.device=cpu (or auto)")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UserError(f"trainer.device={name} but only {torch.cuda.device_count()} CUDA device(s) are visible")
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"trainer.device={name!r} is not supported: expected auto, cpu, cuda or cuda:N")
    return device


def resolve_devices(devices: Any) -> int:
    if devices == "auto":
        return 1
    if devices > 1:
        raise UserError(f"devices={devices} is not yet supported: this version trains on one device (devices=1)")
    return devices


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


@dataclass
class Run:
    """Everything the loop needs, built from the config."""

    cfg: DictConfig
    plan: BatchPlan
    device: torch.device
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: WindowSampler
    loader: DataLoader
    val_loader: DataLoader


def setup(cfg: DictConfig) -> Run:
    validate(cfg)
    devices = resolve_devices(cfg.devices)
    device = resolve_device(cfg.trainer.device)
    seed_everything(cfg.seed)
    make_data, data_kwargs = factory_kwargs("data", cfg.data, "num_workers")
    datasets: data.Datasets = make_data(**data_kwargs)
    plan = make_plan(
        micro_batch=cfg.micro_batch, accum=cfg.accum, devices=devices, global_batch=cfg.global_batch,
        train_size=len(datasets.train), last_window=cfg.trainer.last_window,
        epochs=cfg.trainer.epochs, max_steps=cfg.trainer.max_steps,
    )
    for line in plan.describe():
        log.info(line)
    log.info(data.describe_split_sizes(datasets))

    torch.manual_seed(cfg.seed)  # the initial weights depend on the seed only
    model = models.build_model(OmegaConf.to_container(cfg.model, resolve=True), datasets.sample_shape,
                               datasets.num_classes).to(device)
    log.info(f"model {cfg.model.get('name', cfg.model._target_)}: {models.count_parameters(model):,} parameters, "
             f"on {device}")
    make_optimizer, optim_kwargs = factory_kwargs("optim", cfg.optim, *lr_scaling.KEYS)
    scaling = (cfg.optim.lr, plan.effective, cfg.optim.lr_scaling, cfg.optim.base_batch)
    optim_kwargs["lr"] = lr_scaling.scaled_lr(*scaling)
    if line := lr_scaling.describe(*scaling):
        log.info(line)
    optimizer = make_optimizer(model, **optim_kwargs)
    make_scheduler, sched_kwargs = factory_kwargs("sched", cfg.sched)
    scheduler = make_scheduler(optimizer, total_steps=plan.total_steps, **sched_kwargs)

    pin = device.type == "cuda"
    sampler = WindowSampler(plan, cfg.seed)
    loader = data.train_loader(datasets.train, sampler, cfg.data.num_workers, pin)
    val_loader = data.eval_loader(datasets.val, cfg.trainer.eval_batch or cfg.micro_batch, cfg.data.num_workers, pin)
    return Run(cfg, plan, device, model, optimizer, scheduler, sampler, loader, val_loader)


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
    trainer, plan = r.cfg.trainer, r.plan
    params = [p for p in r.model.parameters() if p.requires_grad]
    out = Outcome()
    bar = progress_bar(plan.total_steps, 0, trainer.progress)
    start = time.perf_counter()

    def validate_now(epoch: int) -> None:
        val_loss, val_acc = evaluate(r.model, r.val_loader, r.device)
        metrics.write(dict(step=out.steps, epoch=epoch + 1, val_loss=val_loss, val_acc=val_acc))
        log.info(f"step {out.steps} (epoch {epoch + 1}): val_loss {val_loss:.4f}  val_acc {val_acc:.4f}")
        if out.best_acc is None or val_acc > out.best_acc:
            out.best_acc, out.best_step = val_acc, out.steps

    for epoch in range(plan.total_epochs):
        r.sampler.set_epoch(epoch)
        batches = iter(r.loader)
        for window in r.sampler.windows():
            t0 = time.perf_counter()
            loss_sum = accumulate(r.model, (next(batches) for _ in window.micro), len(window.micro),
                                  window.size, r.device)
            norm = grad_norm(params, trainer.grad_clip)  # measured, and clipped if asked, once per window
            lr = r.optimizer.param_groups[0]["lr"]
            r.optimizer.step()
            r.scheduler.step()
            r.optimizer.zero_grad(set_to_none=True)
            out.steps, out.samples = out.steps + 1, out.samples + window.size
            out.last_loss = loss_sum.item() / window.size  # the sample-weighted mean over the window
            rate = window.size / (time.perf_counter() - t0)
            metrics.write(dict(step=out.steps, epoch=epoch + 1, loss=out.last_loss, samples=window.size,
                               micro_batches=len(window.micro), lr=lr, grad_norm=norm.item(), samples_per_s=rate,
                               samples_seen=out.samples, time=time.perf_counter() - start))
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


def train(cfg: DictConfig, run_dir: Path) -> Outcome:
    """Train as configured, writing config.yaml, metrics.jsonl and checkpoints/last.pt into run_dir."""
    r = setup(cfg)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    metrics = MetricsLog(run_dir / "metrics.jsonl")
    try:
        out = fit(r, metrics)
    finally:
        metrics.close()
    checkpoint.save_atomic(
        dict(model=r.model.state_dict(), optimizer=r.optimizer.state_dict(), scheduler=r.scheduler.state_dict(),
             step=out.steps, epoch=r.plan.total_epochs,
             config=OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)),
        run_dir / "checkpoints" / "last.pt",
    )
    log.info(summary_line(out.steps, out.samples, out.seconds, out.last_loss, out.best_acc, out.best_step))
    log.info(f"outputs in {run_dir}")
    return out
