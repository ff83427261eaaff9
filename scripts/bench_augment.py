"""What augmentation costs the train loader: samples/s of one epoch of the window loader, without augmentation,
with each recipe, and with MixUp+CutMix (which reads two samples per sample), on CIFAR-10's format (generated: no
download) — 32×32 RGB PIL images made from uint8 arrays held in memory, as torchvision's CIFAR10 returns them —
alternating the variants round after round and reporting medians.

    python scripts/bench_augment.py [--rounds 5] [--size 2048] [--workers 0]

"unseeded" is crop_flip drawing from torch's global stream, as other trainers do: the difference with crop_flip
is what the per-sample seeding (seeding.seeded_cpu_rng around each view) costs.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch
from torch.utils.data import Dataset

from accutrain.config.train import compose
from accutrain.config.validate import typed_run
from accutrain.data.datasets import Datasets
from accutrain.data.views import ImageSource, Views, fixed_view
from accutrain.dist import World
from accutrain.train.build import build

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)  # CIFAR-10's


class PILImages(Dataset):
    """uint8 H×W×3 arrays returned as PIL images, as torchvision.datasets.CIFAR10 does."""

    def __init__(self, pixels: np.ndarray, labels: np.ndarray) -> None:
        self.pixels, self.labels = pixels, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        from PIL import Image

        return Image.fromarray(self.pixels[i]), int(self.labels[i])


def cifar_like(size: int, seed: int = 0) -> Datasets:
    """Random CIFAR-10-shaped images and labels, with the views a data=cifar10 run makes."""
    rng = np.random.default_rng(seed)
    train = PILImages(rng.integers(0, 256, (size, 32, 32, 3), dtype=np.uint8), rng.integers(0, 10, size))
    val = PILImages(rng.integers(0, 256, (16, 32, 32, 3), dtype=np.uint8), rng.integers(0, 10, 16))
    source = ImageSource(train, val, 32, MEAN, STD)
    view = fixed_view(source)
    return Datasets(Views(train, view), Views(val, view), 10, (3, 32, 32), "CIFAR-10-like", images=source)

VARIANTS = {
    "none": ["augment=none"],
    "crop_flip": ["augment=crop_flip"],
    "unseeded": ["augment=crop_flip"],  # the same transform on the global stream
    "rrc_flip": ["augment=rrc_flip"],
    "trivialaugment": ["augment=trivialaugment"],
    "crop_flip+mix": ["augment=crop_flip", "augment.mixup_alpha=0.2", "augment.cutmix_alpha=1.0",
                      "augment.mix_mode=sample"],
}


def loader_for(name: str, size: int, workers: int, micro_batch: int):
    cfg = compose("model=mlp", "model.hidden=[16]", "data=custom", "data._target_=bench_augment.cifar_like",
                  f"+data.size={size}", f"loader.num_workers={workers}",
                  f"micro_batch={micro_batch}", "trainer.progress=false", *VARIANTS[name])
    c = build(typed_run(cfg), World(), torch.device("cpu"))
    if name == "unseeded":
        data = c.loader.dataset.dataset
        c.loader.dataset.dataset = Views(data.raw, data.transform, seed=None)
    return c


def epoch_rate(c) -> float:
    c.sampler.set_epoch(0)
    start, n = time.perf_counter(), 0
    for _, batch in c.loader:
        n += len(batch)
    return n / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_augment.cifar_like, also in workers
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--size", type=int, default=2048, help="training images (3×32×32)")
    parser.add_argument("--workers", type=int, default=0, help="loader.num_workers")
    parser.add_argument("--micro-batch", type=int, default=128)
    args = parser.parse_args(argv)
    print(f"$ python scripts/bench_augment.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {args.size} images 3×32×32, micro_batch {args.micro_batch}, "
          f"loader.num_workers={args.workers}")
    loaders = {name: loader_for(name, args.size, args.workers, args.micro_batch) for name in VARIANTS}
    for c in loaders.values():
        epoch_rate(c)  # warm-up: workers started, caches filled
    rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for r in range(args.rounds):
        order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
        for name in order:
            rates[name].append(epoch_rate(loaders[name]))
        print(f"round {r + 1}: " + "  ".join(f"{name} {rates[name][-1]:,.0f}" for name in VARIANTS))
    base = statistics.median(rates["none"])
    print("median samples/s (× augment=none):")
    for name in VARIANTS:
        median = statistics.median(rates[name])
        print(f"  {name:<15} {median:>9,.0f}  ({median / base:.2f}×)")


if __name__ == "__main__":
    main()
