"""The recipe: build everything from the config, then windows → accumulate → one optimizer step → log/evaluate."""
from __future__ import annotations

import functools
import logging
import math
import random
import signal
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

from accutrain import check, checkpoint, data, dist, lr_scaling, memory, models
from accutrain.config import Normalize, OnNonFinite, load_target, validate
from accutrain.dist import World
from accutrain.errors import Preempted, UserError
from accutrain.metrics import MetricsLog, progress_bar, summary_line
from accutrain.plan import BatchPlan, derive_accum, make_plan
from accutrain.precision import Precision, make_precision
from accutrain.resume import Progress, checkpoint_state, find_resume, keep_metrics_until, restore
from accutrain.signals import StopRequest
from accutrain.step import accumulate, count_terms, evaluate, grad_norm, resplit, summed_cross_entropy
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
    precision: Precision
    buffers: Optional[memory.GradBuffers]  # gradients summed outside .grad (accum_dtype / offload_grads)
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # summed over the micro-batch's terms
    elements: bool  # loss.normalize=elements: the window's mean is over its elements, not its samples


def setup(cfg: DictConfig, world: World = World(), device: Optional[torch.device] = None,
          cache_dir: Optional[Path] = None) -> Run:
    validate(cfg)
    trainer = cfg.trainer
    device = device or resolve_device(trainer.device)
    seed_everything(cfg.seed)
    make_data, data_kwargs = factory_kwargs("data", cfg.data, "num_workers")
    with main_first(world):
        datasets: data.Datasets = make_data(**data_kwargs)
    precision = make_precision(trainer.precision, device)

    torch.manual_seed(cfg.seed)  # the initial weights depend on the seed only
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    example = default_collate([datasets.train[i] for i in range(min(2, len(datasets.train)))])
    model = models.build_model(model_cfg, datasets.sample_shape, datasets.num_classes, datasets.extra, example)
    if world.size > 1 and model_cfg.get("sync_batchnorm"):
        if device.type != "cuda":
            raise UserError("model.sync_batchnorm=true needs CUDA devices: PyTorch's SyncBatchNorm does not run on "
                            "the CPU (use devices=1, or model.sync_batchnorm=false)")
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if trainer.activation_checkpointing:
        wrapped = memory.enable_activation_checkpointing(model)
        if wrapped:
            log.info(f"activation checkpointing: {wrapped} blocks recompute their activations in backward")
        else:
            log.warning("trainer.activation_checkpointing=true does nothing for this model: it has no blocks to "
                        "wrap (modules with parameters inside an nn.Sequential or nn.ModuleList)")
    model = model.to(device=device, dtype=precision.param_dtype)
    log.info(f"model {cfg.model.get('name', cfg.model._target_)}: {models.count_parameters(model):,} parameters, "
             f"on {device}" + (f" × {world.size} ranks" if world.size > 1 else "")
             + (f", precision {precision.name}" if precision.name != "32" else ""))
    buffers = make_grad_buffers(trainer, model, precision, device, world)

    make_optimizer, optim_kwargs = factory_kwargs("optim", cfg.optim, *lr_scaling.KEYS)
    optimizer = make_optimizer(model, **optim_kwargs)  # the lr is set below, once the effective batch is known
    micro_batch = cfg.micro_batch
    if micro_batch == "auto":
        micro_batch = auto_micro_batch(cfg, model, optimizer, precision, datasets, device, world, cache_dir)
    plan = make_plan(
        micro_batch=micro_batch, accum=cfg.accum, devices=world.size, global_batch=cfg.global_batch,
        train_size=len(datasets.train), last_window=trainer.last_window,
        epochs=trainer.epochs, max_steps=trainer.max_steps,
    )
    for line in plan.describe():
        log.info(line)
    log.info(data.describe_split_sizes(datasets))
    scaling = (cfg.optim.lr, plan.effective, cfg.optim.lr_scaling, cfg.optim.base_batch)
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] = lr_scaling.scaled_lr(*scaling)
    if line := lr_scaling.describe(*scaling):
        log.info(line)
    make_scheduler, sched_kwargs = factory_kwargs("sched", cfg.sched)
    scheduler = make_scheduler(optimizer, total_steps=plan.total_steps, **sched_kwargs)

    forward, no_sync, comm = model, nullcontext, None
    if world.size > 1:
        forward = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                          gradient_as_bucket_view=True)
        comm = dist.CommStats(process_group=None)
        forward.register_comm_hook(comm, dist.counting_allreduce_hook)
        no_sync = forward.no_sync

    pin = device.type == "cuda"
    sampler = WindowSampler(plan, cfg.seed, world.rank, world.size)
    # The loader draws its workers' seeds from its own generator, never from the global RNG that dropout uses.
    loader = data.train_loader(datasets.train, sampler, cfg.data.num_workers, pin,
                               generator=torch.Generator().manual_seed(cfg.seed))
    val_share = Subset(datasets.val, range(world.rank, len(datasets.val), world.size))  # no padding: exact
    val_loader = data.eval_loader(val_share, trainer.eval_batch or plan.micro_batch, cfg.data.num_workers, pin)
    empty_batch = [t[:0] for t in default_collate([datasets.train[0]])]
    elements = cfg.loss.normalize in (Normalize.elements, Normalize.tokens)
    loss = functools.partial(summed_cross_entropy, ignore_index=cfg.loss.ignore_index)
    warn_about_batchnorm(model, plan, world, model_cfg)
    return Run(cfg, world, plan, device, model, forward, no_sync, comm, optimizer, scheduler, sampler, loader,
               val_loader, empty_batch, precision, buffers, loss, elements)


