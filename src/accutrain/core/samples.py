"""A dataset's samples as the loaders read them: a sample whose reading raises, and a micro-batch whose samples cannot
be collated (one of another shape), each become one line naming the split and the sample — in a loader's worker
process too, where PyTorch would otherwise hand back the worker's traceback."""
from __future__ import annotations

import os
import traceback
from collections.abc import Mapping
from typing import Any, Callable, Optional, Sequence

import torch
from torch.utils.data import Dataset, Subset

from accutrain.errors import UserError, one_line

_TORCH = os.path.dirname(torch.__file__)
_ACCUTRAIN = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def raised_at(error: BaseException) -> str:
    """Where `error` was raised, as `file.py:12, in f`: the innermost frame outside PyTorch and accutrain (the
    dataset's own code), else the innermost frame; empty without a traceback."""
    frames = traceback.extract_tb(error.__traceback__)
    own = [f for f in frames if not os.path.abspath(f.filename).startswith((_TORCH, _ACCUTRAIN))]
    frame = (own or frames or [None])[-1]
    return f" ({os.path.basename(frame.filename)}:{frame.lineno}, in {frame.name})" if frame else ""


def sample_failure(split: str, index: int, error: Exception) -> UserError:
    """The one line for sample `index` of `split` ("training", "held-out") raising `error` while being read."""
    return UserError(f"reading {split} sample {index} raised {one_line(error)}{raised_at(error)}")


def shapes(item: Any) -> tuple[Any, ...]:
    """The shape of each part of an item ((input, target) pairs, mappings, tensors, arrays); the type's name for a
    part without one (a number, a PIL image)."""
    if isinstance(item, Mapping):
        return tuple((k, shapes(v)) for k, v in item.items())
    if isinstance(item, (tuple, list)):
        return tuple(shapes(v) for v in item)
    shape = getattr(item, "shape", None)
    return tuple(shape) if shape is not None else type(item).__name__


def describe_shape(shape: Any) -> str:
    """shapes()'s answer as a message says it: `1×8×8, scalar` for an (image, label) item."""
    if isinstance(shape, str):
        return shape
    if all(isinstance(s, int) for s in shape):
        return "×".join(map(str, shape)) or "scalar"
    if all(isinstance(s, tuple) and len(s) == 2 and isinstance(s[0], str) for s in shape):
        return ", ".join(f"{k} {describe_shape(v)}" for k, v in shape)
    return ", ".join(describe_shape(s) for s in shape)


def collate_failure(split: str, items: Sequence[Any], indices: Optional[Sequence[int]], error: Exception
                    ) -> UserError:
    """The one line for `items` (samples `indices` of `split`, when known) that the data's collate refused: the
    first sample whose shapes differ from the first's, or the collate's own error."""
    names = list(indices) if indices is not None else None
    first = shapes(items[0])
    for k, item in enumerate(items[1:], 1):
        if shapes(item) != first:
            which = (f"samples {names[0]} and {names[k]}" if names is not None else "two samples of a batch")
            return UserError(f"{split} {which} differ in shape ([{describe_shape(first)}] and "
                             f"[{describe_shape(shapes(item))}]): a micro-batch stacks its samples, so every sample "
                             "needs the same shape (or the data a collate that pads them: Datasets.collate)")
    where = f"samples {names[:8]}{'…' if len(names) > 8 else ''}" if names is not None else "a batch"
    return UserError(f"collating {split} {where} raised {one_line(error)}{raised_at(error)}")


def read(dataset: Callable[[int], Any], index: int, split: str) -> Any:
    """dataset(index), a failure made one line naming the sample (a UserError of the dataset's own is kept)."""
    try:
        return dataset(index)
    except UserError:
        raise
    except Exception as e:
        raise sample_failure(split, index, e) from e


def collate(fn: Callable[[list], Any], items: list, split: str, indices: Optional[Sequence[int]] = None) -> Any:
    """fn(items), a failure made one line naming the samples (a UserError of the collate's own is kept)."""
    try:
        return fn(items)
    except UserError:
        raise
    except Exception as e:
        raise collate_failure(split, items, indices, e) from e


class NamedSubset(Subset):
    """A Subset (the held-out loader's: this rank's share) whose samples, read one by one, fail in one line naming
    the sample by its index in the whole split."""

    def __init__(self, dataset: Dataset, indices: Sequence[int], split: str) -> None:
        super().__init__(dataset, indices)
        self.split = split

    def __getitem__(self, idx: int) -> Any:  # type: ignore[override]
        index = self.indices[idx]
        return read(self.dataset.__getitem__, index, self.split)

    def __getitems__(self, indices: list[int]) -> list[Any]:  # Subset's would bypass __getitem__
        return [self[idx] for idx in indices]


class NamedCollate:
    """A collate whose failure is one line naming the split (and the shapes that differ). Picklable for workers."""

    def __init__(self, fn: Callable[[list], Any], split: str) -> None:
        self.fn, self.split = fn, split

    def __call__(self, items: list) -> Any:
        return collate(self.fn, items, self.split)
