"""`micro_batch=auto`: the largest micro-batch whose real training step fits, found by trial steps and cached."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from accutrain import dist
from accutrain.config.train import TrainConfig
from accutrain.config.validate_values import auto_needs_budget
from accutrain.core.batches import Batch, PadCollate, batch_format
from accutrain.core.grad_buffers import BufferSpec
from accutrain.core.loss import Loss
from accutrain.core.precision import Precision
from accutrain.data.datasets import Datasets
from accutrain.dist import World
from accutrain.errors import UserError
from accutrain.models import norms
from accutrain.store.files import write_atomic
from accutrain.train.console import wait_bar
from accutrain.train.memory import free_memory, is_oom, peak_mb, reset_peak

log = logging.getLogger("accutrain")


def auto_micro_batch(cfg: TrainConfig, model: nn.Module, optimizer: torch.optim.Optimizer, precision: Precision,
                     datasets: Datasets, device: torch.device, world: World, loss: Loss,
                     cache_dir: Optional[Path], buffers: Optional[BufferSpec] = None) -> int:
    """The largest divisor of global_batch / devices whose real training step fits, found by trial steps (cached
    per model, data shape, precision, device and budget in `cache_dir`). Rank 0 alone reads the cache and every
    rank follows its answer: a hit on some ranks and a miss on others would leave the latter waiting in the
    search's all-reduce. `buffers`: the run's gradient buffers, which the trial steps hold too."""
    budget = cfg.trainer.memory_budget_mb
    auto_needs_budget(cfg, device.type)
    schedule = cfg.batch_schedule
    total = math.gcd(*schedule.batch) if schedule is not None else cfg.global_batch  # what every window is made of
    if total % world.size:
        raise UserError(f"{'every batch_schedule.batch' if schedule is not None else 'global_batch'}={total} is not "
                        f"a multiple of devices {world.size}")
    window = total // world.size
    about = dict(model=cfg.model.node(), shape=datasets.sample_shape,
                 precision=precision.name, device=torch.cuda.get_device_name(device) if device.type == "cuda"
                 else "cpu", budget=budget, window=window, optim=cfg.optim.target,
                 checkpointing=cfg.trainer.activation_checkpointing)
    key, cache = cache_key(**about), (cache_dir / "micro_batch_auto.json" if cache_dir else None)
    found = dist.broadcast_from_main(read_cache(cache, key) if cache and world.main else None, world)
    if found is not None:
        log.info(f"micro_batch=auto: {found}, cached in {cache}")
        return found

    collate = datasets.collate
    if isinstance(collate, PadCollate):  # trials padded to the longest a micro-batch can be
        collate = dataclasses.replace(collate, length=max(datasets.sample_shape))

    def batch_of(size: int) -> Batch:
        return batch_format(cfg.loader, collate)([datasets.train[i % len(datasets.train)] for i in range(size)])

    fits = trial(model, optimizer, precision, batch_of, device, budget, loss, buffers)
    # BatchNorm in training cannot normalise one sample (one value per channel): the search starts at 2.
    smallest = 2 if window > 1 and norms.batchnorm_layers(model, training_only=True) else 1
    tries = len([d for d in divisors(window) if d >= smallest])  # at most: the search stops at the first misfit
    with wait_bar(total=tries, desc="micro_batch=auto: trial steps", unit="trial",
                  enabled=cfg.trainer.progress and world.main) as bar:
        def shown(size: int) -> tuple[bool, float]:
            bar.set_postfix(micro_batch=size)
            try:
                return fits(size)
            finally:
                bar.update()

        found, notes = search_micro_batch(window, shown, budget, smallest)
    log.info(f"micro_batch=auto: trial steps {'; '.join(notes)}")
    if world.size > 1:  # every rank tried on its own device: take the size that fits on all of them
        found = int(dist.all_reduce_min(torch.tensor(found, device=device), world).item())
    if cache and world.main:
        write_cache(cache, key, found, f"{about['model'].get('name', about['model']['_target_'])} "
                    f"{about['shape']} {precision.name} {about['device']} window {window}")
    return found


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search_micro_batch(window: int, fits: Callable[[int], tuple[bool, float]], budget_mb: Optional[float],
                       smallest: int = 1) -> tuple[int, list[str]]:
    """The largest divisor of `window` (a rank's share of the effective batch), from `smallest` up, for which `fits`
    holds, trying sizes upward and stopping at the first that does not fit; with a budget, a size whose memory,
    extrapolated from the last two trials, exceeds it is not tried. Returns (size, what each trial found)."""
    best, notes, trials = None, [], []
    if smallest > 1:
        notes.append("1: not tried (BatchNorm in training needs 2 or more samples per micro-batch)")
    for size in [d for d in divisors(window) if d >= smallest]:
        if budget_mb is not None and len(trials) >= 2:
            (s0, m0), (s1, m1) = trials[-2:]
            predicted = m1 + (m1 - m0) / (s1 - s0) * (size - s1)
            if predicted > budget_mb * 1.25:
                notes.append(f"{size}: predicted {predicted:.0f} MiB > budget {budget_mb:.0f} MiB")
                break
        ok, mb = fits(size)
        notes.append(f"{size}: {'fits' if ok else 'does not fit'}" + (f" ({mb:.0f} MiB)" if mb else ""))
        if not ok:
            break
        best = size
        trials.append((size, mb))
    if best is None:
        raise UserError(f"micro_batch=auto: not even a micro-batch of {smallest} fits ({'; '.join(notes)})")
    return best, notes


def cache_key(**parts: Any) -> str:
    return hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_cache(path: Path, key: str, field: str = "micro_batch") -> Optional[int]:
    try:
        return json.loads(path.read_text()).get(key, {}).get(field)
    except (OSError, ValueError, AttributeError):
        return None


def write_cache(path: Path, key: str, micro_batch: int, description: str, field: str = "micro_batch") -> None:
    try:
        entries = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        entries = {}
    entries[key] = {field: micro_batch, "for": description}
    try:
        write_atomic(path, json.dumps(entries, indent=1) + "\n")
    except OSError as e:
        log.warning(f"{field}=auto: could not cache the result in {path}: {e}")


def trial(model: nn.Module, optimizer: torch.optim.Optimizer, precision: Any, batch_of: Callable[[int], Batch],
          device: torch.device, budget_mb: Optional[float], loss: Loss, buffers: Optional[BufferSpec] = None
          ) -> Callable[[int], tuple[bool, float]]:
    """fits(size): one real forward, backward and optimizer step on `size` samples, with the run's gradient buffers
    if it has any, and the optimizer's state (momentum, Adam moments) allocated by the step; (fits, peak MiB).
    Weights, model buffers, gradients, optimizer state and RNG are restored afterwards, so the search leaves no
    trace on training."""
    def fits(size: int) -> tuple[bool, float]:
        saved = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        batch = batch_of(size)
        held = None
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                reset_peak(device)
                held = buffers.build(model) if buffers else None
                loss.accumulate(model, [batch], max(1, loss.terms([batch])), device, precision=precision)
                if held:
                    held.release()
                optimizer.step()
                mb = peak_mb(device)
            return budget_mb is None or mb <= budget_mb, mb
        except Exception as e:
            if not is_oom(e):
                raise
            return False, 0.0
        finally:
            if held:
                held.remove()
            del held
            optimizer.zero_grad(set_to_none=True)
            optimizer.state.clear()
            model.load_state_dict(saved)
            free_memory(device)  # for the next trial, and for training

    free_memory(device)
    return fits