def warn_about_batchnorm(model: nn.Module, plan: BatchPlan, world: World, model_cfg: dict) -> None:
    """BatchNorm in training mode computes its statistics per micro-batch: say so when that is not the window."""
    norms = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training for m in model.modules())
    synced = world.size > 1 and model_cfg.get("sync_batchnorm")
    seen = plan.micro_batch * (world.size if synced else 1)  # the samples one BatchNorm statistic is taken over
    if norms and seen < plan.effective:
        log.warning(f"{norms} BatchNorm layers take their statistics over {seen} samples, not the window's "
                    f"{plan.effective}: the accumulated step is not exactly the big batch's (accutrain-check "
                    f"measures by how much). Remedies: {check.REMEDIES}")


def setup_for_check(cfg: DictConfig) -> Run:
    """The run accutrain-check inspects: one process, every device's micro-batches of a window taken in turn."""
    validate(cfg)
    cfg = cfg.copy()
    devices = dist.count_devices(cfg.devices, resolve_device(cfg.trainer.device).type)
    if cfg.micro_batch != "auto":
        cfg.accum = derive_accum(cfg.micro_batch, devices, cfg.accum, cfg.global_batch) * devices
        cfg.global_batch = None
    cfg.devices = 1
    return setup(cfg)


def make_grad_buffers(trainer: DictConfig, model: nn.Module, precision: Precision, device: torch.device,
                      world: World) -> Optional[memory.GradBuffers]:
    """Buffers for trainer.accum_dtype=float32 (half-precision weights) and trainer.offload_grads, if asked."""
    fp32 = trainer.accum_dtype == "float32" and precision.param_dtype != torch.float32
    if trainer.accum_dtype == "float32" and not fp32:
        log.info(f"trainer.accum_dtype=float32: the weights are float32 with precision {precision.name}, so "
                 "gradients already accumulate in float32")
    offload = trainer.offload_grads and device.type != "cpu"
    if trainer.offload_grads and not offload:
        log.warning("trainer.offload_grads=true does nothing on the CPU: the gradients already live in CPU memory")
    if not (fp32 or offload):
        return None
    if world.size > 1:
        raise UserError("trainer.accum_dtype=float32 and trainer.offload_grads need devices=1 in this version "
                        "(DDP all-reduces .grad, not accutrain's buffers)")
    log.info("gradients accumulate in " + " and ".join(
        (["float32 buffers"] if fp32 else []) + (["pinned CPU memory"] if offload else [])))
    return memory.GradBuffers([p for p in model.parameters() if p.requires_grad],
                              torch.float32 if fp32 else None, offload)


