"""What the model sees of each image: the training view (`augment=`, torchvision transforms.v2) and the evaluation
view (never augmented).

A random view of sample i in epoch e depends on (seed, e, i) only: the transform runs with torch's CPU generator
seeded from those three (seeding.seeded_cpu_rng), never on the global stream, a loader worker's stream, or the
sample's place in a micro-batch. So `micro_batch`, `accum`, `devices` and `loader.num_workers` never change a view,
and a resumed run sees the views the uninterrupted one would have seen.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.utils.data import Dataset

from accutrain.config.schemas import Crop
from accutrain.errors import UserError
from accutrain.seeding import keyed_seed, seeded_cpu_rng

VIEW_STREAM = 1  # keyed_seed(seed, VIEW_STREAM, epoch, index): one sample's view in one epoch


@dataclass(frozen=True)
class ImageSource:
    """What an image dataset's views are made from (`Datasets.images`): its raw items and its fixed view."""

    train: Dataset  # (raw image, target): a PIL image, or a C×H×W tensor
    val: Dataset
    size: int  # the fixed view's height and width
    mean: tuple[float, ...]  # the normalisation every view ends with
    std: tuple[float, ...]
    convert: tuple[Any, ...] = ()  # transforms every view starts with (a PIL mode conversion)
    resize: bool = False  # raw images vary in size: the fixed view resizes the shorter side, then centre-crops
    crop: Crop = Crop.pad  # what augment.crop=auto means for this data: resized (photos) or pad (small images)


class Views(Dataset):
    """(transform(raw image), target) for each raw item. With a `seed` the transform is random: `view(epoch, i)`
    draws it from (seed, epoch, i); indexing gives epoch 0's view."""

    def __init__(self, raw: Dataset, transform: Callable[[Any], torch.Tensor], seed: Optional[int] = None,
                 copies: int = 1) -> None:
        self.raw, self.transform, self.seed, self.copies = raw, transform, seed, copies

    def __len__(self) -> int:
        return len(self.raw)  # type: ignore[arg-type]

    def view(self, epoch: int, index: int) -> tuple[torch.Tensor, Any]:
        """Sample `index`'s view in `epoch`; with copies > 1 (augment.views) that many views stacked, view v drawn from
        (seed, epoch, index, v)."""
        image, target = self.raw[index]
        if self.seed is None:
            return self.transform(image), target
        if self.copies > 1:
            drawn = []
            for v in range(self.copies):
                with seeded_cpu_rng(keyed_seed(self.seed, VIEW_STREAM, epoch, index, v)):
                    drawn.append(self.transform(image))
            return torch.stack(drawn), target
        with seeded_cpu_rng(keyed_seed(self.seed, VIEW_STREAM, epoch, index)):
            return self.transform(image), target

    def __getitem__(self, index: int) -> tuple[torch.Tensor, Any]:
        return self.view(0, index)


def finish(mean: tuple[float, ...], std: tuple[float, ...]) -> list[Any]:
    """An image (PIL, uint8 or float tensor) → a normalised float32 tensor."""
    from torchvision.transforms import v2

    return [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(mean), list(std))]


def fixed_geometry(source: ImageSource, crop_ratio: float = 1.0) -> list[Any]:
    """Resize the shorter side to size / crop_ratio and centre-crop size (nothing for fixed-size images at ratio 1)."""
    from torchvision.transforms import v2

    if not source.resize and crop_ratio == 1.0:
        return []
    return [v2.Resize(round(source.size / crop_ratio), antialias=True), v2.CenterCrop(source.size)]


def fixed_view(source: ImageSource, crop_ratio: float = 1.0, mean: Optional[tuple[float, ...]] = None,
               std: Optional[tuple[float, ...]] = None) -> Callable[[Any], torch.Tensor]:
    """The evaluation view (and augment=none's training view): convert, resize and centre-crop, normalise."""
    from torchvision.transforms import v2

    return v2.Compose([*source.convert, *fixed_geometry(source, crop_ratio),
                       *finish(mean or source.mean, std or source.std), v2.ToPureTensor()])


