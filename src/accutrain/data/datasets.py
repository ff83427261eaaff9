"""Datasets (each a factory selected by `data=`, returning train and held-out splits) and the evaluation loader;
the train loader walks windows (accutrain.core.windows)."""
from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Subset, default_collate

from accutrain.core.samples import NamedCollate, NamedSubset
from accutrain.data.splits import Datasets, InMemory, describe_split_sizes, loader_workers, test_generator, test_indices  # noqa: F401 (re-exported)
from accutrain.data.views import ImageSource, Views, fixed_view
from accutrain.errors import UserError
from accutrain.seeding import generator


def digits(test: int = 0, seed: int = 0) -> Datasets:
    """The UCI handwritten digits that ship with accutrain (1,797 8×8 images, fixed 359-image held-out split);
    `test` > 0 holds that many of the 1,438 training images out as a test split, drawn by the seed."""
    with resources.files("accutrain").joinpath("assets/digits.npz").open("rb") as f:
        npz = np.load(f)
        images = torch.from_numpy(npz["images"].astype(np.float32) / 16.0).unsqueeze(1)
        labels = torch.from_numpy(npz["labels"].astype(np.int64))
        val = torch.from_numpy(npz["val"])
    train_images, train_labels = images[~val], labels[~val]
    kept, held = test_indices(len(train_labels), test, seed, "digits")
    mean, std = train_images[kept].mean(), train_images[kept].std()
    raw = {split: InMemory(x, y) for split, (x, y) in dict(
        train=(train_images[kept], train_labels[kept]), val=(images[val], labels[val]),
        test=(train_images[held], train_labels[held]) if held is not None else (None, None)).items() if x is not None}
    source = ImageSource(raw["train"], raw["val"], size=8, mean=(float(mean),), std=(float(std),), mirror=False,
                         test=raw.get("test"))
    normal = {split: InMemory((d.images - mean) / std, d.labels) for split, d in raw.items()}
    return Datasets(
        train=normal["train"],
        val=normal["val"],
        num_classes=10,
        sample_shape=(1, 8, 8),
        description="digits (UCI optdigits, CC BY 4.0)",
        images=source,
        test=normal.get("test"),
    )


class Synthetic(Dataset):
    """Sample i is a smooth class prototype plus Gaussian noise drawn from a generator seeded by (seed, i)."""

    def __init__(self, prototypes: torch.Tensor, labels: torch.Tensor, noise: float, seed: int, offset: int,
                 table: Optional[torch.Tensor] = None):
        self.prototypes, self.labels, self.noise, self.seed, self.offset = prototypes, labels, noise, seed, offset
        self.table = table  # a target row per class (regression, multi-label); None: the class index

    def __len__(self) -> int:
        return len(self.labels)

    def targets(self) -> torch.Tensor:
        """Every sample's target."""
        return self.labels if self.table is None else self.table[self.labels]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = generator(self.seed, self.offset + i)
        y = self.labels[i]
        x = self.prototypes[y] + self.noise * torch.randn(self.prototypes.shape[1:], generator=g)
        return x, (y if self.table is None else self.table[y])


SYNTHETIC_IN_MEMORY_BYTES = 256 * 2**20  # larger synthetic sets are generated per sample, on demand


TARGETS = ("classes", "regression", "multilabel")