def auto_micro_batch(cfg: DictConfig, model: nn.Module, optimizer: torch.optim.Optimizer, precision: Precision,
                     datasets: data.Datasets, device: torch.device, world: World, cache_dir: Optional[Path]) -> int:
    """micro_batch=auto: the largest divisor of global_batch / devices whose real training step fits, found by
    trial steps (cached per model, data shape, precision, device and budget in `cache_dir`)."""
    budget = cfg.trainer.memory_budget_mb
    if device.type == "cpu" and budget is None:
        raise UserError("micro_batch=auto on the CPU needs trainer.memory_budget_mb=N: the peak memory (MiB) a "
                        "training step may reach, since the CPU has no out-of-memory error to detect")
    if cfg.global_batch % world.size:
        raise UserError(f"global_batch={cfg.global_batch} is not a multiple of devices {world.size}")
    window = cfg.global_batch // world.size
    about = dict(model=OmegaConf.to_container(cfg.model, resolve=True), shape=datasets.sample_shape,
                 precision=precision.name, device=torch.cuda.get_device_name(device) if device.type == "cuda"
                 else "cpu", budget=budget, window=window, optim=cfg.optim._target_,
                 checkpointing=cfg.trainer.activation_checkpointing)
    key, cache = memory.cache_key(**about), (cache_dir / "micro_batch_auto.json" if cache_dir else None)
    found = memory.read_cache(cache, key) if cache else None
    if found is None:
        def batch_of(size: int) -> Any:
            return default_collate([datasets.train[i % len(datasets.train)] for i in range(size)])

        loss = functools.partial(summed_cross_entropy, ignore_index=cfg.loss.ignore_index)
        fits = memory.trial(model, optimizer, precision, batch_of, device, budget, loss)
        found, notes = memory.search_micro_batch(window, fits, budget)
        log.info(f"micro_batch=auto: trial steps {'; '.join(notes)}")
        if world.size > 1:  # every rank tried on its own device: take the size that fits on all of them
            found = int(dist.all_reduce_min(torch.tensor(found, device=device), world).item())
        if cache and world.main:
            memory.write_cache(cache, key, found, f"{about['model'].get('name', about['model']['_target_'])} "
                               f"{about['shape']} {precision.name} {about['device']} window {window}")
    else:
        log.info(f"micro_batch=auto: {found}, cached in {cache}")
    return found


def load_window(window: Window, batches: Iterator, empty_batch: Any, split: int) -> list:
    """This rank's micro-batches of the window, loaded (a short window's missing share is a zero-sample batch);
    after an out-of-memory each is cut into `split` smaller ones."""
    return resplit([next(batches) if indices else empty_batch for indices in window.micro], split)


@dataclass
class Outcome:
    progress: Progress
    seconds: float  # this session's wall time in the loop
    samples: int  # samples this session trained on
    peak_mb: float  # the highest per-step peak memory of this session (MiB)
    stopped_by: Optional[str] = None  # the signal that stopped the run early
    checkpoint: Optional[Path] = None