def random_view(source: ImageSource, augment: Any, mean: tuple[float, ...], std: tuple[float, ...]
                ) -> Callable[[Any], torch.Tensor]:
    """The training view of the recipe `augment`: a crop, a flip, a policy, normalisation, random erasing."""
    from torchvision.transforms import v2

    crop = source.crop if augment.crop is Crop.auto else augment.crop
    steps = list(source.convert)
    if crop is Crop.resized:
        steps.append(v2.RandomResizedCrop(source.size, scale=tuple(augment.scale), ratio=tuple(augment.ratio),
                                          antialias=True))
    else:
        steps += fixed_geometry(source)
        if crop is Crop.pad:
            steps.append(v2.RandomCrop(source.size, padding=augment.padding))
    if augment.flip:
        steps.append(v2.RandomHorizontalFlip())
    if augment.policy == "trivialaugment":
        steps.append(v2.TrivialAugmentWide())
    elif augment.policy == "randaugment":
        steps.append(v2.RandAugment(num_ops=augment.num_ops, magnitude=augment.magnitude))
    steps += finish(mean, std)
    if augment.random_erasing:
        steps.append(v2.RandomErasing(p=augment.random_erasing))  # zeros: the mean, after normalisation
    return v2.Compose([*steps, v2.ToPureTensor()])


def is_random(augment: Any) -> bool:
    """Whether the recipe draws anything per sample (MixUp/CutMix are drawn per window: accutrain.core.mixing)."""
    return augment.crop is not Crop.none or augment.flip or augment.policy is not None or augment.random_erasing > 0


def pretrained_normalisation(model_cfg: Any, channels: int) -> Optional[tuple[tuple[float, ...], tuple[float, ...]]]:
    """(mean, std) that a torchvision model's pretrained weights were trained with, from the weights' own transforms
    (for one channel: their average); None for any other model."""
    if not model_cfg.get("pretrained") or model_cfg.get("_target_") != "accutrain.models.torchvision_classifier":
        return None
    import torchvision

    transforms = torchvision.models.get_model_weights(model_cfg.name).DEFAULT.transforms()
    mean, std = tuple(transforms.mean), tuple(transforms.std)
    if channels == 1:
        mean, std = (sum(mean) / len(mean),), (sum(std) / len(std),)
    return mean, std


def apply(datasets: Any, augment: Any, model_cfg: Any, seed: int, copies: int = 1) -> Any:
    """The accutrain.data.Datasets as this run sees them: the training split through the recipe's random view (drawn
    per sample from (seed, epoch, sample)), the held-out split through its fixed view; both normalised as
    pretrained weights expect. copies > 1 (augment.views): each sample is that many random views of it, in both
    splits (the held-out split's drawn as epoch 0's, the same at every evaluation)."""
    source = datasets.images
    if copies != 1:
        if copies != 2:
            raise UserError(f"augment.views={copies} is not valid: expected 1, or 2 (a pair of views per sample)")
        if source is None or not is_random(augment):
            raise UserError("augment.views=2 needs two different random views of each image: " + (
                f"data {datasets.description} has no images" if source is None else
                "set a random augment= (e.g. augment=crop_flip)"))
        mean, std = source.mean, source.std
        return dataclasses.replace(datasets, train=Views(source.train, random_view(source, augment, mean, std), seed,
                                                         copies),
                                   val=Views(source.val, random_view(source, augment, mean, std), seed, copies))
    if source is None:
        if is_random(augment) or augment.eval_crop_ratio != 1.0:
            key = (f"augment.crop={augment.crop.name}" if augment.crop is not Crop.none else
                   "augment.flip=true" if augment.flip else f"augment.policy={augment.policy}" if augment.policy
                   else f"augment.random_erasing={augment.random_erasing}" if augment.random_erasing
                   else f"augment.eval_crop_ratio={augment.eval_crop_ratio}")
            raise UserError(f"{key}: data {datasets.description} has no images to augment; use augment=none")
        return datasets
    pretrained = pretrained_normalisation(model_cfg, datasets.sample_shape[0])
    mean, std = pretrained or (source.mean, source.std)
    train, val = datasets.train, datasets.val
    if is_random(augment):
        train = Views(source.train, random_view(source, augment, mean, std), seed)
    elif pretrained:
        train = Views(source.train, fixed_view(source, 1.0, mean, std))
    if augment.eval_crop_ratio != 1.0 or pretrained:
        val = Views(source.val, fixed_view(source, augment.eval_crop_ratio, mean, std))
    return dataclasses.replace(datasets, train=train, val=val)
