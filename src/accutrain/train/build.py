"""From the typed run to everything the loop needs: data, model, optimizer, scheduler, the batch plan, the window
loader, and how the ranks share the model (the strategy: DDP or FSDP). Each part comes from a small factory chosen
by the config; the arguments the run supplies to the factories (data-derived sizes, data.seed, sched.total_steps)
are recorded in `Components.supplied`, the run's config left as the command line typed it."""
from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import torch
from torch import nn
from torch.utils.data import Subset

from accutrain import dist
from accutrain.config.refusals import NOISE_SCALE_NEEDS_TWO
from accutrain.config.targets import instantiate, run_arguments
from accutrain.config.train import TrainConfig, TrainerConfig
from accutrain.core import compiled, lr_scaling
from accutrain.core.grad_buffers import grad_buffer_spec
from accutrain.core.loader import window_loader
from accutrain.core.mixing import make_mixer
from accutrain.core.plan import BatchPlan, make_plan
from accutrain.core.precision import Precision, make_precision, scale_in_use
from accutrain.core.streams import StreamSampler
from accutrain.core.token_budget import TokenLengths
from accutrain.core.windows import WindowSampler
from accutrain.data import checks as data_checks
from accutrain.data import datasets as data
from accutrain.data.lengths import token_lengths
from accutrain.dist import World
from accutrain.errors import UserError
from accutrain.models import losses, norms, pitfalls
from accutrain.models.ema import make_ema
from accutrain.seeding import seed_everything
from accutrain.train.auto_batch import auto_micro_batch
from accutrain.train.auto_tokens import auto_micro_tokens
from accutrain.train.build_model import build_model, make_strategy
from accutrain.train.components import Components
from accutrain.train.monitor import Monitor
from accutrain.train.noise_scale import NoiseScale

log = logging.getLogger("accutrain")


