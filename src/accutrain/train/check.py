"""accutrain-check: is the configured run's accumulated gradient the big batch's gradient, for this model and data?

It takes the run's first window, computes the optimizer-step gradient both ways — accumulated over the configured
micro-batches (every device's, in one process) and as one batch of the whole window — and compares them per
parameter group. When they differ it names the causes it finds: BatchNorm in training mode, dropout, any other
module whose output for a sample depends on the rest of its batch, and a loss reduction that is not the mean.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any, Optional

import torch
from torch import nn

from accutrain.config.train import DDPStrategy, TrainConfig
from accutrain.config.typed import seal
from accutrain.core.batches import Batch
from accutrain.core.loss import Loss
from accutrain.core.plan import ceil_div, window_split
from accutrain.core.precision import full_float32, tolerance
from accutrain.core.windows import MicroBatch
from accutrain.dist import World, count_devices, resolve_device
from accutrain.models.norms import local_batchnorm
from accutrain.seeding import deterministic_algorithms
from accutrain.store.rng import rng_state, set_rng_state
from accutrain.train import memory
from accutrain.train.build import build
from accutrain.train.check_report import Check, causes, cpu_copy
from accutrain.train.components import Components
from accutrain.train.prepare import prepare_loss


def components_for_check(cfg: TrainConfig) -> Components:
    """The run accutrain-check inspects: one process, every device's micro-batches of a window taken in turn (the
    world is World(): `devices` only tells the check whom SyncBatchNorm would span), the whole model (FSDP's
    accumulation has the same arithmetic)."""
    device = resolve_device(cfg.trainer.device)
    devices = count_devices(cfg.devices, device.type)
    changes: dict[str, Any] = dict(devices=devices, strategy=DDPStrategy())
    if cfg.micro_batch != "auto":
        micro_batch, accum = window_split(cfg.micro_batch, devices, cfg.accum, cfg.global_batch, cfg.micro_tokens)
        changes.update(micro_batch=micro_batch, accum=accum * devices, global_batch=None)
    parts = build(seal(dataclasses.replace(cfg, **changes)), World(), device)
    prepare_loss(parts, None)  # loss.reference=precompute: taken in memory
    return parts


def synced_devices(parts: Components) -> int:
    """How many devices' micro-batches one BatchNorm statistic spans: all of them with batchnorm.sync."""
    if not parts.run.batchnorm.sync:
        return 1
    if parts.world.size > 1:
        return parts.world.size
    return parts.run.devices if isinstance(parts.run.devices, int) else 1


def window_batches(parts: Components, devices: int = 1) -> tuple[list[Batch], Batch]:
    """The run's first window (epoch 0) as the micro-steps that run it — each every device's micro-batch of that
    step when `devices` > 1 (SyncBatchNorm normalises over them together) — and as one batch (padded to its
    longest sample, for data padded per micro-batch)."""
    sampler = parts.sampler.alone()  # rank 0 of 1: every device's micro-batches, in turn
    sampler.set_epoch(0)
    micro_batches = next(sampler.windows())

    def fetch(shares: list[MicroBatch]) -> Batch:
        return parts.loader.dataset.__getitems__(MicroBatch.join(shares))[1]

    return ([fetch(micro_batches[k : k + devices]) for k in range(0, len(micro_batches), devices)],
            fetch(micro_batches))


def _gradient(parts: Components, model: nn.Module, micro: Optional[list[Batch]], whole: Batch, device: torch.device,
              precision: Any, loss: Loss) -> dict[str, torch.Tensor]:
    """The window's gradient: accumulated over the micro-batches `micro` (as the loss accumulates a window), or for
    the reference (micro None) the loss's big batch of `whole`. The model's weights, statistics, gradients and
    gradient buffers are as before afterwards, also when it fails (an out-of-memory halfway through backward, say)."""
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    buffers = parts.buffers if model is parts.model else None
    model.zero_grad(set_to_none=True)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(parts.run.seed)  # both ways draw the same random numbers where they can
            if micro is None:
                loss.reference(model, whole, device, precision)
            else:
                loss.accumulate(model, micro, loss.terms(micro), device, precision=precision)
        if buffers is not None:
            buffers.release()
        return {n: p.grad.detach().double().cpu().clone() for n, p in model.named_parameters() if p.grad is not None}
    finally:
        if buffers is not None:
            buffers.clear()
        model.zero_grad(set_to_none=True)
        model.load_state_dict(state)


