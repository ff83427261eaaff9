"""From the typed config to everything the loop needs: data, model, optimizer, scheduler, the batch plan, the
window loader, and how the ranks share the model (the strategy: DDP or FSDP). Each part comes from a small
factory chosen by the config."""
from __future__ import annotations

import dataclasses
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils.data import Subset

from accutrain import dist
from accutrain.config.targets import instantiate, record, run_arguments
from accutrain.config.train import TrainerConfig
from accutrain.config.validate import NOISE_SCALE_NEEDS_TWO
from accutrain.core import compiled, lr_scaling
from accutrain.core.batches import BatchFormat
from accutrain.core.grad_buffers import grad_buffer_spec
from accutrain.core.mixing import make_mixer
from accutrain.core.monitor import Monitor
from accutrain.core.noise_scale import NoiseScale
from accutrain.core.plan import BatchPlan, make_plan
from accutrain.core.precision import Precision, make_precision, scale_in_use
from accutrain.core.token_budget import TokenLengths
from accutrain.core.windows import WindowSampler, window_loader
from accutrain.data import datasets as data
from accutrain.data import checks as data_checks
from accutrain.data.lengths import token_lengths
from accutrain.dist import World
from accutrain.errors import UserError
from accutrain.models import factories as models
from accutrain.models.losses import attach, build_loss, check_targets
from accutrain.models import norms, pitfalls
from accutrain.models.checkpointing import enable_activation_checkpointing
from accutrain.models.ema import make_ema
from accutrain.parallel.strategy import Strategy
from accutrain.seeding import seed_everything
from accutrain.train.auto_batch import auto_micro_batch
from accutrain.train.components import Components

log = logging.getLogger("accutrain")