def synthetic(
    size: int, val_size: int, image_size: int, num_classes: int, channels: int, noise: float, seed: int,
    target: str = "classes", test: int = 0,
) -> Datasets:
    """Generated images whose label is learnable from their content; the same seed gives the same data. `target`:
    the class index (classes), or a fixed random row per class — num_classes Gaussian values (regression, for
    loss=mse|l1|huber) or a multi-hot set of about a third of the classes (multilabel, for loss=bce). `test` > 0:
    that many more samples as a test split (the training and validation samples stay those of a run without)."""
    if target not in TARGETS:
        raise UserError(f"data.target={target} is not valid: expected one of {', '.join(TARGETS)}")
    for key, value in dict(size=size, val_size=val_size, image_size=image_size, num_classes=num_classes,
                           channels=channels).items():
        if value < 1:
            raise UserError(f"data.{key}={value} is not valid: expected a positive integer")
    if test < 0:
        raise UserError(f"data.test={test} is not valid: expected 0 (no test split) or the number of test samples")
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randn(num_classes, channels, 4, 4, generator=g)
    prototypes = F.interpolate(coarse, size=(image_size, image_size), mode="bilinear", align_corners=False)
    labels = torch.randint(num_classes, (size + val_size,), generator=g)
    table = (None if target == "classes" else torch.randn(num_classes, num_classes, generator=g)
             if target == "regression" else (torch.rand(num_classes, num_classes, generator=g) < 1 / 3).float())
    train = Synthetic(prototypes, labels[:size], noise, seed, offset=0, table=table)
    val = Synthetic(prototypes, labels[size:], noise, seed, offset=size, table=table)
    held = (Synthetic(prototypes, torch.randint(num_classes, (test,), generator=test_generator(seed)), noise, seed,
                      offset=size + val_size, table=table) if test else None)
    if (size + val_size + test) * prototypes[0].numel() * 4 <= SYNTHETIC_IN_MEMORY_BYTES:  # generate once, hold it
        train, val, held = (InMemory(torch.stack([d[i][0] for i in range(len(d))]), d.targets()) if d is not None
                            else None for d in (train, val, held))
    return Datasets(train, val, num_classes, (channels, image_size, image_size),
                    f"synthetic ({num_classes} classes{'' if table is None else ', ' + target + ' targets'}, seed "
                    f"{seed})",
                    images=ImageSource(train, val, image_size, (0.0,) * channels, (1.0,) * channels, test=held),
                    test=held)


def sequences(size: int, val_size: int, vocab: int, min_length: int, max_length: int, seed: int,
              pad_target: int = -100, test: int = 0) -> Datasets:
    """Generated token sequences of varying length: each next token follows a random (seeded) bigram table, and
    the target of every position is the next token. Sequences are padded to max_length with token 0, whose
    targets are `pad_target` (the loss's ignore_index): a per-element loss whose element count varies. `test` > 0:
    that many more sequences as a test split (the training and validation ones stay those of a run without)."""
    if vocab < 2 or not 1 <= min_length <= max_length:
        raise UserError(f"data: need vocab >= 2 and 1 <= min_length <= max_length, got vocab={vocab}, "
                        f"min_length={min_length}, max_length={max_length}")
    if test < 0:
        raise UserError(f"data.test={test} is not valid: expected 0 (no test split) or the number of test sequences")
    g = torch.Generator().manual_seed(seed)
    table = torch.softmax(3 * torch.randn(vocab, vocab, generator=g), dim=1)
    table[:, 0] = 0  # token 0 is padding, never generated
    inputs, targets = bigram_sequences(table, size + val_size, min_length, max_length, pad_target, g)
    held = (InMemory(*bigram_sequences(table, test, min_length, max_length, pad_target, test_generator(seed)))
            if test else None)
    return Datasets(InMemory(inputs[:size], targets[:size]), InMemory(inputs[size:], targets[size:]), vocab,
                    (max_length,), f"sequences (vocab {vocab}, length {min_length}–{max_length}, seed {seed})",
                    extra=dict(vocab_size=vocab), classes="tokens in the vocabulary", test=held)