def relative(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    diff = torch.sqrt(sum((x - y).square().sum() for x, y in zip(a, b)))
    norm = torch.sqrt(sum(y.square().sum() for y in b))
    return float(diff / norm) if norm > 0 else float(diff)


def run_check(parts: Components) -> Check:
    """Compare the accumulated and the one-batch gradient of the run's first window; leave the run untouched.

    One process does it all, so SyncBatchNorm layers run as plain BatchNorm (no collective: the other ranks are
    not in it), each over every device's micro-batch of a micro-step, which is what SyncBatchNorm normalises
    over. TF32 is off inside (cuDNN convolutions default to it on CUDA): the two ways may pick different
    algorithms, and TF32's rounding would swamp float32's tolerance. A sharded run's check builds the whole model
    again in this process."""
    if parts.strategy.lockstep:
        rng = rng_state()  # building draws the seed's initial weights again
        try:
            return run_check(components_for_check(parts.run))
        finally:
            set_rng_state(rng)
    with local_batchnorm(parts.model), full_float32(), deterministic_algorithms(parts.trainer.deterministic):
        return _compare(parts)


def _compare(parts: Components) -> Check:
    device, loss = parts.device, parts.loss
    precision = dataclasses.replace(parts.precision, scaler=None)  # a loss scale would only multiply both
    micro, whole = window_batches(parts, synced_devices(parts))  # micro-batch k runs at micro-step k // devices
    accumulated = _gradient(parts, parts.model, micro, whole, device, precision, loss)
    reference, where = None, str(device)
    try:
        reference = _gradient(parts, parts.model, None, whole, device, precision, loss)
    except Exception as e:  # the whole window does not fit: compute it in float64 on the CPU (below, once the
        if not memory.is_oom(e):  # failed attempt's tensors are freed)
            raise
    if reference is None:
        memory.free_memory(device)
        cpu = cpu_copy(parts.model, torch.float64)
        fp64 = dataclasses.replace(precision, device=torch.device("cpu"), autocast_dtype=None,
                                   param_dtype=torch.float64)
        reference = _gradient(parts, cpu, None, whole.apply(lambda t: t.double() if t.is_floating_point() else t),
                              torch.device("cpu"), fp64, loss)
        where = "the CPU in float64 (the window does not fit the device)"

    groups: dict[str, list[str]] = defaultdict(list)
    depth = wrapper_depth(list(accumulated))
    for name in accumulated:
        groups[name.split(".")[depth]].append(name)  # its top-level module below the wrappers
    per_group = {g: relative([accumulated[n] for n in names], [reference[n] for n in names])
                 for g, names in groups.items()}
    overall = relative(list(accumulated.values()), [reference[n] for n in accumulated])
    micro_batches = ceil_div(len(whole), parts.plan.micro_batch)  # every device's, of up to micro_batch samples
    check = Check(len(whole), parts.plan.micro_batch, micro_batches, precision.name, per_group, overall,
                  tolerance(precision.name), where)
    for name, part in loss.components().items():  # a part the whole's gradient would hide, compared alone
        alone, big = (_gradient(parts, parts.model, m, whole, device, precision, part) for m in (micro, None))
        check.parts[name] = relative(list(alone.values()), [big[n] for n in alone])
    check.causes = causes(parts.model, [loss.probe(b) for b in micro], loss.probe(whole),  # one input per row
                          parts.plan.micro_batch * synced_devices(parts), check.window) + loss.notes(whole)
    return check


def wrapper_depth(names: list[str]) -> int:
    """How many leading module names every parameter shares: the wrappers around the model proper (a Hugging Face
    model in accutrain's adapter, `model.transformer.…`, is grouped by `wte`, `h`, `ln_f`, … below them)."""
    split = [n.split(".")[:-1] for n in names]
    depth = 0
    while split and all(len(parts) > depth and parts[depth] == split[0][depth] for parts in split):
        depth += 1
    return depth