def build(cfg: DictConfig, world: World, device: torch.device, cache_dir: Optional[Path] = None) -> Components:
    """Build the run's components on this rank's `device`. The config was validated by the caller."""
    trainer = cfg.trainer
    seed_everything(cfg.seed)  # the initial weights depend on the seed only: the data is made on a fork of the RNG
    # Each factory node (data, model, optim, sched) records the arguments the run supplies before it is instantiated,
    # so that the run's config.yaml holds the whole call (hydra.utils.instantiate rebuilds each part from it).
    record(cfg.data, run_arguments("data", cfg.data, dict(seed=cfg.seed)))  # the run's seed, unless given
    with main_first(world), torch.random.fork_rng(devices=[]):
        made = instantiate("data", cfg.data)
    # Its views (augment=) and batch format, the data checked once: what it is, its first window, its targets.
    datasets, batches = data_checks.prepare(made, cfg)
    precision = make_precision(trainer.precision, device)
    strategy = make_strategy(cfg, world, device, precision)
    # FSDP shards the model built in CPU memory, each rank moving only its shards to the device.
    model = strategy.prepare(build_model(cfg, datasets, batches, world, device, precision, strategy))
    loss = build_loss(cfg.loss, model)  # loss=: summed per term, |W| counted from the targets
    check_targets(loss, batches([datasets.train[0]]).target, cfg.data._target_)
    first_inputs = batches([datasets.train[0]]).inputs
    if getattr(loss, "per_sequence", False) and isinstance(first_inputs, dict) and "document_ids" in first_inputs:
        raise UserError("loss.normalize=sequences averages each sample's tokens, and data.packing=true makes a sample "
                        "a block of several documents: use data.packing=false with loss.normalize=sequences")
    attach(loss, model, cfg)  # a window-level loss: its refusals, its learnt temperature
    mixer = make_mixer(cfg.augment, cfg.seed, datasets.num_classes, datasets.train[0])
    if getattr(loss, "shift_labels", False) and batches([datasets.train[0]]).target.dim() < 2:
        raise UserError("loss.shift_labels=true needs a target per token (labels = input_ids); this data has one "
                        "target per sample")
    if trainer.export in ("hf", "merged") and not hasattr(model, "save_pretrained"):
        raise UserError(f"trainer.export={trainer.export} needs a Hugging Face model (model=hf_causal_lm or "
                        f"model=hf_seq_cls), not {cfg.model._target_}; trainer.export=weights saves any model's "
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
    buffers = spec.build(model) if spec else None
    synced = world.size > 1 and cfg.batchnorm.sync
    if synced:  # CUDA only: launch refuses it on the CPU
        norms.sync_batchnorm(model)
    plan = make_plan(
        micro_batch=micro_batch, accum=cfg.accum, devices=world.size, global_batch=cfg.global_batch,
        train_size=len(datasets.train), last_window=trainer.last_window,
        epochs=trainer.epochs, max_steps=trainer.max_steps, schedule=cfg.get("batch_schedule"),
        micro_tokens=cfg.get("micro_tokens"),
    )
    tokens = token_lengths(datasets, batches, plan.micro_tokens)  # token data: micro_tokens' cut, padding figures
    for line in plan.describe():
        log.info(line)
    log.info(data.describe_split_sizes(datasets))
    for group in optimizer.param_groups:  # scaling.lr applies at each optimizer step, for its window's batch
        group["lr"] = group["initial_lr"] = cfg.optim.lr
    if line := lr_scaling.describe(cfg.optim.lr, plan.effective, cfg.scaling.lr, cfg.scaling.base_batch):
        log.info(line + ("; each window's scheduled batch scales its own step" if plan.schedule else ""))
    record(cfg.sched, dict(total_steps=plan.total_steps))
    scheduler = instantiate("sched", cfg.sched, optimizer)

    if trainer.compile:  # in place, once: after the search and the buffers' hooks, before DDP wraps it
        compiled.compile_model(model, trainer.compile_mode, trainer.compile_backend)
        log.info(f"torch.compile (backend {trainer.compile_backend}, mode {trainer.compile_mode or 'default'}): the "
                 "model compiles at its first micro-batch; micro-batches of 0 or 1 samples and evaluation run eager")
    wrapped = strategy.wrap(model)
    for line in strategy.describe():
        log.info(line)

    pin = device.type == "cuda"
    sampler = WindowSampler(plan, cfg.seed, world.rank, world.size, mixer, tokens)  # MixUp/CutMix drawn per window
    # The loaders draw their workers' seeds from generators of their own, never from the global RNG that dropout uses.
    # An empty share becomes a stand-in batch, but for SyncBatchNorm, which takes zero samples (and would
    # otherwise mix the stand-in into the other ranks' statistics), and for FSDP, whose every forward and backward
    # communicates (a skipped stand-in would leave the other ranks waiting) and which takes zero samples.
    workers = data.loader_workers(cfg.loader.num_workers, datasets, world.size)
    loader = window_loader(datasets.train, sampler, workers, pin,
                           generator=torch.Generator().manual_seed(cfg.seed), batch_format=batches,
                           stand_in=not synced and not strategy.lockstep)
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
    typed_trainer = OmegaConf.to_object(trainer)  # the schema's dataclass: no OmegaConf lookup past the build
    scaling = lr_scaling.BatchScaling(cfg.scaling.lr, cfg.scaling.base_batch, cfg.scaling.beta2, cfg.scaling.ema)
    return Components(cfg, typed_trainer, scaling, world, plan, device, model, wrapped, strategy, optimizer, scheduler,
                      sampler, loader, val_loader, precision, buffers, loss, make_ema(trainer, model),
                      Monitor.from_config(trainer, loss.task, loss.monitor), datasets.tokenizer,
                      make_noise_scale(typed_trainer, model, world, device, precision, plan, loss.elements),
                      test_loader)


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
    if elements:
        raise UserError("trainer.noise_scale=true measures gradients per sample; this loss averages over elements "
                        "(tokens): set loss.normalize=samples or trainer.noise_scale=false")
    if plan.schedule is None and plan.accum == 1 and world.size == 1:
        raise UserError(NOISE_SCALE_NEEDS_TWO)
    params = [p for p in model.parameters() if p.requires_grad]
    return NoiseScale(params, world, device, trainer.noise_scale_decay, lambda: scale_in_use(precision.scaler))


def build_model(cfg: DictConfig, datasets: data.Datasets, batches: BatchFormat, world: World, device: torch.device,
                precision: Precision, strategy: Optional[Strategy] = None) -> nn.Module:
    """The model sized to the data (the data's arguments recorded in its node), its BatchNorm layers as
    `batchnorm.convert` asks, activation checkpointing, on the device (in CPU memory for FSDP, which moves each
    rank's shards to the device; SyncBatchNorm comes later, in build, once micro_batch=auto has searched)."""
    record(cfg.model, models.data_arguments(cfg.model, datasets.sample_shape, datasets.num_classes, datasets.extra))
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    example = batches([datasets.train[i] for i in range(min(2, len(datasets.train)))])
    if cfg.augment.views > 1:  # pairs of views: the model embeds one view at a time
        example = dataclasses.replace(example, inputs=example.inputs[:, 0])
    target = str(model_cfg.get("_target_"))
    if isinstance(example.inputs, dict) and "document_ids" in example.inputs and \
            target.startswith("accutrain.models.") and target != "accutrain.models.hf.causal_lm":
        raise UserError(f"data.packing=true keeps each packed document's positions and attention to itself, which "
                        f"model {models.model_name(model_cfg)} cannot take (document_ids): use model=hf_causal_lm, or "
                        "data.packing=concat (attention crossing documents)")
    model = models.build_model(model_cfg, datasets.sample_shape, datasets.num_classes, datasets.extra, example)
    norms.convert_norm(model, cfg.batchnorm.convert, cfg.batchnorm.groups)
    if cfg.trainer.activation_checkpointing:
        if wrapped := enable_activation_checkpointing(model):
            log.info(f"activation checkpointing: {wrapped} blocks recompute their activations in backward")
        else:
            log.warning("trainer.activation_checkpointing=true does nothing for this model: it has no blocks to "
                        "wrap (modules with parameters inside an nn.Sequential or nn.ModuleList)")
    if strategy is not None:
        strategy.check_model(model, cfg)
    model = model.to(device=strategy.model_device(device) if strategy else device, dtype=precision.param_dtype)
    log.info(f"model {models.model_name(model_cfg)}: {models.count_parameters(model):,} parameters, "
             f"on {device}" + (f" × {world.size} ranks" if world.size > 1 else "")
             + (f", precision {precision.name}" if precision.name != "32" else ""))
    return model


@contextmanager
def main_first(world: World) -> Iterator[None]:
    """Rank 0 runs the block first (a download, say), the other ranks after it."""
    if not world.main:
        dist.wait_for_main(world)
    yield
    if world.main:
        dist.wait_for_main(world)


def make_strategy(cfg: DictConfig, world: World, device: torch.device, precision: Precision) -> Strategy:
    """The strategy `strategy=` names, for this rank (FSDP's module is imported only when it is chosen)."""
    if cfg.strategy.name == "fsdp":
        from accutrain.parallel.fsdp import FSDP

        return FSDP(cfg.strategy, world, device, precision)
    return Strategy(world, device)
