"""The two (or three) splits a `data` factory returns, as accutrain.data.Datasets; the in-memory dataset the built-in
ones use; how many loader workers help; which training samples data.test holds out."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch.utils.data import Dataset

from accutrain.data.views import ImageSource
from accutrain.errors import UserError
from accutrain.seeding import keyed_seed
from accutrain.store.classes import describe as named


@dataclass
class Datasets:
    """What a `data` factory returns: two splits of items — (input, target) pairs, or mappings whose target is
    under `loader.target_key` and whose other keys (or `loader.input_keys`) are the model's keyword inputs. A target
    is a class index per sample, or per element (a sequence's tokens, an image's pixels) for element-level
    losses."""

    train: Dataset
    val: Dataset
    num_classes: int
    sample_shape: tuple[int, ...]  # one input's shape: channels, height, width for images
    description: str
    extra: dict[str, Any] = field(default_factory=dict)  # more data-derived model arguments (vocab_size, …)
    collate: Optional[Callable[[list], Any]] = None  # items → one micro-batch; None: torch's default_collate
    tokenizer: Any = None  # saved beside an exported model (trainer.export=hf)
    classes: str = "classes"  # what num_classes counts, for the log ("tokens in the vocabulary")
    class_names: tuple[str, ...] = ()  # entry i names output i (a folder's name, a label's); () when unnamed
    images: Optional[ImageSource] = None  # image data: what augment= makes its views from (accutrain.data.views)
    decoded: bool = False  # each item is read or decoded when asked (files, PIL images): loader workers help
    test: Optional[Dataset] = None  # the test split (data.test), evaluated once at the end with the best and last weights
    stream: Any = None  # a stream of training samples (data.streaming, core.streams.Source): the windows are cut from
    # it, and `train` holds its first samples (what the checks before training read)


def loader_workers(setting: Any, datasets: Datasets, devices: int) -> int:
    """loader.num_workers: a number as given; auto: min(4, cores per device − 1) for data read or decoded per item,
    else 0 (items already in memory: a worker would add only its start-up and the copy between processes)."""
    if setting != "auto":
        return int(setting)
    if not datasets.decoded:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(0, min(4, cores // max(1, devices) - 1))


class InMemory(Dataset):
    """Images and labels held as two tensors."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        assert len(images) == len(labels)
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]

    def gather(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples `indices` at once: bit for bit what default_collate stacks from their items, one indexing per
        tensor instead of a Python call per sample (the train loader's micro-batches, accutrain.core.windows)."""
        index = torch.tensor(indices, dtype=torch.int64)
        return self.images.index_select(0, index), self.labels.index_select(0, index)


def test_indices(n: int, test: int, seed: int, what: str, key: str = "data.test"
                 ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(the indices of n training samples kept for training, those held out — None when `test` is 0): `test` samples
    drawn by the seed, each set in order. `key` names the setting in the message for a count out of range."""
    if not 0 <= test < n:
        raise UserError(f"{key}={test} is not valid: expected 0 (none) to {n - 1} samples held out of "
                        f"{what}'s {n} training samples")
    if not test:
        return torch.arange(n), None
    order = torch.randperm(n, generator=test_generator(seed))
    return order[test:].sort().values, order[:test].sort().values


TEST_STREAM = 3  # keyed_seed(seed, TEST_STREAM): the test split's draws (views use stream 1, mixing 2)


def test_generator(seed: int) -> torch.Generator:
    """The generator of the test split's draws (which samples are held out, generated samples' labels): its own
    stream, so that the training and validation splits are those of a run without one."""
    return torch.Generator().manual_seed(keyed_seed(seed, TEST_STREAM))


class Tokenized(Dataset):
    """Items held in memory: {input_ids, attention_mask, labels}."""

    def __init__(self, items: list[dict[str, torch.Tensor]]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def lengths(self) -> torch.Tensor:
        """Every item's length in tokens (its input_ids)."""
        return torch.tensor([len(item["input_ids"]) for item in self.items], dtype=torch.int64)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.items[i]


def describe_split_sizes(ds: Datasets) -> str:
    """The log's line: the data, its splits' sizes, its samples' shape and (unless it has none) its classes."""
    train = "streamed" if ds.stream is not None else len(ds.train)
    return (f"data {ds.description}: {train} train / {len(ds.val)} val"
            + (f" / {len(ds.test)} test" if ds.test is not None else "") + ", "
            f"{'×'.join(map(str, ds.sample_shape))}" + (f", {ds.num_classes} {ds.classes}{named(ds.class_names)}"
                                                        if ds.classes else ""))