def build(cfg: TrainConfig, world: World, device: torch.device, cache_dir: Optional[Path] = None) -> Components:
    """Build the run's components on this rank's `device`. The run was checked by the command line."""
    trainer = cfg.trainer
    seed_everything(cfg.seed)  # the initial weights depend on the seed only: the data is made on a fork of the RNG
    supplied = {"data": run_arguments("data", cfg.data, dict(seed=cfg.seed))}  # the run's seed, unless given
    with main_first(world), torch.random.fork_rng(devices=[]):
        made = instantiate("data", cfg.data.node(supplied["data"]))
    # Its views (augment=) and batch format, the data checked once: what it is, its first window, its targets.
    datasets, batches = data_checks.prepare(made, cfg)
    precision = make_precision(trainer.precision, device, trainer.channels_last)
    strategy = make_strategy(cfg, world, device, precision)
    # FSDP shards the model built in CPU memory, each rank moving only its shards to the device.
    model, loss, built, base = build_model(cfg, datasets, batches, world, device, precision, strategy)
    supplied.update({node: arguments for node, arguments in built.items() if arguments})
    if trainer.channels_last:  # the images follow (precision.inputs); the same sums, in another order
        model = model.to(memory_format=torch.channels_last)
    model = strategy.prepare(model)
    losses.attach(loss, model)  # a learnt temperature: a parameter of the model, before the optimizer
    mixer = make_mixer(cfg.augment, cfg.seed, datasets.num_classes, datasets.train[0])
    if trainer.export in ("hf", "merged") and not hasattr(model, "save_pretrained"):
        raise UserError(f"trainer.export={trainer.export} needs a Hugging Face model (model=hf_causal_lm or "
                        f"model=hf_seq_cls), not {cfg.model.target}; trainer.export=weights saves any model's "
                        "weights")
    if trainer.export == "merged" and not getattr(model, "adapted", False):
        raise UserError("trainer.export=merged merges an adapter into the model: it needs model.adapter=lora "
                        "(trainer.export=hf saves a model trained whole)")

    optimizer = instantiate("optim", cfg.optim, model)  # scaling.lr scales its lr per window (below)
    if cfg.scaling.beta2.name != "none" and "betas" not in optimizer.param_groups[0]:
        raise UserError(f"scaling.beta2={cfg.scaling.beta2.name} scales Adam's β2, and the optimizer "
                        f"{type(optimizer).__name__} has no betas: use optim=adamw or scaling.beta2=none")
    spec = grad_buffer_spec(trainer, precision, device, world.size)
    micro_batch = cfg.micro_batch
    if micro_batch == "auto":  # before SyncBatchNorm (no rank waits in a trial's collective) and the buffers' hooks
        micro_batch = auto_micro_batch(cfg, model, optimizer, precision, datasets, device, world, loss, cache_dir,
                                       spec)
    micro_tokens = cfg.micro_tokens
    if micro_tokens == "auto":  # the same place: trial steps before the buffers' hooks and compiling
        window = cfg.global_batch or micro_batch * (cfg.accum or 1) * world.size  # the cut is of the whole window
        micro_tokens = auto_micro_tokens(cfg, model, optimizer, precision, datasets, device, world, loss,
                                         token_lengths(datasets, batches, None, "micro_tokens=auto"), window,
                                         cache_dir, spec)
    buffers = spec.build(model) if spec else None
    synced = world.size > 1 and cfg.batchnorm.sync
    if synced:  # CUDA only: launch refuses it on the CPU
        norms.sync_batchnorm(model)
    plan = make_plan(
        micro_batch=micro_batch, accum=cfg.accum, devices=world.size, global_batch=cfg.global_batch,
        train_size=None if datasets.stream is not None else len(datasets.train), last_window=trainer.last_window,
        epochs=trainer.epochs, max_steps=trainer.max_steps, schedule=cfg.batch_schedule,
        micro_tokens=micro_tokens,
    )
    if (fewest := plan.smallest_window()) < loss.min_window:
        raise UserError(f"loss={loss.name} needs {loss.min_window} or more samples in every window, and "
                        + (f"the effective batch is {fewest}: set a larger one (global_batch=N)" if fewest ==
                           plan.effective else f"each epoch ends with a window of {fewest} ({plan.train_size} "
                           f"training samples, windows of {plan.effective}): set trainer.last_window=drop, or an "
                           "effective batch that leaves a larger remainder"))
    tokens = token_lengths(datasets, batches, plan.micro_tokens)  # token data: micro_tokens' cut, padding figures
    if datasets.stream is not None and plan.micro_tokens is not None and plan.micro_tokens < datasets.sample_shape[0]:
        raise UserError(f"micro_tokens={plan.micro_tokens} is less than data.max_length={datasets.sample_shape[0]}: "
                        "a stream's samples are seen only as it is read, so the budget must hold the longest any can "
                        f"be; set micro_tokens ≥ {datasets.sample_shape[0]} (or a smaller data.max_length)")
    for line in plan.describe():
        log.info(line)
    if tokens is not None and tokens.free:
        log.info("data.padding=free: each micro-batch is one row of its samples' tokens end to end, no padding (a "
                 "budget counts real tokens), each document with its own positions and attention")
    log.info(data.describe_split_sizes(datasets))
    for group in optimizer.param_groups:  # scaling.lr applies at each optimizer step, for its window's batch
        group["lr"] = group["initial_lr"] = cfg.optim["lr"]
    if line := lr_scaling.describe(cfg.optim["lr"], plan.effective, cfg.scaling.lr, cfg.scaling.base_batch):
        log.info(line + ("; each window's scheduled batch scales its own step" if plan.schedule else ""))
    supplied["sched"] = run_arguments("sched", cfg.sched, dict(total_steps=plan.total_steps))
    scheduler = instantiate("sched", cfg.sched.node(supplied["sched"]), optimizer)

    if trainer.compile:  # in place, once: after the search and the buffers' hooks, before DDP wraps it
        compiled.compile_model(model, trainer.compile_mode, trainer.compile_backend)
        log.info(f"torch.compile (backend {trainer.compile_backend}, mode {trainer.compile_mode or 'default'}): the "
                 "model compiles at its first micro-batch; micro-batches of 0 or 1 samples and evaluation run eager")
    wrapped = strategy.wrap(model)
    for line in strategy.describe():
        log.info(line)

    pin = device.type == "cuda"
    sampler = (WindowSampler(plan, cfg.seed, world.rank, world.size, mixer, tokens) if datasets.stream is None else
               StreamSampler(plan, datasets.stream, cfg.seed, datasets.stream.buffer_size, world.rank, world.size,
                             tokens.padded_to if tokens is not None else None,
                             tokens is not None and tokens.free))  # MixUp/CutMix drawn per window
    # The loaders draw their workers' seeds from generators of their own, never from the global RNG that dropout uses.
    # An empty share becomes a stand-in batch, but for SyncBatchNorm, which takes zero samples (and would
    # otherwise mix the stand-in into the other ranks' statistics), and for FSDP, whose every forward and backward
    # communicates (a skipped stand-in would leave the other ranks waiting) and which takes zero samples.
    workers = data.loader_workers(cfg.loader.num_workers, datasets, world.size)
    loader = window_loader(datasets.train, sampler, workers, pin,
                           generator=torch.Generator().manual_seed(cfg.seed), batch_format=batches,
                           stand_in=not synced and not strategy.lockstep,
                           sample_seeds=cfg.seed if getattr(model, "sample_seeds", False) else None)  # NEFTune
    val_loader, test_loader = (None if split is None else strategy.eval_batches(
        data.eval_loader(Subset(split, range(world.rank, len(split), world.size)),  # no padding: exact
                         trainer.eval_batch or eval_rows(plan, tokens), workers, pin, cfg.seed, collate=batches),
        lambda split=split: batches([split[0]]).head(0)) for split in (datasets.val, datasets.test))
    for warning in (norms.batchnorm_warning(model, plan.micro_batch, plan.effective, world.size, synced),
                    pitfalls.dropout_warning(model, plan.micro_batch, plan.effective),
                    pitfalls.unshifted_labels_warning(loader.dataset.__getitems__(next(sampler.windows())[0])[1],
                                                      loss)):
        if warning:
            log.warning(warning)
    return Components(
        run=cfg, supplied=supplied, world=world, plan=plan, device=device, model=model, wrapped=wrapped,
        strategy=strategy, optimizer=optimizer, scheduler=scheduler, sampler=sampler, loader=loader,
        val_loader=val_loader, test_loader=test_loader, precision=precision, buffers=buffers, loss=loss,
        ema=make_ema(trainer, model), monitor=Monitor.from_config(trainer, loss.task, loss.monitor),
        lr_scaling=lr_scaling.BatchScaling(cfg.scaling.lr, cfg.scaling.base_batch, cfg.scaling.beta2, cfg.scaling.ema),
        tokenizer=datasets.tokenizer, base=base, class_names=datasets.class_names,
        noise=make_noise_scale(trainer, model, world, device, precision, plan, loss.elements))


