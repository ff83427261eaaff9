"""MixUp and CutMix over the window, the same under any split.

Each window draws, from (seed, epoch, window) only, a permutation of its samples (sample j's partner is the one at
position π(j) of the window, which may sit in another micro-batch or on another rank: the loader reads it too), and
per window (augment.mix_mode=window) or per sample (=sample): whether to mix (augment.mix_prob), MixUp or CutMix
(augment.switch_prob), λ ~ Beta(α, α), and CutMix's box (λ then becomes the share of the image left unboxed). The
mixed sample is (λ x_j + (1 - λ) x_π(j), λ e_yj + (1 - λ) e_yπ(j)); its soft target's summed cross-entropy,
divided by the window's sample count, keeps the step the mean over the window (accutrain.core.step).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F

from accutrain.core.options import MixMode
from accutrain.errors import UserError
from accutrain.seeding import keyed_seed

MIX_STREAM = 2  # keyed_seed(seed, MIX_STREAM, epoch, window): one window's mixing draws


@dataclass(frozen=True)
class Mix:
    """How one sample is mixed: with the sample at dataset index `partner`, keeping the share `lam` of its own."""

    partner: int
    lam: float = 1.0  # 1: not mixed
    box: Optional[tuple[int, int, int, int]] = None  # CutMix: rows y0:y1 and columns x0:x1 come from the partner


@dataclass(frozen=True)
class Mixer:
    """The run's MixUp/CutMix (`augment.mixup_alpha`, `cutmix_alpha`, `mix_prob`, `switch_prob`, `mix_mode`)."""

    seed: int
    num_classes: int
    height: int
    width: int
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    prob: float = 1.0
    switch_prob: float = 0.5
    per_sample: bool = False

    def plan(self, epoch: int, window: int, samples: list[int]) -> list[Mix]:
        """Each sample's Mix in a window of `samples` (dataset indices, in window order): from (seed, epoch, window)."""
        rng = np.random.default_rng(keyed_seed(self.seed, MIX_STREAM, epoch, window))
        n = len(samples)
        partners = rng.permutation(n)
        draws = n if self.per_sample else 1
        mixed = rng.random(draws) < self.prob
        if self.mixup_alpha > 0 and self.cutmix_alpha > 0:
            cutmix = rng.random(draws) < self.switch_prob
        else:
            cutmix = np.full(draws, self.cutmix_alpha > 0)
        lam = np.where(cutmix, self.beta(rng, self.cutmix_alpha, draws), self.beta(rng, self.mixup_alpha, draws))
        centres = rng.integers(0, [self.height, self.width], size=(draws, 2))
        mixes = []
        for k in range(n):
            d = k if self.per_sample else 0
            partner = samples[int(partners[k])]
            if not mixed[d]:
                mixes.append(Mix(samples[k]))
            elif cutmix[d]:
                box = self.box(float(lam[d]), int(centres[d, 0]), int(centres[d, 1]))
                area = (box[1] - box[0]) * (box[3] - box[2])
                mixes.append(Mix(partner, 1.0 - area / (self.height * self.width), box))
            else:
                mixes.append(Mix(partner, float(lam[d])))
        return mixes

    @staticmethod
    def beta(rng: np.random.Generator, alpha: float, draws: int) -> np.ndarray:
        return rng.beta(alpha, alpha, draws) if alpha > 0 else np.ones(draws)

    def box(self, lam: float, cy: int, cx: int) -> tuple[int, int, int, int]:
        """CutMix's box around (cy, cx), of area (1 - λ) of the image before clipping to its edges."""
        cut = math.sqrt(1.0 - lam)
        h, w = int(self.height * cut), int(self.width * cut)
        return (max(cy - h // 2, 0), min(cy + h // 2, self.height), max(cx - w // 2, 0), min(cx + w // 2, self.width))

    def mixed(self, item: tuple[torch.Tensor, Any], partner: Optional[tuple[torch.Tensor, Any]], mix: Mix
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mixed image, soft target) of a sample and its partner's item (None when it is not mixed)."""
        image, label = item
        target = F.one_hot(torch.as_tensor(label), self.num_classes).float()
        if partner is None or mix.lam == 1.0:
            return image, target
        other, other_label = partner
        if mix.box is not None:
            y0, y1, x0, x1 = mix.box
            image = image.clone()
            image[..., y0:y1, x0:x1] = other[..., y0:y1, x0:x1]
        else:
            image = image * mix.lam + other * (1.0 - mix.lam)
        return image, target * mix.lam + F.one_hot(torch.as_tensor(other_label), self.num_classes).float() * (
            1.0 - mix.lam)


def make_mixer(augment: Any, seed: int, num_classes: int, example: Any) -> Optional[Mixer]:
    """The run's Mixer, or None when augment.mixup_alpha and cutmix_alpha are 0. `example` is one training item:
    MixUp/CutMix need an image (a float C×H×W tensor) and one class per sample; anything else is one line."""
    if not augment.mixup_alpha and not augment.cutmix_alpha:
        return None
    key = f"augment.{'mixup' if augment.mixup_alpha else 'cutmix'}_alpha"
    value = augment.mixup_alpha or augment.cutmix_alpha
    if not isinstance(example, (tuple, list)) or len(example) != 2:
        raise UserError(f"{key}={value}: MixUp/CutMix need (image, class) items; this data's items are "
                        f"{type(example).__name__}s: use {key}=0")
    image, label = example
    if torch.as_tensor(label).dim() != 0:
        raise UserError(f"{key}={value}: MixUp/CutMix need one class per sample; this data has a target per element "
                        f"(shape {tuple(torch.as_tensor(label).shape)}): use {key}=0")
    if not isinstance(image, torch.Tensor) or not image.is_floating_point() or image.dim() != 3:
        raise UserError(f"{key}={value}: MixUp/CutMix mix images (float C×H×W tensors); this data's inputs are "
                        f"{getattr(image, 'dtype', type(image).__name__)} of shape "
                        f"{tuple(getattr(image, 'shape', ()))}: use {key}=0")
    return Mixer(seed, num_classes, image.shape[-2], image.shape[-1], augment.mixup_alpha, augment.cutmix_alpha,
                 augment.mix_prob, augment.switch_prob, augment.mix_mode is MixMode.sample)
