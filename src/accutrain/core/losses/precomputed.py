"""loss.reference=precompute: the reference policy's summed log-probability of every sequence of the training and
held-out splits, taken in one pass before training (the model as built: the base with its LoRA adapter disabled, or
the initial weights) and kept in run_dir/reference.pt, so that no reference model is held during training. A
sequence's value is looked up by its tokens and labels. The file records what it was taken from — the training
split's size and a hash of its token ids, the base's fingerprint — and a resumed run reads it back without
recomputing, or is refused in one line when the data or the base changed since."""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch
import torch.distributed as tdist

from accutrain.core.batches import Batch, as_batch
from accutrain.errors import UserError

FILE = "reference.pt"
Logps = Callable[[Batch], list[tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]]]


@dataclass
class Splits:
    """What a loss may take of the run once before training (Loss.prepare): the training split's items and the
    collate that batches them (`rows` at a time), this rank's share of each held-out split, the run directory (None:
    kept in memory only) and how a file is written there atomically, the fingerprint of the base the reference is,
    and the ranks."""

    train: Sequence[Any]
    collate: Callable[[list], Batch]
    rows: int
    held_out: tuple[Iterable, ...]
    directory: Optional[Path]
    base: str | Callable[[], str]  # a callable computes it when asked (it hashes every weight: only for a reference)
    save: Callable[[dict, Path], None]
    world: int = 1
    rank: int = 0
    stream: bool = False  # the training split is a stream, read as it trains (no pass before)


def sequence_keys(inputs: Mapping[str, torch.Tensor], labels: torch.Tensor) -> list[str]:
    """Each row's key: a hash of its tokens and labels (the padding left out, whichever side it is on)."""
    ids, mask, labels = inputs["input_ids"].cpu(), inputs["attention_mask"].cpu().bool(), labels.cpu()
    return [hashlib.blake2b(ids[b][mask[b]].numpy().tobytes() + b"|" + labels[b][mask[b]].numpy().tobytes(),
                            digest_size=16).hexdigest() for b in range(len(ids))]


def data_fingerprint(items: Sequence[Any]) -> dict[str, Any]:
    """The training split as the file records it: its size and a hash of every item's token ids and labels."""
    digest = hashlib.sha256()
    for index in range(len(items)):
        item = items[index]
        for key in sorted(k for k in item if k.endswith(("input_ids", "labels"))):
            digest.update(key.encode() + b":" + torch.as_tensor(item[key]).numpy().tobytes())
    return {"train_size": len(items), "tokens": digest.hexdigest()[:16]}


class Table:
    """The kept log-probabilities, by sequence key; `logps(inputs, labels)` those of a batch's rows."""

    def __init__(self, values: dict[str, float], where: str) -> None:
        self.values, self.where = values, where

    def logps(self, inputs: Mapping[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        keys = sequence_keys(inputs, labels)
        missing = sum(key not in self.values for key in keys)
        if missing:
            raise UserError(f"{missing} of this batch's sequences not in {self.where}: the data changed since the "
                            "reference was taken (start a new run, or resume with the data it was taken on)")
        return torch.tensor([self.values[k] for k in keys], dtype=torch.float64, device=labels.device)


def take(batches: Iterable, logps: Logps, into: dict[str, float]) -> None:
    """Each batch's sequences' reference log-probabilities (`logps`: [(inputs, labels, values)] per role) into
    `into`."""
    for raw in batches:
        for inputs, labels, values in logps(as_batch(raw)):
            into.update(zip(sequence_keys(inputs, labels), values.tolist()))


def merged(mine: dict[str, float], world: int) -> dict[str, float]:
    """Every rank's values (one all_gather_object, on the host)."""
    if world <= 1:
        return mine
    everyone: list = [None] * world
    tdist.all_gather_object(everyone, mine)
    return {k: v for part in everyone for k, v in part.items()}


def prepare_table(splits: Splits, logps: Logps, name: str, device: torch.device) -> tuple[Table, list[str]]:
    """The table: read back from run_dir/reference.pt when it is there (refused when the data or the base changed
    since), else taken in one pass (each rank its share of the training split, then merged) and written atomically
    by rank 0. Returns it and the lines to log."""
    if not hasattr(splits.train, "__len__") or splits.stream:
        raise UserError(f"loss={name} with loss.reference=precompute takes one pass over the training split before "
                        "training, and a stream (data.streaming=true) is read only as it trains: use "
                        "loss.reference=model")
    data = data_fingerprint(splits.train)
    path = splits.directory / FILE if splits.directory is not None else None
    if path is not None and path.exists():
        try:
            kept = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # not one torch.save wrote whole (write_atomic never leaves a partial one)
            raise UserError(f"{path} cannot be read ({type(e).__name__}): remove it, and the resume takes the "
                            "reference log-probabilities again") from None
        refuse_changes(path, kept, data, base_of(splits))
        values = dict(zip(kept["keys"], kept["logps"].tolist()))
        return Table(values, str(path)), [f"loss={name}: the reference log-probabilities of {len(values)} sequences "
                                          f"read back from {path} (taken before training; data and base unchanged)"]
    start, mine = time.perf_counter(), {}
    n = len(splits.train)
    share = list(range(splits.rank, n, splits.world))
    take((splits.collate([splits.train[i] for i in share[s : s + splits.rows]])
          for s in range(0, len(share), splits.rows)), logps, mine)
    for loader in splits.held_out:
        take(loader, logps, mine)
    values = merged(mine, splits.world)
    where = str(path) if path is not None else "memory"
    if path is not None and splits.rank == 0:  # atomically: a run killed while writing it takes it again
        keys = sorted(values)
        splits.save(dict(data=data, base=base_of(splits), keys=keys,
                         logps=torch.tensor([values[k] for k in keys], dtype=torch.float64)), path)
    return Table(values, where), [f"loss={name}: loss.reference=precompute took the reference log-probabilities of "
                                  f"{len(values)} sequences in one pass ({time.perf_counter() - start:.1f} s), kept in "
                                  f"{where}; no reference model is held during training"]


def base_of(splits: Splits) -> str:
    """The base's fingerprint (computed once, when first asked)."""
    if callable(splits.base):
        splits.base = splits.base()
    return splits.base


def refuse_changes(path: Path, kept: dict, data: dict[str, Any], base: str) -> None:
    """One line when the training split or the base is not the one the file was taken on."""
    if kept.get("data") != data:
        was = kept.get("data") or {}
        raise UserError(f"{path} holds the reference log-probabilities of another training split "
                        f"({was.get('train_size')} samples, tokens {was.get('tokens')}; this run's: "
                        f"{data['train_size']} samples, tokens {data['tokens']}): the data changed since; resume with "
                        "the data it was taken on, or start a new run")
    if kept.get("base") != base:
        raise UserError(f"{path} holds the reference log-probabilities of another base (weights {kept.get('base')}; "
                        f"this run's: {base}): the base changed since; resume with the base it was taken on, or start "
                        "a new run")
