"""The data checked once, cheaply, at start — after the factory made it, before the model sees a sample — so that
what would be a traceback in the first step (or a silently wrong loss) is one line naming the sample and the key:
what the factory returned, empty splits, the number of classes, the first window's samples (they read, they stack,
their targets are what cross-entropy takes: integer classes in range, or per-sample class probabilities), the
held-out split's first batch, and every target of a split held in memory (accutrain.data.InMemory).

Reading those samples changes no random stream: the run trains exactly as it would without the check."""
from __future__ import annotations

import numbers
import random
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from accutrain.config import families
from accutrain.config.train import TrainConfig
from accutrain.config.typed import Factory
from accutrain.core import samples
from accutrain.core.batches import BatchFormat, batch_format
from accutrain.core.losses.spec import LossNode
from accutrain.core.options import Normalize
from accutrain.core.windows import epoch_order
from accutrain.data import views
from accutrain.data.datasets import Datasets, InMemory
from accutrain.errors import UserError

FIRST_SAMPLES = 32  # of the first window (epoch 0's order), read at start; the held-out split's first as many


def prepare(made: Any, cfg: TrainConfig) -> tuple[Datasets, BatchFormat]:
    """What the data factory returned (`made`), as this run sees it — its views (augment=) and its batch format —
    checked: a mistake in it is one UserError naming the sample and the key."""
    datasets = returned(made, cfg.data.target)
    with same_random_streams():
        first = datasets.train[0]
    traits = families.traits_of(cfg.loss)
    if isinstance(first, dict) and "anchor.input_ids" in first and not traits.pairs:
        raise UserError(f"data {datasets.description} holds text pairs (an anchor, its positive and its negatives per "
                        f"record), which only a loss over pairs compares; this run's loss is "
                        f"{families.option(cfg.loss)}: set loss=contrastive (or loss=triplet), or records of another "
                        "kind")
    preference = "pairs" if "chosen.input_ids" in first else "feedback" if "completion.labels" in first else None
    if isinstance(first, dict) and preference and traits.task not in ("preference", "feedback"):
        raise UserError(f"data {datasets.description} holds preference records, which only a preference loss "
                        f"trains on; this run's loss is {families.option(cfg.loss)}: set "
                        f"{'loss=dpo (or loss=orpo)' if preference == 'pairs' else 'loss=kto'}, or records of another "
                        "kind")
    datasets = views.apply(datasets, cfg.augment, cfg.model, cfg.seed,  # training views per (seed, epoch, sample)
                           cfg.augment.views)
    batches = batch_format(cfg.loader, datasets.collate)
    check_samples(datasets, batches, cfg.loss, cfg.seed, traits.class_targets)
    return datasets, batches


def returned(made: Any, target: str) -> Datasets:
    """`made` if it is an accutrain.data.Datasets with at least 2 classes and two non-empty splits."""
    if not isinstance(made, Datasets):
        raise UserError(f"data._target_={target} returned a {type(made).__name__}, not an accutrain.data.Datasets("
                        "train, val, num_classes, sample_shape, description)")
    n = made.num_classes
    if not isinstance(n, numbers.Integral) or isinstance(n, bool) or n < 2:
        raise UserError(f"data._target_={target} returned num_classes={n!r}: expected an integer, 2 or more (with "
                        "one class cross-entropy is 0 whatever the model says)")
    for split, dataset in (("training", made.train), ("held-out", made.val)) + ((("test", made.test),)
                                                                               if made.test is not None else ()):
        try:
            size = len(dataset)
        except TypeError:
            raise UserError(f"data._target_={target}: its {split} split has no len(): expected a map-style "
                            "torch Dataset (__len__ and __getitem__)") from None
        if size == 0:
            raise UserError(f"data._target_={target}: its {split} split is empty (0 samples): "
                            + ("training needs samples" if split == "training" else
                               "evaluation needs at least one sample (its loss and accuracy are means over it)"))
    return made


@contextmanager
def same_random_streams() -> Iterator[None]:
    """Python's, NumPy's and torch's CPU generators are where they were after the block (a dataset may draw)."""
    state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        yield
    random.setstate(state[0])
    np.random.set_state(state[1])


