"""A batch: the model's inputs (one tensor, or a mapping of tensors passed as keyword arguments) and the target.

Every part of accutrain that touches a batch goes through `Batch`: moving it to the device, calling the model,
counting its samples, cutting it (the out-of-memory re-split), and the stand-in a rank forwards when its share
of a short window is empty. `BatchFormat` turns a list of dataset items into a Batch (the data's collate, then
`loader.input_keys` / `loader.target_key` for mapping items); `PadCollate` pads variable-length items to the
micro-batch's own longest (dynamic padding), `FlatCollate` lays them end to end in one row (padding-free).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping  # isinstance against typing.Mapping costs several Python calls
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
from torch import nn
from torch.utils.data import default_collate

from accutrain.core.plan import ceil_div
from accutrain.errors import UserError

Inputs = Union[torch.Tensor, Mapping[str, torch.Tensor]]


@dataclass(frozen=True)
class Batch:
    """One micro-batch. `stand_in`: a real but borrowed batch a rank forwards in place of an empty share, so that
    it takes part in the window's gradient all-reduce; it adds nothing to the gradient, the loss or the count.
    `spans`: a padding-free batch's samples, laid end to end in one row (FlatCollate), by their lengths."""

    inputs: Inputs
    target: torch.Tensor
    stand_in: bool = False
    spans: Optional[tuple[int, ...]] = None

    def __len__(self) -> int:
        if self.stand_in:
            return 0
        return self.target.shape[0] if self.spans is None else len(self.spans)  # len(tensor) is Python code

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        """The same batch with `fn` applied to every tensor (inputs and target)."""
        inputs = ({k: fn(v) for k, v in self.inputs.items()} if isinstance(self.inputs, Mapping)
                  else fn(self.inputs) if self.inputs is not None else None)
        return Batch(inputs, fn(self.target), self.stand_in, self.spans)

    def to(self, device: torch.device) -> Batch:
        return self.apply(lambda t: t.to(device, non_blocking=True))

    def pin_memory(self) -> Batch:  # the DataLoader's pin_memory calls it
        return self.apply(torch.Tensor.pin_memory)

    def forward(self, model: nn.Module, cast: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> Any:
        """model(inputs), or model(**inputs) for a mapping; `cast` is applied to each input (precision.inputs)."""
        if isinstance(self.inputs, Mapping):
            return model(**{k: cast(v) for k, v in self.inputs.items()})
        return model(cast(self.inputs))

    def split(self, parts: int) -> list[Batch]:
        """Cut into `parts` batches of consecutive samples (the last may be shorter); a stand-in stays whole."""
        n = len(self.target) if self.spans is None else len(self.spans)
        if self.stand_in or n <= 1 or parts == 1:
            return [self]
        size = ceil_div(n, parts)
        return [self.samples(i, i + size) for i in range(0, n, size)]

    def samples(self, first: int, end: int) -> Batch:
        """Samples first … end - 1 (of a padding-free batch: their columns of its one row)."""
        if self.spans is None:
            return self.apply(lambda t: t[first:end])
        start, stop = sum(self.spans[:first]), sum(self.spans[:end])
        return dataclasses.replace(self.apply(lambda t: t[:, start:stop]), spans=self.spans[first:end])

    def head(self, n: int) -> Batch:
        """The first n samples (zero samples: the empty batch of this layout)."""
        if n == 0:
            return dataclasses.replace(self.apply(lambda t: t[:0]), stand_in=False, spans=None)
        return dataclasses.replace(self.samples(0, n), stand_in=False)

    def tensors(self) -> list[torch.Tensor]:
        """The input tensors, in order."""
        if isinstance(self.inputs, Mapping):
            return list(self.inputs.values())
        return [self.inputs] if self.inputs is not None else []


def as_batch(batch: Union[Batch, Sequence[Any]]) -> Batch:
    """A Batch, or an (inputs, target) pair made into one."""
    if isinstance(batch, Batch):
        return batch
    inputs, target = batch
    return Batch(inputs, target)


@dataclass(frozen=True)
class BatchFormat:
    """Dataset items → Batch: the data's collate (torch's default_collate unless the data brings one), then for
    mapping items the model's inputs (`input_keys`; null: every key but the target) and the target (`target_key`)."""

    collate: Callable[[list], Any] = default_collate
    input_keys: Optional[tuple[str, ...]] = None
    target_key: str = "labels"

    def __call__(self, items: list) -> Batch:
        data = self.collate(items)
        if isinstance(data, Batch):
            return data
        if not isinstance(data, Mapping):
            inputs, target = data
            return Batch(inputs, target)
        if self.target_key not in data:
            raise UserError(f"loader.target_key={self.target_key}: the data's items have no such key (they have "
                            f"{', '.join(map(str, data))})")
        keys = self.input_keys or [k for k in data if k != self.target_key]
        missing = [k for k in keys if k not in data]
        if missing:
            raise UserError(f"loader.input_keys: {', '.join(missing)} not in the data's items (they have "
                            f"{', '.join(map(str, data))})")
        return Batch({k: data[k] for k in keys}, data[self.target_key])


def batch_format(loader_cfg: Any, collate: Optional[Callable[[list], Any]]) -> BatchFormat:
    """The run's BatchFormat: the data's collate (Datasets.collate) and loader.input_keys / loader.target_key."""
    keys = loader_cfg.input_keys
    return BatchFormat(collate or default_collate, tuple(keys) if keys else None, loader_cfg.target_key)


@dataclass(frozen=True)
class PadCollate:
    """Collate mapping items whose tensors have varying lengths: each 1-D tensor is right-padded to the longest in
    this micro-batch, or to `length` (with `pad_values[key]`, else `default`); scalars are stacked. Right padding
    keeps positions 0…n-1 of every item where they were, so a causal model sees each item as it would alone."""

    pad_values: Mapping[str, int]
    default: int = 0
    length: Optional[int] = None  # pad to this length instead (data.padding=max_length)

    def __call__(self, items: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        out = {}
        for key in items[0]:
            tensors = [item[key] for item in items]
            if tensors[0].dim() == 0 or (self.length is None and all(t.shape == tensors[0].shape for t in tensors)):
                out[key] = torch.stack(tensors)
                continue
            longest = max(max(len(t) for t in tensors), self.length or 0)
            padded = torch.full((len(tensors), longest), self.pad_values.get(key, self.default),
                                dtype=tensors[0].dtype)
            for row, t in enumerate(tensors):
                padded[row, : len(t)] = t
            out[key] = padded
        return out


@dataclass(frozen=True)
class FlatCollate:
    """data.padding=free: a micro-batch's token items laid end to end in one row of real tokens, no padding — the
    Batch's inputs `input_ids` and `document_ids` (each item a document, or a packed block's documents, numbered
    along the row: the model gives each its own positions and attention, models/packed.py), its target the labels
    with every document's first set to `ignore_index`, so the shifted loss never predicts a document's first token
    from the one before (a document alone never predicts its first token either): every document's terms and logits
    are those it has padded in a row of its own. `spans` keeps each item's length (the samples' count, a re-split)."""

    ignore_index: int = -100

    def __call__(self, items: list[Mapping[str, torch.Tensor]]) -> Batch:
        ids, labels, documents, spans, numbered = [], [], [], [], 0
        for item in items:
            length = len(item["input_ids"])
            spans.append(length)
            if not length:
                continue
            own = item.get("document_ids")
            own = own[:length] if own is not None else torch.ones(length, dtype=torch.int64)
            label = item["labels"][:length].clone()
            label[torch.cat([torch.ones(1, dtype=torch.bool), own[1:] != own[:-1]])] = self.ignore_index
            ids.append(item["input_ids"][:length])
            labels.append(label)
            documents.append(own - own[0] + 1 + numbered)
            numbered = int(documents[-1][-1])
        return Batch({"input_ids": torch.cat(ids)[None], "document_ids": torch.cat(documents)[None]},
                     torch.cat(labels)[None], spans=tuple(spans))


@contextmanager
def stand_in_guard(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Around a stand-in's forward AND backward: every gradient reaching a parameter is replaced by exact zeros
    before it is accumulated (a leaf's tensor hook runs before AccumulateGrad; DDP's reducer fires after it, so
    the all-reduce still happens), even if the stand-in's loss × 0 is NaN; buffers (BatchNorm's running
    statistics) are restored after backward, which may still read them; the RNG is forked, so later draws are
    the same as without the stand-in."""
    params = [p for p in model.parameters() if p.requires_grad]
    handles = [p.register_hook(torch.zeros_like) for p in params]
    buffers = list(model.buffers())
    saved = [b.detach().clone() for b in buffers]
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            yield
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for b, s in zip(buffers, saved):
                b.copy_(s)