@contextmanager
def main_first(world: World) -> Iterator[None]:
    """Rank 0 runs the block first (a download, say), the other ranks after it."""
    if not world.main:
        dist.wait_for_main(world)
    yield
    if world.main:
        dist.wait_for_main(world)


def eval_rows(plan: BatchPlan, tokens: Optional[TokenLengths]) -> int:
    """The held-out split's batch (trainer.eval_batch null): micro_batch, or with micro_tokens as many of the
    longest training sample as the budget holds."""
    if plan.micro_tokens is None or tokens is None:
        return plan.micro_batch
    return max(1, plan.micro_tokens // tokens.longest)


def make_noise_scale(trainer: TrainerConfig, model: nn.Module, world: World, device: torch.device,
                     precision: Precision, plan: BatchPlan, elements: bool) -> Optional[NoiseScale]:
    """The estimator trainer.noise_scale asks for (None when off); one line for a run it cannot measure."""
    if not trainer.noise_scale:
        return None
    if plan.schedule is None and plan.accum == 1 and world.size == 1:
        raise UserError(f"trainer.noise_scale=true cannot be combined with accum=1 on one device: {NOISE_SCALE_NEEDS_TWO}")
    params = [p for p in model.parameters() if p.requires_grad]
    return NoiseScale(params, world, device, trainer.noise_scale_decay, lambda: scale_in_use(precision.scaler))
