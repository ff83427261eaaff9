"""Datasets (each a factory selected by `data=`, returning train and held-out splits) and the evaluation loader;
the train loader walks windows (accutrain.core.windows)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Subset, default_collate

from accutrain.config.schemas import Crop
from accutrain.core.samples import NamedCollate, NamedSubset
from accutrain.data.views import ImageSource, Views, fixed_view
from accutrain.errors import UserError
from accutrain.seeding import generator


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
    images: Optional[ImageSource] = None  # image data: what augment= makes its views from (accutrain.data.views)
    decoded: bool = False  # each item is read or decoded when asked (files, PIL images): loader workers help


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


def digits() -> Datasets:
    """The UCI handwritten digits that ship with accutrain (1,797 8×8 images, fixed 359-image held-out split)."""
    with resources.files("accutrain").joinpath("assets/digits.npz").open("rb") as f:
        npz = np.load(f)
        images = torch.from_numpy(npz["images"].astype(np.float32) / 16.0).unsqueeze(1)
        labels = torch.from_numpy(npz["labels"].astype(np.int64))
        val = torch.from_numpy(npz["val"])
    mean, std = images[~val].mean(), images[~val].std()
    source = ImageSource(InMemory(images[~val], labels[~val]), InMemory(images[val], labels[val]), size=8,
                         mean=(float(mean),), std=(float(std),), mirror=False)
    images = (images - mean) / std
    return Datasets(
        train=InMemory(images[~val], labels[~val]),
        val=InMemory(images[val], labels[val]),
        num_classes=10,
        sample_shape=(1, 8, 8),
        description="digits (UCI optdigits, CC BY 4.0)",
        images=source,
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
    target: str = "classes",
) -> Datasets:
    """Generated images whose label is learnable from their content; the same seed gives the same data. `target`:
    the class index (classes), or a fixed random row per class — num_classes Gaussian values (regression, for
    loss=mse|l1|huber) or a multi-hot set of about a third of the classes (multilabel, for loss=bce)."""
    if target not in TARGETS:
        raise UserError(f"data.target={target} is not valid: expected one of {', '.join(TARGETS)}")
    for key, value in dict(size=size, val_size=val_size, image_size=image_size, num_classes=num_classes,
                           channels=channels).items():
        if value < 1:
            raise UserError(f"data.{key}={value} is not valid: expected a positive integer")
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randn(num_classes, channels, 4, 4, generator=g)
    prototypes = F.interpolate(coarse, size=(image_size, image_size), mode="bilinear", align_corners=False)
    labels = torch.randint(num_classes, (size + val_size,), generator=g)
    table = (None if target == "classes" else torch.randn(num_classes, num_classes, generator=g)
             if target == "regression" else (torch.rand(num_classes, num_classes, generator=g) < 1 / 3).float())
    train = Synthetic(prototypes, labels[:size], noise, seed, offset=0, table=table)
    val = Synthetic(prototypes, labels[size:], noise, seed, offset=size, table=table)
    if (size + val_size) * prototypes[0].numel() * 4 <= SYNTHETIC_IN_MEMORY_BYTES:  # generate once, hold it
        train, val = (InMemory(torch.stack([d[i][0] for i in range(len(d))]), d.targets()) for d in (train, val))
    return Datasets(train, val, num_classes, (channels, image_size, image_size),
                    f"synthetic ({num_classes} classes{'' if table is None else ', ' + target + ' targets'}, seed "
                    f"{seed})",
                    images=ImageSource(train, val, image_size, (0.0,) * channels, (1.0,) * channels))


def sequences(size: int, val_size: int, vocab: int, min_length: int, max_length: int, seed: int,
              pad_target: int = -100) -> Datasets:
    """Generated token sequences of varying length: each next token follows a random (seeded) bigram table, and
    the target of every position is the next token. Sequences are padded to max_length with token 0, whose
    targets are `pad_target` (the loss's ignore_index): a per-element loss whose element count varies."""
    if vocab < 2 or not 1 <= min_length <= max_length:
        raise UserError(f"data: need vocab >= 2 and 1 <= min_length <= max_length, got vocab={vocab}, "
                        f"min_length={min_length}, max_length={max_length}")
    g = torch.Generator().manual_seed(seed)
    table = torch.softmax(3 * torch.randn(vocab, vocab, generator=g), dim=1)
    table[:, 0] = 0  # token 0 is padding, never generated
    n = size + val_size
    lengths = torch.randint(min_length, max_length + 1, (n,), generator=g)
    tokens = torch.zeros(n, max_length + 1, dtype=torch.int64)
    tokens[:, 0] = torch.randint(1, vocab, (n,), generator=g)
    for t in range(1, max_length + 1):
        tokens[:, t] = torch.multinomial(table[tokens[:, t - 1]], 1, generator=g).squeeze(1)
    inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    padded = torch.arange(max_length)[None, :] >= lengths[:, None]
    inputs[padded], targets[padded] = 0, pad_target
    return Datasets(InMemory(inputs[:size], targets[:size]), InMemory(inputs[size:], targets[size:]), vocab,
                    (max_length,), f"sequences (vocab {vocab}, length {min_length}–{max_length}, seed {seed})",
                    extra=dict(vocab_size=vocab), classes="tokens in the vocabulary")


_TORCHVISION = {
    "cifar10": dict(cls="CIFAR10", folder="cifar-10-batches-py", shape=(3, 32, 32), classes=10,
                    mean=(0.4914, 0.4822, 0.4465), std=(0.2470, 0.2435, 0.2616), size="170 MB"),
    "mnist": dict(cls="MNIST", folder="MNIST/raw", shape=(1, 28, 28), classes=10,
                  mean=(0.1307,), std=(0.3081,), size="12 MB", mirror=False),
}


def torchvision_dataset(name: str, root: str, download: bool) -> Datasets:
    """CIFAR-10 or MNIST through torchvision, from `root` (downloaded there when `download` is true)."""
    if name not in _TORCHVISION:
        raise UserError(f"data.name={name!r} is not valid: expected one of {', '.join(_TORCHVISION)}")
    import torchvision

    spec = _TORCHVISION[name]
    root_path = Path(os.path.expanduser(root)).resolve()
    cls = getattr(torchvision.datasets, spec["cls"])
    try:  # raw PIL images: the views (accutrain.data.views) are made from them
        train = cls(str(root_path), train=True, download=download)
        val = cls(str(root_path), train=False, download=download)
    except RuntimeError as e:
        if "not found" not in str(e).lower():
            raise
        raise UserError(
            f"{name} not found in data.root={root_path} (looked for {root_path / spec['folder']}): "
            f"add data.download=true to download it there ({spec['size']}), or point data.root at a copy"
        ) from None
    except OSError as e:  # download failed: no network, no write permission, ...
        raise UserError(f"could not download {name} to {root_path}: {e}") from None
    source = ImageSource(train, val, spec["shape"][-1], spec["mean"], spec["std"], mirror=spec.get("mirror", True))
    view = fixed_view(source)
    return Datasets(Views(train, view), Views(val, view), spec["classes"], spec["shape"], f"{name} ({root_path})",
                    images=source, decoded=True)


IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def _to_rgb(image: Any) -> Any:
    return image.convert("RGB")


def read_image(path: str) -> Any:
    """PIL's image at `path`, fully decoded; an unreadable or corrupt file is one clear line naming it."""
    from PIL import Image

    try:
        with open(path, "rb") as f:
            image = Image.open(f)
            image.load()
            return image
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise UserError(f"cannot read image {path}: {e}") from None


def image_folder(root: str, image_size: int, channels: int) -> Datasets:
    """Images in `root/train/<class>/` and `root/val/<class>/`, resized and centre-cropped to image_size."""
    if channels not in (1, 3):
        raise UserError(f"data.channels={channels} is not valid for imagefolder: expected 1 or 3")
    from torchvision import datasets as tvd
    from torchvision.transforms import v2

    root_path = Path(os.path.expanduser(root)).resolve()
    for split in ("train", "val"):
        if not (root_path / split).is_dir():
            raise UserError(
                f"data.root={root_path}: no {split}/ folder there; imagefolder expects "
                f"{root_path}/train/<class>/<image> and {root_path}/val/<class>/<image>"
            )
    mean, std = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)) if channels == 3 else ((0.5,), (0.5,))
    splits = {}
    for split in ("train", "val"):
        try:  # raw PIL images: the views (accutrain.data.views) are made from them
            splits[split] = tvd.ImageFolder(str(root_path / split), loader=read_image)
        except FileNotFoundError:
            raise UserError(
                f"no images found under {root_path / split}: expected class folders holding "
                f"{', '.join(IMAGE_EXTENSIONS)} files"
            ) from None
    train, val = splits["train"], splits["val"]
    if train.classes != val.classes:
        raise UserError(
            f"{root_path}: train/ and val/ hold different classes ({len(train.classes)} vs {len(val.classes)}): "
            "every class needs a folder in both"
        )
    source = ImageSource(train, val, image_size, mean, std, resize=True, crop=Crop.resized,
                         convert=(v2.Grayscale(1) if channels == 1 else v2.Lambda(_to_rgb),))
    view = fixed_view(source)
    return Datasets(Views(train, view), Views(val, view), len(train.classes), (channels, image_size, image_size),
                    f"imagefolder ({root_path}, {len(train.classes)} classes)", images=source, decoded=True)


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


def describe_split_sizes(ds: Datasets) -> str:
    return (f"data {ds.description}: {len(ds.train)} train / {len(ds.val)} val, "
            f"{'×'.join(map(str, ds.sample_shape))}, {ds.num_classes} {ds.classes}")

