"""What the model sees of each image: the training view (`augment=`, torchvision transforms.v2) and the evaluation
view (never augmented).

A random view of sample i in epoch e depends on (seed, e, i) only: the transform runs with torch's CPU generator
seeded from those three (seeding.seeded_cpu_rng), never on the global stream, a loader worker's stream, or the
sample's place in a micro-batch. So `micro_batch`, `accum`, `devices` and `loader.num_workers` never change a view,
and a resumed run sees the views the uninterrupted one would have seen.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.utils.data import Dataset

from accutrain.config import model_traits
from accutrain.config.schemas import Crop
from accutrain.config.typed import Factory
from accutrain.errors import UserError
from accutrain.seeding import keyed_seed, seeded_cpu_rng

log = logging.getLogger("accutrain")
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
    mirror: bool = True  # a horizontal mirror keeps every class (False for digits: augment.flip=auto does not flip)
    test: Optional[Dataset] = None  # the test split's raw items (data.test), seen through the held-out split's view


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
            steps.append(v2.RandomCrop(source.size, padding=padding(augment, source.size)))
    if flips(augment, source):
        steps.append(v2.RandomHorizontalFlip())
    if augment.policy == "trivialaugment":
        steps.append(v2.TrivialAugmentWide())
    elif augment.policy == "randaugment":
        steps.append(v2.RandAugment(num_ops=augment.num_ops, magnitude=augment.magnitude))
    steps += finish(mean, std)
    if augment.random_erasing:
        steps.append(v2.RandomErasing(p=augment.random_erasing))  # zeros: the mean, after normalisation
    return v2.Compose([*steps, v2.ToPureTensor()])


def padding(augment: Any, size: int) -> int:
    """crop=pad's padding in pixels: as given, or (auto) an eighth of the image size, rounded, at least 1 — CIFAR's
    4 px on 32×32 images, 2 on 16×16, 1 on the 8×8 digits, so the random shift is the same share of any image."""
    return max(1, round(size / 8)) if augment.padding == "auto" else int(augment.padding)


def flips(augment: Any, source: Optional[ImageSource]) -> bool:
    """Whether the training view mirrors at random: augment.flip=true or false as given; auto only where a mirror
    keeps the classes (not digits or MNIST, whose 2, 3, 5, 7 mirrored are no digit)."""
    if augment.flip == "auto":
        return source is not None and source.mirror
    return bool(augment.flip)


def is_random(augment: Any, source: Optional[ImageSource] = None) -> bool:
    """Whether the recipe draws anything per sample on `source`'s images (MixUp/CutMix are drawn per window:
    accutrain.core.mixing)."""
    return (augment.crop is not Crop.none or flips(augment, source) or augment.policy is not None
            or augment.random_erasing > 0)


def ruinous(augment: Any, source: ImageSource) -> Optional[str]:
    """A warning when the recipe would erase most of an image or change its class: a shift of a quarter of the image
    or more (a pad-and-crop at its largest keeps under 56 % of it; TrivialAugmentWide translates up to 32 px, made
    for images of 32 px and more; RandAugment up to 0.45 × size × magnitude / 30), or a flip on data whose classes a
    mirror changes; resized crops of under 56 % of an image smaller than 32 px. Its first line is the console's,
    the rest its detail (train.log)."""
    size, crop = source.size, source.crop if augment.crop is Crop.auto else augment.crop
    harms = []  # (for the console, for train.log)
    if crop is Crop.pad and 4 * padding(augment, size) >= size:
        harms.append((f"augment.padding={padding(augment, size)}",
                      f"augment.padding={padding(augment, size)} shifts up to {padding(augment, size)} px"))
    if augment.policy == "trivialaugment" and size < 32:
        harms.append(("trivialaugment shifts up to 32 px", "augment.policy=trivialaugment translates up to 32 px and "
                      "rotates up to 135° (TrivialAugmentWide, made for images of 32 px and more)"))
    if crop is Crop.resized and size < 32 and augment.scale[0] < 0.56:
        harms.append((f"crops of {augment.scale[0]:.0%}", f"crop=resized keeps as little as {augment.scale[0]:.0%} "
                      "of the image (augment.scale)"))
    if augment.policy == "randaugment" and 4 * 0.453 * augment.magnitude / 30 >= 1:
        harms.append((f"magnitude {augment.magnitude}", f"augment.policy=randaugment at magnitude "
                      f"{augment.magnitude} translates up to {0.453 * augment.magnitude / 30:.0%} of the image"))
    if harms:
        return (f"augment may erase most of each {size}×{size} image: {', '.join(h[0] for h in harms)}\n"
                f"{'; '.join(h[1] for h in harms)}. At its largest, a shift of a quarter of the image or more leaves "
                "under 56 % of it. augment=crop_flip (its padding auto: an eighth of the image size) or augment=none "
                "keep most of each image")
    if augment.flip is True and not source.mirror:
        return ("augment.flip=true mirrors images whose class a mirror changes (digits); augment.flip=auto does not"
                "\na mirrored 2, 3, 5 or 7 is no digit: the model learns from wrong labels")
    return None


def pretrained_normalisation(model_cfg: Factory, channels: int
                             ) -> Optional[tuple[tuple[float, ...], tuple[float, ...]]]:
    """(mean, std) that a torchvision model's pretrained weights were trained with, from the weights' own transforms
    (for one channel: their average); None for any other model."""
    if not model_traits.imagenet_weights(model_cfg):
        return None
    import torchvision

    transforms = torchvision.models.get_model_weights(model_cfg["name"]).DEFAULT.transforms()
    mean, std = tuple(transforms.mean), tuple(transforms.std)
    if channels == 1:
        mean, std = (sum(mean) / len(mean),), (sum(std) / len(std),)
    return mean, std


def apply(datasets: Any, augment: Any, model_cfg: Factory, seed: int, copies: int = 1) -> Any:
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
                                   val=Views(source.val, random_view(source, augment, mean, std), seed, copies),
                                   test=Views(source.test, random_view(source, augment, mean, std), seed, copies)
                                   if source.test is not None else None)
    if source is None:
        if is_random(augment, None) or augment.flip is True or augment.eval_crop_ratio != 1.0:
            key = (f"augment.crop={augment.crop.name}" if augment.crop is not Crop.none else
                   "augment.flip=true" if augment.flip is True else f"augment.policy={augment.policy}" if augment.policy
                   else f"augment.random_erasing={augment.random_erasing}" if augment.random_erasing
                   else f"augment.eval_crop_ratio={augment.eval_crop_ratio}")
            raise UserError(f"{key}: data {datasets.description} has no images to augment; use augment=none")
        return datasets
    pretrained = pretrained_normalisation(model_cfg, datasets.sample_shape[0])
    mean, std = pretrained or (source.mean, source.std)
    train, val, test = datasets.train, datasets.val, datasets.test
    if is_random(augment, source):
        if warning := ruinous(augment, source):
            log.warning(warning)
        train = Views(source.train, random_view(source, augment, mean, std), seed)
    elif pretrained:
        train = Views(source.train, fixed_view(source, 1.0, mean, std))
    if augment.eval_crop_ratio != 1.0 or pretrained:
        view = fixed_view(source, augment.eval_crop_ratio, mean, std)
        val = Views(source.val, view)
        test = Views(source.test, view) if source.test is not None else test
    return dataclasses.replace(datasets, train=train, val=val, test=test)