def fit(r: Run, metrics: MetricsLog, p: Progress, save: Callable[[Progress], Optional[Path]],
        stop: StopRequest) -> Outcome:
    """Run the plan's remaining optimizer steps, one window of micro-batches each; evaluate and checkpoint."""
    trainer, plan, world = r.cfg.trainer, r.plan, r.world
    params = [param for param in r.model.parameters() if param.requires_grad]
    log_step = StepLog(r, metrics, p)
    for epoch in range(p.epoch, plan.total_epochs):
        r.sampler.set_epoch(epoch, start_window=p.window)
        batches = iter(r.loader)
        for window in r.sampler.windows():
            log_step.start()
            micro = load_window(window, batches, r.empty_batch, p.split)
            terms = window_terms(r, window, micro)  # |W|: the window's samples (or elements) on every rank
            loss_sum = accumulate_fitting(r, p, micro, terms)  # forward+backward per micro-batch, one sync
            if r.buffers:
                r.buffers.release()  # the window's summed gradients back into .grad
            if r.precision.scaler:
                r.precision.scaler.unscale_(r.optimizer)  # before the norm and clipping
            norm = grad_norm(params, trainer.grad_clip).item()  # measured, and clipped if asked, once per window
            # One small all-reduce: the window's loss summed over every rank, and whether any rank was signalled.
            loss_sum, stop_votes = dist.all_reduce_sum(torch.tensor(
                [loss_sum.item(), stop.signum is not None], dtype=torch.float64, device=r.device), world).tolist()
            loss, lr = loss_sum / terms, r.optimizer.param_groups[0]["lr"]
            skipped = optimizer_step(r, loss, norm, f"optimizer step {p.step + 1} (epoch {epoch + 1})")
            r.optimizer.zero_grad(set_to_none=True)
            p.advance(window, plan, loss, skipped)
            log_step(window, micro, terms, loss, lr, norm, skipped)

            done = p.step == plan.total_steps
            if done or (p.step % trainer.eval_every == 0 if trainer.eval_every else p.window == 0):
                run_validation(r, metrics, p)
            if done or stop_votes or (trainer.checkpoint_every and p.step % trainer.checkpoint_every == 0):
                path = save(p)
                if done or stop_votes:
                    return log_step.outcome(stop.name if stop_votes else None, path)
    return log_step.outcome(None, None)


def window_terms(r: Run, window: Window, micro: list) -> int:
    """The window's loss terms on every rank, known before the first backward: its samples, or (with
    loss.normalize=elements) its elements whose target is not ignore_index, counted and summed over ranks."""
    if not r.elements:
        return window.size
    local = torch.tensor(count_terms(micro, True, r.cfg.loss.ignore_index), device=r.device)
    terms = int(dist.all_reduce_sum(local, r.world).item())
    if terms == 0:
        raise UserError(f"window {window.index} has no element to learn from: every target equals "
                        f"loss.ignore_index={r.cfg.loss.ignore_index}")
    return terms


def accumulate_fitting(r: Run, p: Progress, micro: list, terms: int) -> torch.Tensor:
    """accumulate(); after an out-of-memory, the same window again in smaller micro-batches."""
    while True:
        try:
            return accumulate(r.forward, micro, terms, r.device, world=r.world.size, no_sync=r.no_sync,
                              precision=r.precision, loss=r.loss)
        except Exception as e:
            micro[:] = split_after_oom(r, p, micro, e)


def optimizer_step(r: Run, loss: float, norm: float, where: str) -> Optional[str]:
    """Step the optimizer and the scheduler (and the GradScaler) once for the window, or say why not:
    `nonfinite` (trainer.on_nonfinite=skip; `stop` raises) or `amp_overflow` (16-mixed lowers its scale)."""
    scaler, skipped = r.precision.scaler, None
    if not math.isfinite(loss) or (not math.isfinite(norm) and not scaler):
        skipped = "nonfinite"
        if r.cfg.trainer.on_nonfinite is OnNonFinite.stop:
            raise UserError(f"non-finite {'loss' if not math.isfinite(loss) else 'gradient'} at {where}: stopping; "
                            "the last checkpoint holds finite weights (trainer.on_nonfinite=skip skips such windows)")
    elif not math.isfinite(norm):
        skipped = "amp_overflow"  # inf/NaN in the scaled gradients: the scaler skips the step
    else:
        if scaler:
            scaler.step(r.optimizer)
        else:
            r.optimizer.step()
        r.scheduler.step()
    if scaler:
        scaler.update()
    return skipped


def run_validation(r: Run, metrics: MetricsLog, p: Progress) -> None:
    """Evaluate on the held-out split (every rank its share), log it, remember the best accuracy."""
    sums = evaluate(r.forward, r.val_loader, r.device, r.precision, r.cfg.loss.ignore_index)
    loss_sum, correct, n = dist.all_reduce_sum(sums, r.world).tolist()
    val_loss, val_acc = loss_sum / n, correct / n
    epoch = p.last_epoch
    metrics.write(dict(step=p.step, epoch=epoch + 1, val_loss=val_loss, val_acc=val_acc))
    log.info(f"step {p.step} (epoch {epoch + 1}): val_loss {val_loss:.4f}  val_acc {val_acc:.4f}")
    if p.best_acc is None or val_acc > p.best_acc:
        p.best_acc, p.best_step = val_acc, p.step


