"""Loss.prepare, once per run before the check and any resume: what the loss takes of the data before training
(loss.reference=precompute: the reference log-probabilities, kept in the run directory; core/losses/precomputed.py)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from accutrain.core.losses.precomputed import Splits
from accutrain.models.adapters import fingerprint
from accutrain.store.checkpoint import save_atomic
from accutrain.train.components import Components

log = logging.getLogger("accutrain")


def prepare_loss(parts: Components, run_dir: Optional[Path]) -> None:
    """The run's loss prepared from the model as built (the base: an adapted model's record, else the initial
    weights' fingerprint) and the data; `run_dir` None (accutrain-check) keeps what it takes in memory."""
    windows = parts.loader.dataset  # the training split as the loader reads it (core.loader.WindowData)
    def base() -> str:  # the initial weights' fingerprint, taken only by a loss that keeps a reference
        return parts.base["fingerprint"] if parts.base else fingerprint(list(parts.model.state_dict().values()))

    splits = Splits(train=windows.dataset, collate=windows.format, rows=max(1, parts.plan.micro_batch or 1),
                    held_out=tuple(x for x in (parts.val_loader, parts.test_loader) if x is not None),
                    directory=run_dir, base=base, save=save_atomic, world=parts.world.size, rank=parts.world.rank,
                    stream=parts.plan.streamed)
    for line in parts.loss.prepare(parts.model, splits, parts.device, parts.precision):
        if parts.world.main:
            log.info(line)
