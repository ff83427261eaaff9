"""`micro_tokens=auto`: the largest token budget whose worst micro-batch fits, found by trial steps as micro_batch=auto
finds its size (accutrain.train.auto_batch), and cached.

The window stays what global_batch (or micro_batch × accum × devices) makes it; only its cut changes. A budget's
worst micro-batch is the one the longest samples make — the cut takes a window's samples longest first, so no
micro-batch of any window holds more than the training set's longest samples laid out within the budget (rows ×
the longest, or their sum padding-free). The budgets tried are multiples of the longest sample: doubled from one
while the trial step fits (one real forward, backward and optimizer step, undone afterwards), then bisected between
the last that fit and the first that did not.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from accutrain import dist
from accutrain.config.train import TrainConfig
from accutrain.config.validate_values import auto_needs_budget
from accutrain.core.batches import Batch, batch_format
from accutrain.core.grad_buffers import BufferSpec
from accutrain.core.loss import Loss
from accutrain.core.plan import ceil_div
from accutrain.core.precision import Precision
from accutrain.core.token_budget import TokenLengths
from accutrain.data.datasets import Datasets
from accutrain.dist import World
from accutrain.errors import UserError
from accutrain.train.auto_batch import cache_key, read_cache, trial, write_cache
from accutrain.train.console import wait_bar

log = logging.getLogger("accutrain")


def auto_micro_tokens(cfg: TrainConfig, model: nn.Module, optimizer: torch.optim.Optimizer, precision: Precision,
                      datasets: Datasets, device: torch.device, world: World, loss: Loss, tokens: TokenLengths,
                      window: int, cache_dir: Optional[Path], buffers: Optional[BufferSpec] = None) -> int:
    """The largest multiple of the longest sample, up to what a whole window of `window` samples holds, whose worst
    micro-batch's training step fits (cached per model, data, precision, device and budget in `cache_dir`; every
    rank follows rank 0's cache and takes the smallest of the ranks' findings)."""
    budget = cfg.trainer.memory_budget_mb
    auto_needs_budget(cfg, device.type)
    order = sorted(range(len(tokens.lengths)), key=lambda i: -int(tokens.lengths[i]))[:window]  # the longest first
    about = dict(model=cfg.model.node(), shape=datasets.sample_shape, lengths=[int(tokens.lengths[i]) for i in order],
                 free=tokens.free, precision=precision.name, budget=budget, window=window, optim=cfg.optim.target,
                 device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 checkpointing=cfg.trainer.activation_checkpointing)
    key, cache = cache_key(**about), (cache_dir / "micro_tokens_auto.json" if cache_dir else None)
    found = dist.broadcast_from_main(read_cache(cache, key, "micro_tokens") if cache and world.main else None, world)
    if found is not None:
        log.info(f"micro_tokens=auto: {found}, cached in {cache}")
        return found

    def worst(multiple: int) -> list[int]:
        """The training samples of the worst micro-batch within `multiple` × the longest sample's tokens."""
        return [order[p] for p in tokens.with_budget(multiple * tokens.longest).cut(order)[0]]

    def batch_of(multiple: int) -> Batch:
        return batch_format(cfg.loader, datasets.collate)([datasets.train[i] for i in worst(multiple)])

    fits = trial(model, optimizer, precision, batch_of, device, budget, loss, buffers)
    most = max(1, ceil_div(tokens.held([int(tokens.lengths[i]) for i in order]), tokens.longest))  # a whole window
    with wait_bar(total=None, desc="micro_tokens=auto: trial steps", unit="trial",
                  enabled=cfg.trainer.progress and world.main) as bar:
        def shown(multiple: int) -> tuple[bool, float]:
            bar.set_postfix(micro_tokens=multiple * tokens.longest)
            try:
                return fits(multiple)
            finally:
                bar.update()

        multiple, notes = search_multiple(most, shown)
    found = multiple * tokens.longest
    log.info("micro_tokens=auto: trial steps "
             + "; ".join(f"{m * tokens.longest}: {note}" for m, note in notes))
    if world.size > 1:  # every rank tried on its own device: the budget that fits on all of them
        found = int(dist.all_reduce_min(torch.tensor(found, device=device), world).item())
    if cache and world.main:
        write_cache(cache, key, found, f"{about['model'].get('name', about['model']['_target_'])} window {window}, "
                    f"longest sample {tokens.longest} tokens, {precision.name} {about['device']}", "micro_tokens")
    return found


def search_multiple(most: int, fits: Callable[[int], tuple[bool, float]]) -> tuple[int, list[tuple[int, str]]]:
    """The largest k in 1 … `most` for which `fits(k)` holds (fits is monotone: a larger budget's worst micro-batch
    holds the smaller's): k doubled from 1 until one does not fit or `most` is reached, then bisected between the
    last that fit and the first that did not. Returns (k, what each trial found)."""
    notes: list[tuple[int, str]] = []

    def tried(k: int) -> bool:
        ok, mb = fits(k)
        notes.append((k, ("fits" if ok else "does not fit") + (f" ({mb:.0f} MiB)" if mb else "")))
        return ok

    good, bad, k = 0, None, 1
    while bad is None:
        if tried(k):
            good = k
            if k == most:
                break
            k = min(2 * k, most)
        else:
            bad = k
    if good == 0:
        raise UserError("micro_tokens=auto: not even the longest training sample alone fits "
                        f"({'; '.join(note for _, note in notes)}): try trainer.activation_checkpointing=true, "
                        "bf16-mixed precision or a smaller data.max_length")
    while bad is not None and bad - good > 1:
        middle = (good + bad) // 2
        if tried(middle):
            good = middle
        else:
            bad = middle
    return good, notes