class StepLog:
    """Per optimizer step: the metrics.jsonl record, the progress bar, the periodic log line, warnings."""

    def __init__(self, r: Run, metrics: MetricsLog, p: Progress) -> None:
        self.r, self.metrics, self.p = r, metrics, p
        self.bar = progress_bar(r.plan.total_steps, p.step, r.cfg.trainer.progress and r.world.main)
        self.began, self.start_samples, self.peak, self.t0 = time.perf_counter(), p.samples, 0.0, 0.0

    def start(self) -> None:
        """A window begins: its time and its peak memory count from here."""
        self.t0 = time.perf_counter()
        memory.reset_peak(self.r.device)

    def __call__(self, window: Window, micro: list, terms: int, loss: float, lr: float, norm: float,
                 skipped: Optional[str]) -> None:
        r, p = self.r, self.p
        rate = window.size / (time.perf_counter() - self.t0)
        epoch = p.last_epoch
        record = dict(step=p.step, epoch=epoch + 1, loss=loss if math.isfinite(loss) else None,
                      samples=window.size, micro_batches=len(micro), lr=lr,
                      grad_norm=norm if math.isfinite(norm) else None, samples_per_s=rate, samples_seen=p.samples,
                      time=time.perf_counter() - self.began, peak_mem_mb=round(memory.peak_mb(r.device), 1))
        self.peak = max(self.peak, record["peak_mem_mb"])
        if r.elements:
            record["elements"] = terms
        if r.precision.scaler:
            record["amp_scale"] = r.precision.scaler.get_scale()
        if r.comm is not None:
            record["grad_syncs"], record["comm_bytes"] = r.comm.take()
        if skipped:
            record["skipped"] = skipped
            log.warning(f"step {p.step}: " + (
                "AMP overflow: the GradScaler skipped the optimizer and scheduler step and lowered its scale to "
                f"{r.precision.scaler.get_scale():g}" if skipped == "amp_overflow" else
                f"non-finite {'loss' if not math.isfinite(loss) else 'gradient'}; the window's gradients are "
                f"dropped, no optimizer step ({p.skipped} skipped so far)"))
        self.metrics.write(record)
        self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.3g}", samples_s=f"{rate:.0f}", refresh=False)
        self.bar.update()
        if p.step % r.cfg.trainer.log_every == 0:
            log.info(f"step {p.step}/{r.plan.total_steps} (epoch {epoch + 1}): loss {loss:.4f}  lr {lr:.4g}  "
                     f"grad_norm {norm:.3g}  {rate:.0f} samples/s")

    def outcome(self, stopped_by: Optional[str], checkpoint_path: Optional[Path]) -> "Outcome":
        self.bar.close()
        return Outcome(self.p, time.perf_counter() - self.began, self.p.samples - self.start_samples, self.peak,
                       stopped_by, checkpoint_path)


def split_after_oom(r: Run, p: Progress, micro: list, error: Exception) -> list:
    """After an out-of-memory mid-window: drop the partial gradients and cut the window's micro-batches in two.
    The window, hence the effective batch and the exact gradient, stay the same; accum doubles from now on."""
    if not memory.is_oom(error):
        raise error
    largest = max(len(b[0]) for b in micro)
    if largest <= 1 or r.world.size > 1:
        raise UserError(f"out of memory with micro-batches of {largest}" + (
            " on one of several devices: set micro_batch lower (or micro_batch=auto)" if r.world.size > 1 else
            ": even one sample does not fit (try trainer.activation_checkpointing=true or bf16-mixed precision)"))
    r.optimizer.zero_grad(set_to_none=True)
    if r.buffers:
        for buffer in r.buffers.buffers.values():
            buffer.zero_()
    memory.free_memory(r.device)
    p.split *= 2
    smaller = resplit(micro, 2)
    log.warning(f"out of memory with micro-batches of {largest} at optimizer step {p.step + 1}: the window is "
                f"re-split into {len(smaller)} micro-batches of at most {max(len(b[0]) for b in smaller)}; the "
                f"effective batch stays {r.plan.effective}")
    return smaller