def bigram_sequences(table: torch.Tensor, n: int, min_length: int, max_length: int, pad_target: int,
                     g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """n sequences drawn from the bigram `table` with `g`: (inputs, next-token targets), padded to max_length."""
    vocab = len(table)
    lengths = torch.randint(min_length, max_length + 1, (n,), generator=g)
    tokens = torch.zeros(n, max_length + 1, dtype=torch.int64)
    tokens[:, 0] = torch.randint(1, vocab, (n,), generator=g)
    for t in range(1, max_length + 1):
        tokens[:, t] = torch.multinomial(table[tokens[:, t - 1]], 1, generator=g).squeeze(1)
    inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    padded = torch.arange(max_length)[None, :] >= lengths[:, None]
    inputs[padded], targets[padded] = 0, pad_target
    return inputs, targets


_TORCHVISION = {
    "cifar10": dict(cls="CIFAR10", folder="cifar-10-batches-py", shape=(3, 32, 32), classes=10,
                    mean=(0.4914, 0.4822, 0.4465), std=(0.2470, 0.2435, 0.2616), size="170 MB"),
    "mnist": dict(cls="MNIST", folder="MNIST/raw", shape=(1, 28, 28), classes=10,
                  mean=(0.1307,), std=(0.3081,), size="12 MB", mirror=False),
}


def torchvision_dataset(name: str, root: str, download: bool, test: bool = False, val_size: int = 5000,
                        seed: int = 0) -> Datasets:
    """CIFAR-10 or MNIST through torchvision, from `root` (downloaded there when `download` is true); the held-out
    split is torchvision's test split, or with `test` the test stage's, and `val_size` training images, drawn by the
    seed, the held-out split."""
    if name not in _TORCHVISION:
        raise UserError(f"data.name={name!r} is not valid: expected one of {', '.join(_TORCHVISION)}")
    import torchvision

    spec = _TORCHVISION[name]
    root_path = Path(os.path.expanduser(root)).resolve()
    cls = getattr(torchvision.datasets, spec["cls"])
    try:  # raw PIL images: the views (accutrain.data.views) are made from them
        train = cls(str(root_path), train=True, download=download)
        val = cls(str(root_path), train=False, download=download)
        names = [str(name) for name in getattr(train, "classes", ())]
    except RuntimeError as e:
        if "not found" not in str(e).lower():
            raise
        raise UserError(
            f"{name} not found in data.root={root_path} (looked for {root_path / spec['folder']}): "
            f"add data.download=true to download it there ({spec['size']}), or point data.root at a copy"
        ) from None
    except OSError as e:  # download failed: no network, no write permission, ...
        raise UserError(f"could not download {name} to {root_path}: {e}") from None
    held = None
    if test:  # the official test split is tested once, at the end; validation is held out of the training split
        kept, out = test_indices(len(train), val_size, seed, name, key="data.val_size")
        train, val, held = Subset(train, kept.tolist()), Subset(train, out.tolist()), val
    source = ImageSource(train, val, spec["shape"][-1], spec["mean"], spec["std"], mirror=spec.get("mirror", True),
                         test=held)
    view = fixed_view(source)
    return Datasets(Views(train, view), Views(val, view), spec["classes"], spec["shape"], f"{name} ({root_path})",
                    images=source, decoded=True, test=Views(held, view) if held is not None else None,
                    class_names=tuple(names))


def eval_loader(dataset: Dataset, batch_size: int, num_workers: int, pin_memory: bool, seed: int,
                collate: Optional[Callable[[list], Any]] = None) -> DataLoader:
    """The held-out split in order. Evaluating never draws from the global RNG that dropout draws from."""
    # Each iterator a DataLoader makes draws its workers' base seed from `generator`, or without one from torch's
    # global RNG. With persistent workers the iterator is made once per process: at the first evaluation of an
    # uninterrupted run, at the first one after the checkpoint of a resumed run — a draw the other run did not make.
    # A sample that fails to be read or collated is one line naming it (in a worker too), indexed as in the split.
    named = (NamedSubset(dataset.dataset, dataset.indices, "held-out") if isinstance(dataset, Subset)
             else NamedSubset(dataset, range(len(dataset)), "held-out"))  # type: ignore[arg-type]
    return DataLoader(named, batch_size=batch_size, shuffle=False, num_workers=num_workers,
                      collate_fn=NamedCollate(collate or default_collate, "held-out"), pin_memory=pin_memory,
                      persistent_workers=num_workers > 0, generator=torch.Generator().manual_seed(seed))