def check_samples(datasets: Datasets, batches: BatchFormat, loss: Factory, seed: int, classes: bool) -> None:
    """Read the first window's first samples and the held-out split's first, collate them, check their targets
    (`classes`: the loss takes class indices, bounded by the data's classes); scan the targets of a split held in
    memory in full."""
    first = epoch_order(len(datasets.train), seed, 0)[:FIRST_SAMPLES].tolist()
    held_out = list(range(min(len(datasets.val), FIRST_SAMPLES)))
    with same_random_streams():
        train = [samples.read(datasets.train.__getitem__, i, "training") for i in first]
        val = [samples.read(datasets.val.__getitem__, i, "held-out") for i in held_out]
    if datasets.collate is None and samples.shapes(train[0]) != samples.shapes(val[0]):
        raise UserError(f"training sample {first[0]} and held-out sample 0 differ in shape "
                        f"([{samples.describe_shape(samples.shapes(train[0]))}] and "
                        f"[{samples.describe_shape(samples.shapes(val[0]))}]): the model takes one shape")
    for split, items, indices in (("training", train, first), ("held-out", val, held_out)):
        target = samples.collate(batches, items, split, indices).target
        if classes:
            check_targets(target, indices, split, datasets.num_classes, loss)
    for split, dataset in (("training", datasets.train), ("held-out", datasets.val)):
        if not classes:
            break
        held = getattr(dataset, "raw", dataset)  # a view of images held in memory keeps their labels
        if isinstance(held, InMemory):
            check_targets(held.labels, range(len(held.labels)), split, datasets.num_classes, loss)


def check_targets(target: torch.Tensor, indices: Sequence[int], split: str, num_classes: int, loss: Factory
                  ) -> None:
    """`target` (one row per sample `indices[k]`) as cross-entropy takes it: int64 (or uint8) class indices in
    [0, num_classes) — element targets may also be loss.ignore_index — or float class probabilities per sample."""
    if not isinstance(target, torch.Tensor):
        raise UserError(f"{split} targets are {type(target).__name__}s: expected class indices (integers)")
    what = f"{split} sample {indices[0]}'s target is {target.dtype} of shape {tuple(target.shape[1:]) or 'scalar'}"
    if target.is_floating_point():
        if target.dim() == 2 and target.shape[1] == num_classes:
            return  # class probabilities per sample (soft targets)
        raise UserError(f"{what}: cross-entropy takes class indices as integers (torch.long, 0 … {num_classes - 1}: "
                        f"e.g. torch.tensor(label, dtype=torch.long)), or per-sample probabilities over the "
                        f"{num_classes} classes")
    if target.dtype not in (torch.int64, torch.uint8):
        raise UserError(f"{what}: cross-entropy takes class indices as torch.long (int64): convert them "
                        "(labels.long())")
    ignore, default = int(loss.get("ignore_index", LossNode.ignore_index)), LossNode.ignore_index
    counts_samples = loss.get("normalize", "auto") in (Normalize.auto, Normalize.samples, "auto", "samples")
    if target.dim() == 1 and counts_samples and ignore != default:
        raise UserError(f"loss.ignore_index={ignore} on one class per sample: a sample whose label it is would add "
                        "nothing to the loss yet count in the window's mean; it is for element targets (padded "
                        f"tokens): leave loss.ignore_index={default}, or use loss.normalize=elements to count only "
                        "the samples not ignored")
    valid = (target >= 0) & (target < num_classes)
    if target.dim() > 1 or not counts_samples:
        valid |= target == ignore
    if bool(valid.all()):
        return
    bad = (~valid).nonzero()[0].tolist()
    value = int(target[tuple(bad)])
    where = f"{split} sample {indices[bad[0]]}" + (f" at position {tuple(bad[1:])}" if len(bad) > 1 else "")
    if target.dim() == 1:
        hint = (f"; a sample cannot be ignored (loss.ignore_index={ignore}): the window's mean counts every sample"
                if value == ignore else "")
        raise UserError(f"{where} has label {value}: out of range for the data's {num_classes} classes (expected "
                        f"0 … {num_classes - 1}){hint}")
    raise UserError(f"{where} has target {value}: expected a class index 0 … {num_classes - 1}, or "
                    f"loss.ignore_index={ignore} for an element the loss skips")