def train(world: World, cfg: DictConfig, run_dir: Path) -> Outcome:
    """One rank's training: config.yaml, metrics.jsonl and checkpoints/ go into run_dir (written by rank 0)."""
    device = dist.worker_device(resolve_device(cfg.trainer.device), world)
    dist.init_process_group(world, device)
    main_dir = Path(dist.broadcast_from_main(str(run_dir), world))
    if main_dir != run_dir:  # torchrun: this rank's Hydra may have timed its directory a second later
        dist.remove_stray_run_dir(run_dir)
    run_dir = main_dir
    r = setup(cfg, world, device, cache_dir=run_dir.parent)
    if cfg.trainer.check and world.main:
        result = check.run_check(r)
        for line in result.lines():
            (log.info if result.faithful else log.warning)(f"check: {line}")
    resume_from = dist.broadcast_from_main(find_resume(cfg, run_dir) if world.main else None, world)
    progress = restore(r, resume_from) if resume_from else Progress()
    rotation = checkpoint.Rotation(run_dir / "checkpoints", cfg.trainer.keep_checkpoints)

    def save(p: Progress) -> Optional[Path]:
        state = checkpoint_state(r, p, cfg)
        path = None
        if world.main:
            if not all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point()):
                raise UserError(f"the weights are not finite at optimizer step {p.step}: no checkpoint written "
                                f"(the last good one is {rotation.steps()[0] if rotation.steps() else 'none'})")
            path = rotation.save(state, p.step)
        if world.size > 1:
            torch.distributed.barrier()  # no rank leaves before the checkpoint is on disk
        return path

    if world.main:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        if resume_from:
            keep_metrics_until(run_dir / "metrics.jsonl", progress.step)
    metrics = MetricsLog(run_dir / "metrics.jsonl" if world.main else None)
    try:
        with StopRequest(announce=world.main) as stop:
            out = fit(r, metrics, progress, save, stop)
    finally:
        metrics.close()
    p = out.progress
    if world.main:
        log.info(summary_line(p.step, p.samples, out.samples, out.seconds, p.last_loss, p.best_acc, p.best_step,
                              out.peak_mb)
                 + (f", {p.skipped} non-finite windows skipped" if p.skipped else ""))
        if out.stopped_by:
            log.warning(f"stopped by {out.stopped_by} after optimizer step {p.step} of {r.plan.total_steps}; "
                        f"checkpoint {out.checkpoint}. Resume with the same command plus: resume=auto "
                        f"hydra.run.dir={run_dir}")
        else:
            log.info(f"outputs in {run_dir}")
    return out


def run(cfg: DictConfig, run_dir: Path, log_config: Optional[dict] = None) -> Outcome:
    """Train as configured; raise Preempted if a signal stopped the run early (after its checkpoint)."""
    out = launch(cfg, run_dir, log_config)
    if out is not None and out.stopped_by:
        signum = signal.Signals[out.stopped_by]
        raise Preempted(signum, f"stopped by {out.stopped_by} after optimizer step {out.progress.step}; "
                                f"checkpoint {out.checkpoint}")
    return out


def launch(cfg: DictConfig, run_dir: Path, log_config: Optional[dict]) -> Outcome:
    """Train in this process, in `devices` spawned workers, or as one rank of torchrun's world."""
    validate(cfg)
    device = resolve_device(cfg.trainer.device)
    world = dist.torchrun_world()
    if world is not None:
        if not world.main:
            dist.quiet_logging(world.rank)
        if cfg.devices not in ("auto", world.size):
            raise UserError(f"devices={cfg.devices} but torchrun started {world.size} processes: leave devices=auto "
                            f"or set devices={world.size}")
        return train(world, cfg, run_dir)
    n = dist.count_devices(cfg.devices, device.type)
    if n == 1:
        return train(World(), cfg, run_dir)
    log.info(f"launching {n} worker processes ({'NCCL' if device.type == 'cuda' else 'gloo'})")
    return dist.spawn(n, train, (cfg, run_dir), log_config)
